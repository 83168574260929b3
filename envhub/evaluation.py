"""Run agents over environments and summarise how they do (``envhub eval``).

An agent is one of:

``random``
    ``env.action_space.sample()``: the env's own mix of well-formed and malformed actions.
``expert``
    ``env.expert_action()`` where the env provides one (games do), else a random action; the
    summary's ``random_turn_rate`` says how much of its row was random play.
a model
    ``evaluate(..., client=openai.OpenAI(base_url=...))``: any OpenAI-compatible chat endpoint,
    played by ``envhub.model_agent.ModelAgent`` (the env's tools as ``tools=``).
any callable ``(env, observation) -> str``
    registered in ``AGENTS`` or passed to ``run_episode``.

Episodes are ``(env, agent, seed, sample)``: ``episodes`` seeds, each played ``samples`` times
(pass@k needs several tries of one task). ``concurrency`` worker threads play them, each
with its own env per id, and an env that cannot be built, raises (even ``SystemExit``) or
hangs past ``episode_timeout`` fails its episodes, not the run (``envhub.eval_workers``).
With ``out=DIR`` (one run at a time: it is locked) the run's settings go to ``DIR/eval.json``,
every episode is appended to ``DIR/episodes.jsonl`` as it finishes (messages, each text cut to
``RECORD_TEXT_CHARS``, rewards, final info, tokens, latencies, failure) and
``DIR/summary.json`` (and, with pyarrow, the trajectory store part) is written at the end;
``resume=True`` reads the file back, skips the episodes it holds and counts them in the
summary (a torn last line of a killed run is ignored), except those that failed at the
endpoint or in the env (``EpisodeStats.failed_outside_agent``: an outage is not the agent's
result), which it plays again; it refuses other settings. ``overwrite=True`` replaces the run
(``envhub.eval_output``).

Every summary figure counts every episode, one that failed as a loss; ``measured`` and
``measured_success_rate`` leave out those that failed at the endpoint or in the env.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from envhub.core import Observation
from envhub.errors import EnvKwargsError, describe_error
from envhub.eval_output import EpisodeWriter, compact, json_safe, open_run, store
from envhub.eval_records import EpisodeStats, EvalSummary, read_episodes, summarise
from envhub.eval_workers import EpisodeClock, Job, play_jobs
from envhub.model_agent import (
    AgentError,
    AgentTurn,
    ModelAgent,
    ToolsMode,
    answer_tool_calls,
    call_ids,
    resolve_model,
    sampling_seed,
)

__all__ = ["AGENTS", "Agent", "TurnAgent", "evaluate", "run_episode"]

Agent = Callable[[Any, Observation], str]
_log = logging.getLogger(__name__)


def random_agent(env: Any, messages: Observation) -> str:
    return env.action_space.sample()


def expert_agent(env: Any, messages: Observation) -> str:
    action = _expert_move(env)
    return action if action is not None else env.action_space.sample()


def _expert_move(env: Any) -> str | None:
    return getattr(env.unwrapped, "expert_action", lambda: None)()


AGENTS: dict[str, Agent] = {"random": random_agent, "expert": expert_agent}


class TurnAgent(Protocol):
    """What ``run_episode`` plays: one turn from the transcript so far and the env's tools."""

    name: str

    def act(
        self,
        env: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        seed: int | None = None,
    ) -> AgentTurn:
        """``seed``: one per (episode seed, try) (``sampling_seed``), for agents that sample."""


class _CallableAgent:
    """A built-in style agent ``(env, observation) -> str`` as a ``TurnAgent``."""

    def __init__(self, name: str, fn: Agent) -> None:
        self.name, self.fn = name, fn

    def act(
        self,
        env: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        seed: int | None = None,
    ) -> AgentTurn:
        start = time.perf_counter()
        try:
            action, fallback = self.choose(env, messages)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - built-in agents run env code (expert_action)
            raise AgentError("agent_error", describe_error(error)) from None
        return AgentTurn(
            action,
            {"role": "assistant", "content": action},
            seconds=time.perf_counter() - start,
            fallback=fallback,
        )

    def choose(self, env: Any, messages: Observation) -> tuple[str, bool]:
        """The action, and whether it is a random stand-in for a move the agent did not have."""
        return self.fn(env, messages), False


