"""What an ``envhub eval`` run records and how it is summarised: one ``EpisodeStats`` per
episode (a line of ``episodes.jsonl``) and one ``EvalSummary`` per (env, agent).

The rule behind the figures: every episode counts, and one that could not be played to its
end counts as a loss. Some failures say nothing of the agent: the endpoint was down or refused
the request, or the env crashed or hung (``failed_outside_agent``). ``EvalSummary.measured``
and ``measured_success_rate`` leave those out, so a run an outage hit still says how the agent
did where it could play, and ``envhub.evaluate(resume=True)`` plays them again.

An episode that ran out of time is charged to the side whose call was under way then (a hang
is the call under way; ``envhub.eval_workers``): ``env_timeout`` to the env; ``episode_timeout``
to the agent, since for a model a server slow to answer and a model whose replies take that
long look the same from here (a request with no answer within the client's timeout fails as
``timeout``, the endpoint's, instead). Runs written before the sides were told apart recorded
every episode out of time, a hung env's included, as ``episode_timeout``: such a record is
still left out of ``measured`` and played again by ``resume``
(``EpisodeStats.failed_outside_agent``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CHARGED_TO_AGENT",
    "NOT_THE_AGENTS",
    "RECORD_TEXT_CHARS",
    "EpisodeStats",
    "EvalSummary",
    "cut_text",
    "failed_outside_agent",
    "pass_at_k",
    "read_episodes",
    "summarise",
]

_log = logging.getLogger(__name__)

RECORD_TEXT_CHARS = 250_000
"""The most characters of one text of a message (its content, reasoning, a call's arguments)
that an episode's record keeps (``EpisodeStats.as_record``, hence ``episodes.jsonl`` and the
trajectory store): a longer text keeps its start and ends in ``…[cut: N chars]``, N the
characters cut, the whole at most this long. Far above what a reply within ``max_tokens`` holds
(about 60k tokens); without it a broken server's 50 MB reply would be written whole. The env
saw the text whole, and the episode's figures are its."""

NOT_THE_AGENTS = frozenset({"connection", "timeout", "bad_response", "env_timeout", "env_error"})
"""Failure reasons that say nothing of the agent's play (with every ``http_<status>``): the
endpoint or the env failed. ``context_length`` (the model's conversation outgrew its window),
``agent_error`` (a built-in agent raised) and ``episode_timeout`` (its turn was under way when
the episode ran out of time: module docstring) are the agent's own; but an ``episode_timeout``
record of the old form is not (``EpisodeStats.failed_outside_agent``)."""

CHARGED_TO_AGENT = "in the agent's turn"
"""In the detail of every ``episode_timeout`` written since that failure is the agent's
(``envhub.eval_workers``; "... s of it in the agent's turns" at first); the detail of one
written before, when it meant any episode out of time, lacks it."""


