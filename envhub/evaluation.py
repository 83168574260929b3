"""Run agents over environments and summarise how they do (``envhub eval``).

An agent is one of:

``random``
    ``env.action_space.sample()``: the env's own mix of well-formed and malformed actions.
``expert``
    ``env.expert_action()`` where the env provides one (games do), else random.
a model
    ``evaluate(..., client=openai.OpenAI(base_url=...))``: any OpenAI-compatible chat endpoint,
    played by ``envhub.model_agent.ModelAgent`` (the env's tools as ``tools=``).
any callable ``(env, observation) -> str``
    registered in ``AGENTS`` or passed to ``run_episode``.

Episodes are ``(env, agent, seed, sample)``: ``episodes`` seeds, each played ``samples`` times
(pass@k needs several tries of one task). ``concurrency`` worker threads play them, each
with its own env per id (envs are not shared between threads; Playwright's are thread-bound)
and closing them itself; the bounded queue is the back-pressure. With ``out=DIR`` every
episode is appended to ``DIR/episodes.jsonl`` as it finishes (messages, rewards, final
info, tokens, latencies, failure) and ``DIR/summary.json`` (and, with pyarrow, the trajectory
store part ``DIR/trajectories/envhub-eval-000000000.parquet``) is written at the end;
``resume=True`` reads the file back, skips the episodes it holds and counts them in the
summary (a torn last line of a killed run is ignored).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from envhub.core import Observation
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
    action = getattr(env.unwrapped, "expert_action", lambda: None)()
    return action if action is not None else env.action_space.sample()


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
        action = self.fn(env, messages)
        return AgentTurn(
            action, {"role": "assistant", "content": action}, seconds=time.perf_counter() - start
        )


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
) -> EpisodeStats:
    """Play one episode of ``agent`` on ``env`` from ``reset(seed=seed)``.

    ``max_turns`` stops early (a truncation, not a failure); an ``AgentError`` or an env that
    raises ends the episode with ``failure`` set instead of raising."""
    turn_agent = agent if hasattr(agent, "act") else _CallableAgent("callable", agent)
    start = time.perf_counter()
    env.action_space.seed(seed + 1_000_003 * sample)  # each try of a seed samples differently
    messages: list[dict[str, Any]] = []
    rewards: list[float] = []
    latencies: list[float] = []
    tokens_in = tokens_out = invalid = 0
    truncated, failure, detail = False, None, ""
    info: dict[str, Any] = {}
    try:
        observation, info = env.reset(seed=seed)
        messages.extend(observation)
    except Exception as error:  # noqa: BLE001 - env code may raise anything: the episode's data
        failure, detail = "env_error", f"reset: {type(error).__name__}: {error}"[:500]
    tools = info.get("tools") or None
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
        tokens_in, tokens_out = tokens_in + turn.tokens_in, tokens_out + turn.tokens_out
        messages.append(turn.message)
        try:
            observation, reward, terminated, truncated, info = env.step(turn.action)
        except Exception as error:  # noqa: BLE001 - env code may raise anything: the episode's data
            failure, detail = "env_error", f"{type(error).__name__}: {error}"[:500]
            break
        messages.extend(link_tool_answers(turn.message, list(observation)))
        rewards.append(float(reward))
        invalid += bool(info.get("invalid_action", False))
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
        messages=messages,
        rewards=rewards,
        info=_json_safe(info),
    )


def _json_safe(info: dict[str, Any]) -> dict[str, Any]:
    import orjson

    return orjson.loads(orjson.dumps(info, default=str, option=orjson.OPT_SERIALIZE_NUMPY))


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
    )


def read_episodes(path: str | Path) -> list[EpisodeStats]:
    """The episodes of an ``episodes.jsonl`` (lines that do not parse, such as the torn last
    line of a killed run, are skipped with a warning)."""
    import orjson

    episodes, bad = [], 0
    with open(path, "rb") as lines:
        for line in lines:
            try:
                episodes.append(EpisodeStats.from_record(orjson.loads(line)))
            except (orjson.JSONDecodeError, TypeError):
                bad += 1
    if bad:
        _log.warning("%s: skipped %d unreadable line(s)", path, bad)
    return episodes


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a run killed mid-write), so the next line appended
    starts a line of its own instead of being glued to the fragment."""
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        start = max(0, size - (1 << 20))  # a line is far shorter than this
        f.seek(start)
        cut = f.read().rfind(b"\n")
        if cut >= 0 or start == 0:
            f.truncate(start + cut + 1)
        else:
            f.write(b"\n")