class _ExpertAgent(_CallableAgent):
    """``expert`` as ``envhub eval`` plays it: ``expert_agent``, with each turn that had no
    expert move (``expert_action()`` returned None) marked ``fallback``, so that a row of random
    play is not passed off as the expert's."""

    def __init__(self) -> None:
        super().__init__("expert", expert_agent)

    def choose(self, env: Any, messages: Observation) -> tuple[str, bool]:
        action = _expert_move(env)
        if action is None:
            return env.action_space.sample(), True
        return action, False


def run_episode(
    env: Any,
    agent: Agent | TurnAgent,
    *,
    seed: int,
    env_id: str = "",
    sample: int = 0,
    max_turns: int | None = None,
    options: dict[str, Any] | None = None,
    clock: EpisodeClock | None = None,
) -> EpisodeStats:
    """Play one episode of ``agent`` on ``env`` from ``reset(seed=seed, options=options)``.

    ``max_turns`` stops early (a truncation, not a failure); an ``AgentError``, or an env that
    raises anything but ``KeyboardInterrupt`` (``SystemExit`` included), ends the episode
    with ``failure`` set instead of raising. The agent is asked for each turn with
    ``seed=sampling_seed(seed, sample)``, and the env's answer to a reply with tool calls is
    recorded as ``answer_tool_calls`` makes it (every call id answered: what a strict API
    needs of the next request). ``clock`` times the env's calls and the agent's turns (for
    ``envhub.eval_workers``, to say whose call an episode that ran out of time was stuck in, and
    to stop an episode it gave up on before its next call)."""
    turn_agent = agent if hasattr(agent, "act") else _CallableAgent("callable", agent)
    clock = clock or EpisodeClock()
    start = time.perf_counter()
    messages: list[dict[str, Any]] = []
    rewards: list[float] = []
    latencies: list[float] = []
    tokens_in = tokens_out = invalid = random_turns = cut_off = 0
    truncated, failure, detail, feedback = False, None, "", ""
    info: dict[str, Any] = {}
    tools = None
    try:
        with clock.timing("env"):
            env.action_space.seed(seed + 1_000_003 * sample)  # each try samples differently
            observation, info = env.reset(seed=seed, options=options)
        messages.extend(observation)
        tools = info.get("tools") or None
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - env code may raise anything: the episode's data
        failure, detail = "env_error", f"reset: {describe_error(error)}"
    while failure is None:
        if max_turns is not None and len(rewards) >= max_turns:
            truncated = True
            break
        try:
            with clock.timing("agent"):
                turn = turn_agent.act(env, messages, tools, seed=sampling_seed(seed, sample))
        except AgentError as error:
            failure, detail = error.reason, error.detail
            if error.seconds is not None:
                latencies.append(error.seconds)
            break
        latencies.append(turn.seconds)
        random_turns += turn.fallback
        cut_off += turn.finish_reason == "length"
        tokens_in, tokens_out = tokens_in + turn.tokens_in, tokens_out + turn.tokens_out
        messages.append(turn.message)
        try:
            with clock.timing("env"):
                observation, reward, terminated, truncated, info = env.step(_action(turn))
            ids, refused = call_ids(turn.message), bool(info.get("invalid_action"))
            messages.extend(answer_tool_calls(ids, list(observation), refused=refused))
            rewards.append(float(reward))
            if info.get("invalid_action", False):
                invalid += 1
                feedback = feedback or _said(observation)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - env code may raise anything
            failure, detail = "env_error", describe_error(error)
            break
        if terminated or truncated:
            break
    return EpisodeStats(
        env_id=env_id,
        seed=seed,
        episode_return=sum(rewards),
        turns=len(rewards),
        success=failure is None and bool(info.get("success", False)),
        invalid_actions=invalid,
        truncated=truncated,
        seconds=time.perf_counter() - start,
        agent=getattr(turn_agent, "name", ""),
        sample=sample,
        failure=failure,
        detail=detail,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        latencies=tuple(latencies),
        random_turns=random_turns,
        has_tools=bool(tools),
        invalid_feedback=feedback,
        cut_off=cut_off,
        messages=messages,
        rewards=rewards,
        info=json_safe(info if isinstance(info, dict) else {"info": info}),
    )


def _action(turn: AgentTurn) -> str | dict[str, Any]:
    """What the env is stepped with: a reply with tool calls as the assistant message (an env
    that reads calls as data keeps the server's ids), any other as its text."""
    calls = turn.message.get("tool_calls")
    if not calls:
        return turn.action
    return {"role": "assistant", "content": turn.message.get("content") or "", "tool_calls": calls}