def failed_outside_agent(failure: str | None) -> bool:
    """Whether an episode's ``failure`` was the endpoint's or the env's, not the agent's
    (``NOT_THE_AGENTS``, ``http_*``): such an episode measured nothing of the agent, so the
    summary's ``measured`` figures leave it out and ``resume`` plays it again. A record is
    judged by ``EpisodeStats.failed_outside_agent``, which also reads its detail."""
    return failure is not None and (failure in NOT_THE_AGENTS or failure.startswith("http_"))


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
    """Seconds per agent call (per request, for a model, its client's retries included; a
    request that failed counts too)."""
    random_turns: int = 0
    """Turns the agent played at random for want of a move of its own (``AgentTurn.fallback``)."""
    has_tools: bool = False
    """The env published tools (its reset info's ``tools``)."""
    invalid_feedback: str = ""
    """The env's answer to the episode's first invalid action (why it was refused)."""
    cut_off: int = 0
    """Replies that ended at the request's ``max_tokens`` (``finish_reason`` ``"length"``)."""
    messages: list[dict[str, Any]] = field(default_factory=list, repr=False)
    rewards: list[float] = field(default_factory=list, repr=False)
    info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def key(self) -> tuple[str, str, int, int]:
        return self.env_id, self.agent, self.seed, self.sample

    @property
    def failed_outside_agent(self) -> bool:
        """Whether the episode failed at the endpoint or in the env (``failed_outside_agent`` of
        its reason), so that it measured nothing of the agent: ``summarise`` leaves it out of
        ``measured`` and ``resume`` plays it again. So is an ``episode_timeout`` whose detail
        lacks ``CHARGED_TO_AGENT`` (which every one has had since that reason is the agent's):
        a record written when it meant any episode out of time, a hung env's included, and
        was replayed."""
        if self.failure == "episode_timeout":
            return not (isinstance(self.detail, str) and CHARGED_TO_AGENT in self.detail)
        return failed_outside_agent(self.failure)

    def as_record(self) -> dict[str, Any]:
        """A JSON-friendly dict (one JSONL line), each text of its messages cut to
        ``RECORD_TEXT_CHARS``."""
        record = asdict(self)
        record["latencies"] = list(self.latencies)
        record["messages"] = [_cut_texts(message, depth=0) for message in record["messages"]]
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> EpisodeStats:
        names = cls.__dataclass_fields__
        values = {k: v for k, v in record.items() if k in names}
        values["latencies"] = tuple(values.get("latencies", ()))
        for key in ("failure", "detail"):  # read as text by the summary and by --resume
            if values.get(key) is not None and not isinstance(values[key], str):
                raise TypeError(f"{key} is not text: {type(values[key]).__name__}")
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
    measured: int = 0
    """Episodes that measured the agent: all but those that failed at the endpoint or in the
    env (``failed_outside_agent``). Every other figure counts every episode, a failed one as
    a loss; ``measured_success_rate`` counts only these."""
    measured_success_rate: float = 0.0
    """Successes per measured episode (0.0 when none was measured): what the agent scored where
    it could play, as opposed to ``success_rate``, which an outage lowers."""
    cut_off_rate: float = 0.0
    """Share of the turns whose reply was cut off at ``max_tokens`` (``EpisodeStats.cut_off``)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cut_text(text: str, limit: int = RECORD_TEXT_CHARS) -> str:
    """``text`` if it is at most ``limit`` characters long; else its start and
    ``…[cut: N chars]`` (N: the characters cut), ``limit`` characters in all, so cutting it
    again changes nothing."""
    if len(text) <= limit:
        return text
    room = len(f"…[cut: {len(text)} chars]")  # (the marker is at most this long)
    kept = text[: max(0, limit - room)]
    return f"{kept}…[cut: {len(text) - len(kept)} chars]"


def _cut_texts(value: Any, depth: int) -> Any:
    """``value`` (a message, or a part of one) with each text in it cut by ``cut_text``."""
    if isinstance(value, str):
        return cut_text(value)
    if depth > 64:  # (deeper than any message: ``envhub.eval_output.dumps`` stringifies it)
        return value
    if isinstance(value, dict):
        return {key: _cut_texts(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_cut_texts(item, depth + 1) for item in value]
    return value


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


def summarise(env_id: str, agent: str, episodes: list[EpisodeStats]) -> EvalSummary:
    """One row from ``episodes`` (of ``agent`` on ``env_id``): every figure over every episode,
    a failed one as a loss, but ``measured`` and ``measured_success_rate``, which leave out the
    episodes that failed at the endpoint or in the env (``EpisodeStats.failed_outside_agent``)."""
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
    measured = [e for e in episodes if not e.failed_outside_agent]
    return EvalSummary(
        env_id=env_id,
        agent=agent,
        episodes=len(episodes),
        success_rate=sum(e.success for e in episodes) / n,
        mean_return=sum(e.episode_return for e in episodes) / n,
        mean_turns=turns / n,
        invalid_rate=sum(e.invalid_actions for e in episodes) / max(turns, 1),
        steps_per_second=turns / seconds if seconds > 0 else 0.0,  # (JSON has no Infinity)
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
        measured=len(measured),
        measured_success_rate=sum(e.success for e in measured) / max(len(measured), 1),
        cut_off_rate=sum(e.cut_off for e in episodes) / max(turns, 1),
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
