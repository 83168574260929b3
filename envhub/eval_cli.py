"""``envhub eval``: built-in agents, or any model behind an OpenAI-compatible endpoint, on envs.

A thin layer over ``envhub.evaluation.evaluate``: options, a live progress bar (episodes
done, success so far, failures) and the summary table. Examples::

    envhub eval --episodes 10                                  # random vs expert, every game
    envhub eval games/sokoban-v0 tools/sql-v0 --model http://127.0.0.1:8000/v1 \\
        --episodes 16 --samples 4 --out runs/eval-sokoban-sql  # a served model, pass@4
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import urlsplit

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from envhub.cli import _fail, _parse_kwargs, console, err_console, import_option
from envhub.errors import EnvhubError
from envhub.eval_report import notes, show
from envhub.model_agent import KEY_HINT, URL_HINT

if TYPE_CHECKING:
    from envhub.eval_records import EpisodeStats, EvalSummary

__all__ = ["eval_command"]


def _model_url(ctx: click.Context, param: click.Parameter, url: str | None) -> str | None:
    """``--model``: an http(s) URL; without a scheme the client would take it for a path, and
    every request would fail as if no server were running."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme in ("http", "https") and parts.netloc:
        return url
    bare = "://" not in url and not url.startswith(("http:", "https:"))  # host:port/v1
    fix = f"; did you mean --model http://{url}?" if bare else ""
    raise click.UsageError(
        f"--model needs http:// or https:// (e.g. http://127.0.0.1:8000/v1), got {url!r}{fix}"
    )