class _Writer:
    """Appends one JSONL line per episode and flushes it, so a killed run loses none."""

    def __init__(self, out: Path | None) -> None:
        self.file = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            path = out / "episodes.jsonl"
            self.file = open(path, "ab")  # noqa: SIM115 - closed by close()
            _drop_torn_tail(path)

    def write(self, episode: EpisodeStats) -> None:
        import orjson

        if self.file is not None:
            line = orjson.dumps(episode.as_record(), default=str, option=orjson.OPT_SERIALIZE_NUMPY)
            self.file.write(line + b"\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


Job = tuple[str, str, int, int]  # env id, agent name, seed, sample


def _play_jobs(
    jobs: list[Job],
    agents: dict[str, TurnAgent],
    make_env: Callable[[str], Any],
    concurrency: int,
    max_turns: int | None,
    on_done: Callable[[EpisodeStats], None],
) -> None:
    """Play ``jobs`` on ``concurrency`` threads; ``on_done`` runs in this thread, in finishing
        order. On Ctrl-C the workers take no new job; every finished episode is already written,
    and ``resume`` replays the ones that were in flight."""
    todo: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
    done: queue.SimpleQueue[EpisodeStats | BaseException] = queue.SimpleQueue()
    stop = threading.Event()
    for job in jobs:
        todo.put(job)
    workers = max(1, min(concurrency, len(jobs)))
    for _ in range(workers):
        todo.put(None)

    def work() -> None:
        envs: dict[str, Any] = {}
        try:
            while not stop.is_set() and (job := todo.get()) is not None:
                env_id, agent, seed, sample = job
                try:
                    env = envs.get(env_id) or envs.setdefault(env_id, make_env(env_id))
                    done.put(
                        run_episode(
                            env,
                            agents[agent],
                            seed=seed,
                            env_id=env_id,
                            sample=sample,
                            max_turns=max_turns,
                        )
                    )
                except BaseException as error:  # noqa: BLE001 - reported to the caller's thread
                    done.put(error)
                    return
        finally:
            for env in envs.values():
                try:
                    env.close()
                except Exception as error:  # noqa: BLE001 - a failed close must not hide results
                    _log.warning("closing an env failed: %s", error)
            done.put(StopIteration())

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    running = workers
    try:
        while running:
            item = done.get()
            if isinstance(item, StopIteration):
                running -= 1
            elif isinstance(item, BaseException):
                stop.set()
                raise item
            else:
                on_done(item)
    except BaseException:
        stop.set()
        raise


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
    out: str | Path | None = None,
    resume: bool = False,
    env_kwargs: dict[str, Any] | None = None,
    on_episode: Callable[[EpisodeStats], None] | None = None,
) -> list[EvalSummary]:
    """Play ``episodes`` seeds x ``samples`` tries of each agent on each env; one summary per
    (env, agent), in the order given.

    With ``client`` (an ``openai.OpenAI``) the agent is the served ``model`` (default: the
    server's only model) instead of ``agents``. Every agent sees the same seeds, so their
    numbers compare like for like. ``concurrency`` defaults to 8 for a model, 1 otherwise."""
    from envhub.registry import make, spec

    env_ids = [spec(env_id).id for env_id in env_ids]  # an unknown id fails before any play
    players: dict[str, TurnAgent] = {}
    if client is not None:
        name = resolve_model(client, model)
        players[name] = ModelAgent(
            client,
            name,
            temperature=temperature,
            max_tokens=max_tokens,
            tools=tools,
        )
    else:
        for agent_name in agents:
            players[agent_name] = _CallableAgent(agent_name, AGENTS[agent_name])
    out_dir = Path(out) if out is not None else None
    finished: dict[tuple[str, str, int, int], EpisodeStats] = {}
    if resume and out_dir is not None and (out_dir / "episodes.jsonl").exists():
        finished = {e.key: e for e in read_episodes(out_dir / "episodes.jsonl")}
    jobs = [
        (env_id, name, seed + i, s)
        for env_id in env_ids
        for name in players
        for i in range(episodes)
        for s in range(samples)
        if (env_id, name, seed + i, s) not in finished
    ]
    played = dict(finished)
    writer = _Writer(out_dir)

    def on_done(episode: EpisodeStats) -> None:
        writer.write(episode)
        played[episode.key] = episode
        if on_episode is not None:
            on_episode(episode)

    try:
        _play_jobs(
            jobs,
            players,
            lambda env_id: make(env_id, **(env_kwargs or {})),
            concurrency or (8 if client is not None else 1),
            max_turns,
            on_done,
        )
    finally:
        writer.close()
    summaries = []
    for env_id in env_ids:
        for name in players:
            ours = [
                played[key]
                for i in range(episodes)
                for s in range(samples)
                if (key := (env_id, name, seed + i, s)) in played
            ]
            summaries.append(summarise(env_id, name, ours))
    if out_dir is not None:
        import json

        (out_dir / "summary.json").write_text(
            json.dumps([s.as_dict() for s in summaries], indent=2)
        )
        _store(out_dir, list(played.values()))
    return summaries


def _store(out_dir: Path, played: list[EpisodeStats]) -> None:
    """Every episode as the run's trajectory-store part (``envhub view`` reads it), when
    pyarrow is installed (``envhub[view]``); the viewer reads ``episodes.jsonl`` otherwise."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return
    from envhub.runs.reader import eval_record
    from envhub.runs.store import write_part

    records = [eval_record(e.as_record(), i) for i, e in enumerate(played)]
    write_part(out_dir / "trajectories", "envhub-eval", 0, records)
