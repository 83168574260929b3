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
With ``out=DIR`` the run's settings go to ``DIR/eval.json``, every episode is appended to
``DIR/episodes.jsonl`` as it finishes (messages, rewards, final info, tokens, latencies,
failure) and ``DIR/summary.json`` (and, with pyarrow, the trajectory store part) is written
at the end; ``resume=True`` reads the file back, skips the episodes it holds and counts them
in the summary (a torn last line of a killed run is ignored), and refuses other settings;
``overwrite=True`` replaces the run (``envhub.eval_output``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from envhub.core import Observation
from envhub.errors import describe_error
from envhub.eval_output import json_safe, open_run, store
from envhub.eval_workers import Job, play_jobs
from envhub.model_agent import (
    AgentError,
    AgentTurn,
    ModelAgent,
    ToolsMode,
    link_tool_answers,
    resolve_model,
)

__all__ = [
    "AGENTS",
    "Agent",
    "EpisodeStats",
    "EvalSummary",
    "evaluate",
    "pass_at_k",
    "run_episode",
    "summarise",
]

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
        self, env: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> AgentTurn: ...


class _CallableAgent:
    """A built-in style agent ``(env, observation) -> str`` as a ``TurnAgent``."""

    def __init__(self, name: str, fn: Agent) -> None:
        self.name, self.fn = name, fn

    def act(
        self, env: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
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


@dataclass(frozen=True)
class EpisodeStats:
    """One played episode: its outcome and (for the JSONL) its transcript."""

    env_id: str
    seed: int
    episode_return: float
    turns: int
    success: bool
    invalid_actions: int
    truncated: bool
    seconds: float
    agent: str = ""
    sample: int = 0
    failure: str | None = None
    """Why the episode could not be played to its end (``AgentError.reason``, ``env_error``)."""
    detail: str = ""
    tokens_in: int = 0
    tokens_out: int = 0
    latencies: tuple[float, ...] = ()
    """Seconds per agent call (per request, for a model)."""
    random_turns: int = 0
    """Turns the agent played at random for want of a move of its own (``AgentTurn.fallback``)."""
    has_tools: bool = False
    """The env published tools (its reset info's ``tools``)."""
    invalid_feedback: str = ""
    """The env's answer to the episode's first invalid action (why it was refused)."""
    messages: list[dict[str, Any]] = field(default_factory=list, repr=False)
    rewards: list[float] = field(default_factory=list, repr=False)
    info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def key(self) -> tuple[str, str, int, int]:
        return self.env_id, self.agent, self.seed, self.sample

    def as_record(self) -> dict[str, Any]:
        """A JSON-friendly dict (one JSONL line)."""
        record = asdict(self)
        record["latencies"] = list(self.latencies)
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> EpisodeStats:
        names = cls.__dataclass_fields__
        values = {k: v for k, v in record.items() if k in names}
        values["latencies"] = tuple(values.get("latencies", ()))
        return cls(**values)


@dataclass(frozen=True)
class EvalSummary:
    """Aggregate of the episodes of one agent on one env."""

    env_id: str
    agent: str
    episodes: int
    success_rate: float
    mean_return: float
    mean_turns: float
    invalid_rate: float
    """Invalid actions per turn taken."""
    steps_per_second: float
    samples: int = 1
    """Tries per seed (the ``k`` of ``pass_at_k``)."""
    pass_at_k: float = 0.0
    """Mean over seeds of the unbiased pass@k estimate (``pass_at_k``)."""
    pass_at_k_low: float = 0.0
    pass_at_k_high: float = 1.0
    """The 95% Wilson score interval of ``pass_at_k`` over seeds."""
    mean_tokens_in: float = 0.0
    mean_tokens_out: float = 0.0
    latency_p50_s: float = 0.0
    latency_p95_s: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)
    """Episodes that could not be played to their end, by reason."""
    random_turn_rate: float = 0.0
    """Share of the turns played at random for want of a move of the agent's own (``expert`` on
    an env whose ``expert_action()`` returned None): 1.0 means the row is random play."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of P(at least one of k tries succeeds) from n tries, c successes:
    ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021)."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} tries, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_episode(
    env: Any,
    agent: Agent | TurnAgent,
    *,
    seed: int,
    env_id: str = "",
    sample: int = 0,
    max_turns: int | None = None,
    options: dict[str, Any] | None = None,
) -> EpisodeStats:
    """Play one episode of ``agent`` on ``env`` from ``reset(seed=seed, options=options)``.

    ``max_turns`` stops early (a truncation, not a failure); an ``AgentError``, or an env that
    raises anything but ``KeyboardInterrupt`` (``SystemExit`` included), ends the episode
    with ``failure`` set instead of raising."""
    turn_agent = agent if hasattr(agent, "act") else _CallableAgent("callable", agent)
    start = time.perf_counter()
    messages: list[dict[str, Any]] = []
    rewards: list[float] = []
    latencies: list[float] = []
    tokens_in = tokens_out = invalid = random_turns = 0
    truncated, failure, detail, feedback = False, None, "", ""
    info: dict[str, Any] = {}
    tools = None
    try:
        env.action_space.seed(seed + 1_000_003 * sample)  # each try of a seed samples differently
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
            turn = turn_agent.act(env, messages, tools)
        except AgentError as error:
            failure, detail = error.reason, error.detail
            break
        latencies.append(turn.seconds)
        random_turns += turn.fallback
        tokens_in, tokens_out = tokens_in + turn.tokens_in, tokens_out + turn.tokens_out
        messages.append(turn.message)
        try:
            observation, reward, terminated, truncated, info = env.step(turn.action)
            messages.extend(link_tool_answers(turn.message, list(observation)))
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
        messages=messages,
        rewards=rewards,
        info=json_safe(info if isinstance(info, dict) else {"info": info}),
    )


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


def summarise(env_id: str, agent: str, episodes: list[EpisodeStats]) -> EvalSummary:
    n = max(len(episodes), 1)
    turns = sum(e.turns for e in episodes)
    seconds = sum(e.seconds for e in episodes)
    by_seed: dict[int, list[bool]] = {}
    for e in episodes:
        by_seed.setdefault(e.seed, []).append(e.success)
    k = min((len(tries) for tries in by_seed.values()), default=1)
    per_seed = [pass_at_k(len(t), sum(t), k) for t in by_seed.values()]
    mean_pass = sum(per_seed) / len(per_seed) if per_seed else 0.0
    low, high = _wilson(mean_pass, len(per_seed))
    latencies = [s for e in episodes for s in e.latencies]
    return EvalSummary(
        env_id=env_id,
        agent=agent,
        episodes=len(episodes),
        success_rate=sum(e.success for e in episodes) / n,
        mean_return=sum(e.episode_return for e in episodes) / n,
        mean_turns=turns / n,
        invalid_rate=sum(e.invalid_actions for e in episodes) / max(turns, 1),
        steps_per_second=turns / seconds if seconds > 0 else float("inf"),
        samples=k,
        pass_at_k=mean_pass,
        pass_at_k_low=low,
        pass_at_k_high=high,
        mean_tokens_in=sum(e.tokens_in for e in episodes) / n,
        mean_tokens_out=sum(e.tokens_out for e in episodes) / n,
        latency_p50_s=_percentile(latencies, 0.50),
        latency_p95_s=_percentile(latencies, 0.95),
        failures=dict(Counter(e.failure for e in episodes if e.failure)),
        random_turn_rate=sum(e.random_turns for e in episodes) / max(turns, 1),
    )


def read_episodes(path: str | Path) -> list[EpisodeStats]:
    """The episodes of an ``episodes.jsonl`` (lines that hold no episode, such as the torn last
    line of a killed run, are skipped with a warning that counts them)."""
    import orjson

    episodes, bad = [], 0
    with open(path, "rb") as lines:
        for line in lines:
            try:
                record = orjson.loads(line)
                if not isinstance(record, dict):
                    raise TypeError(f"not an object: {type(record).__name__}")
                episode = EpisodeStats.from_record(record)
                hash(episode.key)  # a key that cannot index the run is no episode either
            except (orjson.JSONDecodeError, TypeError, ValueError):
                bad += 1
                continue
            episodes.append(episode)
    if bad:
        _log.warning("%s: skipped %d unreadable line(s)", path, bad)
    return episodes


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
    (``episode_timeout``; see ``envhub.eval_workers``). ``out`` keeps the run (see
    ``envhub.eval_output``: a folder holding one needs ``resume`` or ``overwrite``)."""
    from envhub.registry import make, spec

    # an unknown id fails before any play
    env_ids = list(dict.fromkeys(spec(env_id).id for env_id in env_ids))
    players, settings = _players(agents, client, model, temperature, max_tokens, tools)
    settings |= {"env_kwargs": env_kwargs or {}, "max_turns": max_turns}
    out_dir = Path(out) if out is not None else None
    writer = None
    finished: dict[tuple[str, str, int, int], EpisodeStats] = {}
    if out_dir is not None:
        run: dict[str, Any] = {"settings": settings, "envs": env_ids, "agents": list(players)}
        run |= {"episodes": episodes, "samples": samples, "seed": seed}
        writer = open_run(out_dir, run, resume=resume, overwrite=overwrite)
        if resume:
            finished = {e.key: e for e in read_episodes(out_dir / "episodes.jsonl")}

    def keys(env_id: str, name: str) -> list[Job]:
        return [(env_id, name, seed + i, s) for i in range(episodes) for s in range(samples)]

    rows = [(env_id, name) for env_id in env_ids for name in players]
    jobs = [key for row in rows for key in keys(*row) if key not in finished]
    played = dict(finished)

    def on_done(episode: EpisodeStats) -> None:
        if writer is not None:
            writer.write(episode.as_record())
        played[episode.key] = episode
        if on_episode is not None:
            on_episode(episode)

    # tools sent as tools= are listed by the server's chat template: envs need not list them
    options = {"describe_tools": False} if client is not None and tools == "native" else None

    def play(env: Any, job: Job) -> EpisodeStats:
        env_id, agent, job_seed, sample = job
        return run_episode(
            env,
            players[agent],
            seed=job_seed,
            env_id=env_id,
            sample=sample,
            max_turns=max_turns,
            options=options,
        )

    try:
        play_jobs(
            jobs,
            make_env=lambda env_id: make(env_id, **(env_kwargs or {})),
            play=play,
            fail=failed_episode,
            on_done=on_done,
            concurrency=concurrency or (8 if client is not None else 1),
            episode_timeout=episode_timeout,
        )
    finally:
        if writer is not None:
            writer.close()
    summaries = [
        summarise(*row, [played[key] for key in keys(*row) if key in played]) for row in rows
    ]
    if out_dir is not None:
        summary = [s.as_dict() for s in summaries]
        store(out_dir, summary, [e.as_record() for e in played.values()])
    return summaries


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