def _said(observation: Any) -> str:
    """The text of an env's reply (its messages' contents), on one line, cut to 300 characters."""
    messages = observation if isinstance(observation, list) else [observation]
    text = " ".join(
        str(m.get("content") or "") if isinstance(m, dict) else str(m) for m in messages
    )
    return " ".join(text.split())[:300]


def failed_episode(job: Job, failure: str, detail: str, seconds: float) -> EpisodeStats:
    """The record of an episode that could not be played (its env not built, its time up)."""
    env_id, agent, seed, sample = job
    return EpisodeStats(
        env_id=env_id,
        seed=seed,
        episode_return=0.0,
        turns=0,
        success=False,
        invalid_actions=0,
        truncated=False,
        seconds=seconds,
        agent=agent,
        sample=sample,
        failure=failure,
        detail=detail,
    )


def evaluate(
    env_ids: Iterable[str],
    agents: Iterable[str] = ("random", "expert"),
    *,
    episodes: int = 10,
    seed: int = 0,
    samples: int = 1,
    client: Any = None,
    model: str | None = None,
    temperature: float = 0.7,
    max_tokens: int = 512,
    tools: ToolsMode = "auto",
    max_turns: int | None = None,
    concurrency: int | None = None,
    episode_timeout: float | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    env_kwargs: dict[str, Any] | None = None,
    on_episode: Callable[[EpisodeStats], None] | None = None,
) -> list[EvalSummary]:
    """Play ``episodes`` seeds x ``samples`` tries of each agent on each env; one summary per
    (env, agent), in the order given (an id given twice is played once).

    With ``client`` (an ``openai.OpenAI``) the agent is the served ``model`` (default: the
    server's only model) instead of ``agents``. Every agent sees the same seeds, so their
    numbers compare like for like. ``concurrency`` defaults to 8 for a model, 1 otherwise.
    An episode still running after ``episode_timeout`` seconds is recorded as failed
    (``env_timeout`` or ``episode_timeout``: the side whose call was under way; see
    ``envhub.eval_workers``) and plays no further call. ``out`` keeps the run (see
    ``envhub.eval_output``: a folder holding one needs ``resume`` or ``overwrite``, and one
    another run plays into is refused); ``resume`` plays what the folder lacks and, again, the
    episodes it holds that failed at the endpoint or in the env
    (``EpisodeStats.failed_outside_agent``): the newest line of an episode wins.

    Raises before playing anything: ``ValueError`` for ``episodes`` or ``samples`` below 1 or
    a negative ``seed`` (a run of no episodes would read as a 0% row), ``UnknownEnvError``
    for an unknown id, and ``EnvKwargsError`` when an env does not take ``env_kwargs`` (which
    every env of the call gets). Logs a warning for several ``samples`` of a model at
    temperature 0: greedy tries are the same try, so pass@k is success again."""
    from envhub.registry import make, spec

    counts = {"episodes": (episodes, 1), "samples": (samples, 1), "seed": (seed, 0)}
    for name, (value, least) in counts.items():
        if not (isinstance(value, int) and value >= least):
            raise ValueError(f"{name} must be an int of at least {least}, got {value!r}")
    # an unknown id, or kwargs an env does not take, fail before any play
    env_ids = list(dict.fromkeys(spec(env_id).id for env_id in env_ids))
    _check_env_kwargs(env_ids, env_kwargs or {})
    if client is not None and samples > 1 and temperature == 0:
        _log.warning(
            "%d tries per seed at temperature 0 are one try %d times (greedy decoding): pass@%d "
            "is success again; sample at a temperature above 0 (e.g. --temperature 0.7) to "
            "measure pass@k",
            samples,
            samples,
            samples,
        )
    players, settings = _players(agents, client, model, temperature, max_tokens, tools)
    settings |= {"env_kwargs": env_kwargs or {}, "max_turns": max_turns}
    out_dir = Path(out) if out is not None else None
    writer: EpisodeWriter | None = None
    played: dict[tuple[str, str, int, int], EpisodeStats] = {}  # kept on resume, then played

    def keys(env_id: str, name: str) -> list[Job]:
        return [(env_id, name, seed + i, s) for i in range(episodes) for s in range(samples)]

    rows = [(env_id, name) for env_id in env_ids for name in players]

    def on_done(episode: EpisodeStats) -> None:
        record = episode.as_record()  # (its texts cut to RECORD_TEXT_CHARS)
        if writer is not None:
            writer.write(record)
        played[episode.key] = replace(episode, messages=record["messages"])  # no more than that
        if on_episode is not None:
            on_episode(episode)

    # tools sent as tools= are listed by the server's chat template: envs need not list them
    options = {"describe_tools": False} if client is not None and tools == "native" else None

    def play(env: Any, job: Job, clock: EpisodeClock) -> EpisodeStats:
        env_id, agent, job_seed, sample = job
        return run_episode(
            env,
            players[agent],
            seed=job_seed,
            env_id=env_id,
            sample=sample,
            max_turns=max_turns,
            options=options,
            clock=clock,
        )

    if out_dir is not None:
        run: dict[str, Any] = {"settings": settings, "envs": env_ids, "agents": list(players)}
        run |= {"episodes": episodes, "samples": samples, "seed": seed}
        writer = open_run(out_dir, run, resume=resume, overwrite=overwrite)
    try:  # (from here on, whatever happens, the writer is closed and --out's lock let go of)
        if out_dir is not None and resume:
            # (the newest line of an episode wins: a replay's comes after the failure)
            held = {e.key: e for e in read_episodes(out_dir / "episodes.jsonl")}
            played |= {k: e for k, e in held.items() if not e.failed_outside_agent}
        jobs = [key for row in rows for key in keys(*row) if key not in played]
        play_jobs(
            jobs,
            make_env=lambda env_id: make(env_id, **(env_kwargs or {})),
            play=play,
            fail=failed_episode,
            on_done=on_done,
            concurrency=concurrency or (8 if client is not None else 1),
            episode_timeout=episode_timeout,
        )
        if out_dir is not None and resume:  # one line per episode again (replays superseded some)
            compact(out_dir / "episodes.jsonl")
        summaries = [
            summarise(*row, [played[key] for key in keys(*row) if key in played]) for row in rows
        ]
        if out_dir is not None:
            summary = [s.as_dict() for s in summaries]
            store(out_dir, summary, [e.as_record() for e in played.values()])
    finally:
        if writer is not None:
            writer.close()  # (and lets go of the folder's lock, its files now whole)
    return summaries