@click.command("eval")
@click.argument("env_ids", nargs=-1)
@click.option(
    "--agent",
    "agents",
    multiple=True,
    type=click.Choice(["random", "expert"]),
    help="Built-in agents to compare (default: both; ignored with --model).",
)
@click.option(
    "--model",
    "url",
    default=None,
    metavar="URL",
    callback=_model_url,
    help="An OpenAI-compatible endpoint to play instead, e.g. http://127.0.0.1:8000/v1.",
)
@click.option("--model-name", default=None, help="Model to request (default: the server's only).")
@click.option(
    "--api-key-env",
    default="OPENAI_API_KEY",
    show_default=True,
    metavar="VAR",
    help="Environment variable holding the API key (unset: a placeholder, for local servers).",
)
@click.option(
    "--episodes",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="Seeds per env (and agent).",
)
@click.option(
    "--samples",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tries per seed (pass@k, k=this; needs --temperature above 0).",
)
@click.option(
    "--seed", default=0, show_default=True, type=click.IntRange(min=0), help="First episode seed."
)
@click.option(
    "--concurrency",
    default=None,
    type=click.IntRange(1, 1024),
    help="Episodes played at once [default: 8 with --model, else 1].",
)
@click.option("--temperature", default=0.7, show_default=True, type=click.FloatRange(min=0))
@click.option(
    "--max-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens per model turn.",
)
@click.option(
    "--max-turns",
    default=None,
    type=click.IntRange(min=1),
    help="Stop episodes after this many turns.",
)
@click.option(
    "--episode-timeout",
    default=900.0,
    show_default=True,
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="Record an episode still running after this long as failed and go on: env_timeout "
    "when an env call was under way (the env hung or crawls), episode_timeout (the agent's) "
    "when an agent's turn was; the episode plays no further call and its env is never reused "
    "(0: no bound).",
)
@click.option(
    "--tools",
    "tools_mode",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "native", "text"]),
    help="Send env tools as tools= (native), never (text), or unless the server refuses (auto).",
)
@click.option(
    "--timeout",
    default=60.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds per request.",
)
@click.option(
    "--retries",
    default=3,
    show_default=True,
    type=click.IntRange(min=0),
    help="Retries per request (429/5xx).",
)
@click.option(
    "--out",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Write episodes.jsonl, summary.json and the run's settings (eval.json) here.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Play only what --out lacks, and again the episodes it holds that failed at the "
    "endpoint or in the env (connection, timeout, http_*, bad_response, env_timeout, "
    "env_error).",
)
@click.option("--overwrite", is_flag=True, help="Replace the run --out already holds.")
@click.option(
    "--kwarg",
    "-k",
    "kwargs",
    multiple=True,
    help="Env constructor override key=value, for every env of the command (envs that take "
    "other kwargs: one command per env).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@import_option
def eval_command(
    env_ids: tuple[str, ...],
    agents: tuple[str, ...],
    url: str | None,
    model_name: str | None,
    api_key_env: str,
    episodes: int,
    samples: int,
    seed: int,
    concurrency: int | None,
    temperature: float,
    max_tokens: int,
    max_turns: int | None,
    episode_timeout: float,
    tools_mode: str,
    timeout: float,
    retries: int,
    out: Path | None,
    resume: bool,
    overwrite: bool,
    kwargs: tuple[str, ...],
    as_json: bool,
) -> None:
    """Evaluate agents on environments (default: every game, no variants).

    Without --model: the built-in random and expert agents. With --model URL: any model
    behind an OpenAI-compatible chat-completions endpoint (vLLM, a hosted API), with each
    env's tools passed as tools=. Prints a table per env; --out keeps every episode.

    How episodes that failed count: success, pass@k, return, turns and tokens are over every
    episode, one that failed counting as a loss. Where episodes failed at the endpoint or in
    the env rather than in the agent's play (connection, timeout, http_*, bad_response,
    env_timeout, env_error), the table adds 'measured' (the other episodes) and 'success
    (measured)' (success over those alone), and a 'warning:' line names a row when a fifth or
    more of its episodes failed so; --resume plays them again. An episode that ran past
    --episode-timeout during the agent's turn (episode_timeout) counts as the agent's, with a
    'note:' saying why: a slow server and a slow model look the same from here.

    Exits 1 when an env (or the endpoint) failed every one of its episodes, 2 on a usage
    error, and 130 on Ctrl-C (the finished episodes are kept: run again with --resume).
    """
    from envhub.evaluation import evaluate
    from envhub.registry import list_envs, spec

    if resume and out is None:
        raise click.UsageError("--resume needs --out DIR (the run to resume)")
    if overwrite and (out is None or resume):
        raise click.UsageError("--overwrite needs --out DIR and no --resume (it replaces the run)")
    client = None
    if url is not None:
        import openai

        client = openai.OpenAI(
            base_url=url,
            api_key=os.environ.get(api_key_env) or "EMPTY",
            timeout=timeout,
            max_retries=retries,
        )
    try:
        ids = list(dict.fromkeys(spec(i).id for i in env_ids))  # an id given twice: played once
        ids = ids or [s.id for s in list_envs("games", variants=False)]
        env_kwargs = _parse_kwargs(kwargs)
    except EnvhubError as error:
        _fail(error)
    names = ["model"] if client is not None else list(agents or ("random", "expert"))
    total = len(ids) * len(names) * episodes * samples
    wins = {"done": 0, "success": 0, "failed": 0}
    details: dict[tuple[str, str], str] = {}  # the first failure of each (env, agent)
    said: dict[tuple[str, str], str] = {}  # the env's answer to a first invalid action of each
    tool_envs: set[str] = set()
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("success {task.fields[rate]}  failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            console=err_console,
            transient=True,
            disable=as_json,
        ) as progress:
            task = progress.add_task("evaluating", total=total, rate="-", failed=0)

            def advance(episode: EpisodeStats) -> None:
                wins["done"] += 1
                wins["success"] += episode.success
                wins["failed"] += bool(episode.failure)
                if episode.failure:
                    details.setdefault((episode.env_id, episode.agent), episode.detail)
                if episode.invalid_feedback:
                    said.setdefault((episode.env_id, episode.agent), episode.invalid_feedback)
                if episode.has_tools:
                    tool_envs.add(episode.env_id)
                rate = f"{wins['success'] / wins['done']:.0%}"
                progress.update(task, advance=1, rate=rate, failed=wins["failed"])

            summaries = evaluate(
                ids,
                names if client is None else (),
                episodes=episodes,
                seed=seed,
                samples=samples,
                client=client,
                model=model_name,
                temperature=temperature,
                max_tokens=max_tokens,
                tools=tools_mode,  # type: ignore[arg-type]  # click.Choice checked it
                max_turns=max_turns,
                concurrency=concurrency,
                episode_timeout=episode_timeout or None,
                out=out,
                resume=resume,
                overwrite=overwrite,
                env_kwargs=env_kwargs,
                on_episode=advance,
            )
    except EnvhubError as error:
        _fail(error)
    except KeyboardInterrupt:
        _interrupted(out, wins["done"])
    if as_json:
        click.echo(json.dumps([s.as_dict() for s in summaries], indent=2))
    else:
        tries = f" x {samples} tries" if samples > 1 else ""
        seeds = f"seeds {seed}..{seed + episodes - 1}"
        show(console, summaries, f"{episodes} seeds{tries} per env ({seeds})")
        if out is not None:
            kept = f"episodes: {out / 'episodes.jsonl'}  summary: {out / 'summary.json'}"
            shown = kept if console.is_terminal else f"# {kept}"
            console.print(shown, soft_wrap=True, markup=False, highlight=False)
    lines = notes(
        summaries,
        model=client is not None,
        said=said,
        tool_envs=tool_envs,
        tools_mode=tools_mode,
        max_tokens=max_tokens,
        out=out,
    )
    for line in lines:  # rows that are not what they look like
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    problem = _nothing_measured(summaries, details, url)
    if problem is not None:
        err_console.print(f"[bold red]error:[/] {escape(problem)}", highlight=False, soft_wrap=True)
        sys.exit(1)


_RUN_FAILURES = {"env_error", "env_timeout", "episode_timeout", "agent_error"}
"""Failure reasons that are not the model endpoint's (``envhub.model_agent._reason``)."""
_HINTS = {
    "http_401": KEY_HINT,
    "http_403": KEY_HINT,
    "http_404": URL_HINT,
    "connection": "is the server running?",
    "timeout": "a slow server needs a larger --timeout",
    "env_timeout": (
        "an env call was under way when the episode ran past --episode-timeout: the env hangs, "
        "or a slow env needs a larger --episode-timeout"
    ),
    "episode_timeout": (
        "the agent's turn was under way when the episode ran past --episode-timeout: a server "
        "slow to answer (each request may wait --timeout), or a model that needs the time, "
        "needs a larger --episode-timeout"
    ),
}


def _nothing_measured(
    summaries: list[EvalSummary], details: dict[tuple[str, str], str], url: str | None
) -> str | None:
    """What to say when some (env, agent) had every episode fail (None: each measured some):
    the run cannot stand for those rows, so the command fails."""
    empty = [s for s in summaries if s.episodes and sum(s.failures.values()) == s.episodes]
    if not empty:
        return None
    reasons: Counter[str] = Counter()
    for s in empty:
        reasons.update(s.failures)
    counts = ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items()))
    hint = "; ".join(sorted({_HINTS[r] for r in reasons if r in _HINTS}))
    if url is not None and len(empty) == len(summaries) and not set(reasons) & _RUN_FAILURES:
        first = next(iter(details.values()), "")[:300]
        return f"every episode failed at the endpoint {url} ({counts}; first: {first})" + (
            f"; {hint}" if hint else ""
        )
    by_env: dict[str, list[EvalSummary]] = {}
    for s in empty:
        by_env.setdefault(s.env_id, []).append(s)
    rows = []
    for env_id, ours in by_env.items():
        agents = ", ".join(s.agent for s in ours)
        detail = next((details[k] for s in ours if (k := (env_id, s.agent)) in details), "")
        rows.append(f"{env_id} ({agents}): {detail[:300]}")
    return f"every episode failed ({counts}) for " + "; ".join(rows) + (f"; {hint}" if hint else "")


def _interrupted(out: Path | None, done: int) -> NoReturn:
    if out is None:
        kept = "nothing was kept: pass --out DIR to keep episodes as they finish"
    else:
        kept = (
            f"finished episodes are kept in {out / 'episodes.jsonl'} ({done} from this run); "
            "run the same command with --resume to play the rest"
        )
    err_console.print(f"[bold red]interrupted:[/] {escape(kept)}", highlight=False, soft_wrap=True)
    sys.exit(130)
