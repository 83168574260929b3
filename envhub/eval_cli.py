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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from envhub.cli import _fail, _parse_kwargs, console, err_console
from envhub.errors import EnvhubError

if TYPE_CHECKING:
    from envhub.evaluation import EvalSummary

__all__ = ["eval_command", "summary_table"]


def summary_table(summaries: list[EvalSummary], title: str) -> Table:
    """One row per (env, agent): success, pass@k with its 95% interval (several tries per
    seed), return, turns, invalid actions per turn, and for a model tokens, request latency
    and failures by reason; columns that would hold nothing for these summaries are left out."""
    k = max((s.samples for s in summaries), default=1)
    model = any(s.mean_tokens_in or s.mean_tokens_out for s in summaries)
    failed = any(s.failures for s in summaries)
    columns: dict[str, Callable[[EvalSummary], str]] = {
        "env": lambda s: s.env_id,
        "agent": lambda s: escape(s.agent),
        "episodes": lambda s: str(s.episodes),
        "success": lambda s: f"{s.success_rate:.0%}",
    }
    if k > 1:
        columns[f"pass@{k} (95% CI)"] = lambda s: (
            f"{s.pass_at_k:.0%} ({s.pass_at_k_low:.0%}-{s.pass_at_k_high:.0%})"
        )
    columns["return"] = lambda s: f"{s.mean_return:+.2f}"
    columns["turns"] = lambda s: f"{s.mean_turns:.1f}"
    columns["invalid"] = lambda s: f"{s.invalid_rate:.2f}"
    if model:
        columns["tokens in/out"] = lambda s: f"{s.mean_tokens_in:,.0f}/{s.mean_tokens_out:,.0f}"
        columns["latency p50/p95"] = lambda s: _latency(s.latency_p50_s, s.latency_p95_s)
    if failed:
        columns["failures"] = lambda s: escape(
            ", ".join(f"{reason} {n}" for reason, n in sorted(s.failures.items())) or "-"
        )
    table = Table(title=title, title_justify="left")
    for name in columns:
        left = name in ("env", "agent", "failures")
        table.add_column(name, justify="left" if left else "right", no_wrap=name == "env")
    for s in summaries:
        table.add_row(*(cell(s) for cell in columns.values()))
    return table


def _latency(p50: float, p95: float) -> str:
    if p95 >= 0.1:
        return f"{p50:.2f}/{p95:.2f} s"
    return f"{p50 * 1e3:.1f}/{p95 * 1e3:.1f} ms"


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
@click.option("--episodes", default=10, show_default=True, help="Seeds per env (and agent).")
@click.option("--samples", default=1, show_default=True, help="Tries per seed (pass@k, k=this).")
@click.option("--seed", default=0, show_default=True, help="First episode seed.")
@click.option(
    "--concurrency",
    default=None,
    type=click.IntRange(1, 1024),
    help="Episodes played at once [default: 8 with --model, else 1].",
)
@click.option("--temperature", default=0.7, show_default=True, type=float)
@click.option("--max-tokens", default=512, show_default=True, help="Tokens per model turn.")
@click.option("--max-turns", default=None, type=int, help="Stop episodes after this many turns.")
@click.option(
    "--tools",
    "tools_mode",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "native", "text"]),
    help="Send env tools as tools= (native), never (text), or unless the server refuses (auto).",
)
@click.option("--timeout", default=60.0, show_default=True, help="Seconds per request.")
@click.option("--retries", default=3, show_default=True, help="Retries per request (429/5xx).")
@click.option(
    "--out",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Write episodes.jsonl and summary.json here.",
)
@click.option("--resume", is_flag=True, help="Skip the episodes --out already holds.")
@click.option("--kwarg", "-k", "kwargs", multiple=True, help="Env constructor override key=value.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
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
    tools_mode: str,
    timeout: float,
    retries: int,
    out: Path | None,
    resume: bool,
    kwargs: tuple[str, ...],
    as_json: bool,
) -> None:
    """Evaluate agents on environments (default: every game, no variants).

    Without --model: the built-in random and expert agents. With --model URL: any model
    behind an OpenAI-compatible chat-completions endpoint (vLLM, a hosted API), with each
    env's tools passed as tools=. Prints a table per env; --out keeps every episode.
    """
    from envhub.evaluation import evaluate
    from envhub.registry import list_envs, spec

    if resume and out is None:
        raise click.UsageError("--resume needs --out DIR (the run to resume)")
    if samples < 1 or episodes < 1:
        raise click.UsageError("--episodes and --samples must be at least 1")
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
        ids = [spec(i).id for i in env_ids] or [s.id for s in list_envs("games", variants=False)]
        env_kwargs = _parse_kwargs(kwargs)
    except EnvhubError as error:
        _fail(error)
    names = ["model"] if client is not None else list(agents or ("random", "expert"))
    total = len(ids) * len(names) * episodes * samples
    wins = {"done": 0, "success": 0, "failed": 0}
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

        def advance(episode: object) -> None:
            wins["done"] += 1
            wins["success"] += bool(getattr(episode, "success", False))
            wins["failed"] += bool(getattr(episode, "failure", None))
            rate = f"{wins['success'] / wins['done']:.0%}"
            progress.update(task, advance=1, rate=rate, failed=wins["failed"])

        try:
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
                out=out,
                resume=resume,
                env_kwargs=env_kwargs,
                on_episode=advance,
            )
        except EnvhubError as error:
            _fail(error)
    if as_json:
        click.echo(json.dumps([s.as_dict() for s in summaries], indent=2))
        return
    tries = f" x {samples} tries" if samples > 1 else ""
    console.print(
        summary_table(
            summaries, f"{episodes} seeds{tries} per env (seeds {seed}..{seed + episodes - 1})"
        )
    )
    if out is not None:
        console.print(f"episodes: {out / 'episodes.jsonl'}  summary: {out / 'summary.json'}")