def _check_env_kwargs(env_ids: list[str], env_kwargs: dict[str, Any]) -> None:
    """``EnvKwargsError`` when an env does not take ``env_kwargs`` (checked against its
    constructor, building nothing), before any episode is played; for several envs, the message
    says that ``-k`` applies to every one and how to run each on its own."""
    from envhub.registry import spec

    misfits: dict[str, EnvKwargsError] = {}
    for env_id in env_ids if env_kwargs else ():
        try:
            spec(env_id).constructor_kwargs(env_kwargs)
        except EnvKwargsError as error:
            misfits[env_id] = error
        except Exception:  # noqa: BLE001, S112 - an entry point that cannot load: make() fails
            continue  # its episodes (env_error), as for any env that cannot be built
    if not misfits:
        return
    if len(env_ids) == 1:
        raise misfits[env_ids[0]]
    pairs = " ".join(
        f"-k {key}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in env_kwargs.items()
    )
    fits = [env_id for env_id in env_ids if env_id not in misfits]
    example = f"envhub eval {fits[0] if fits else 'ENV'} {pairs}"
    raise EnvKwargsError(
        "; ".join(str(error) for error in misfits.values())
        + f". -k (env_kwargs) applies to every env evaluated together, and "
        f"{', '.join(misfits)} {'does' if len(misfits) == 1 else 'do'} not take it: evaluate "
        f"each env in a command of its own, with the -k it takes (e.g. {example})"
    )


def _players(
    agents: Iterable[str],
    client: Any,
    model: str | None,
    temperature: float,
    max_tokens: int,
    tools: ToolsMode,
) -> tuple[dict[str, TurnAgent], dict[str, Any]]:
    """The agents to play by name (the served model, with ``client``), and the settings that
    make its episodes comparable (what a resumed run must not change)."""
    if client is None:
        built: dict[str, TurnAgent] = {"expert": _ExpertAgent()}
        return {name: built.get(name) or _CallableAgent(name, AGENTS[name]) for name in agents}, {}
    name = resolve_model(client, model)
    agent = ModelAgent(client, name, temperature=temperature, max_tokens=max_tokens, tools=tools)
    settings = {"model": name, "temperature": temperature, "max_tokens": max_tokens}
    return {name: agent}, settings | {"tools": tools}
