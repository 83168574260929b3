"""Shared types of the env pool: what a call returns, and what a worker backend implements.

Results
-------
``ResetResult`` and ``StepResult`` are what a healthy call returns. ``EpisodeFailure`` is
what comes back instead when the episode could not go on: its worker crashed or hung and
was replaced, or the env raised. It is *data* (a reason, a detail, where it happened),
so one broken episode never raises through a batch of concurrent calls.

Worker backends
---------------
A ``Worker`` hosts many env instances (one per episode) and answers requests in the order
it receives them. ``submit`` returns a future of ``(status, body)``; ``body`` is the JSON
encoding (orjson) of the result, produced once in the worker, so a server can forward it
to its client without decoding it. The pool owns timeouts: it watches ``head_since``
(when the worker started the request at the head of its queue) and kills a worker that
makes no progress for longer than the call's timeout.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import orjson

__all__ = [
    "OP_CLOSE",
    "OP_PING",
    "OP_RESET",
    "OP_STEP",
    "OP_STEP_MESSAGE",
    "STATUS_ENV_ERROR",
    "STATUS_LOST",
    "STATUS_OK",
    "STATUS_USAGE_ERROR",
    "EpisodeFailure",
    "FailureReason",
    "PoolStats",
    "ResetResult",
    "StepResult",
    "Worker",
    "dumps",
]

OP_RESET, OP_STEP, OP_CLOSE, OP_PING, OP_STEP_MESSAGE = 1, 2, 3, 4, 5
"""Request kinds a worker understands (``OP_STEP``: the action's UTF-8 text;
``OP_STEP_MESSAGE``: a structured action, an assistant message as JSON)."""

STATUS_OK = 0
"""``body`` is the JSON result."""
STATUS_ENV_ERROR = 1
"""The env raised; ``body`` is ``{"error": type, "message": str}``; the episode is lost."""
STATUS_USAGE_ERROR = 2
"""A caller mistake the env refused (step after the end, non-str action), or a request the
worker could not take (Ray refused the call); the env is fine."""
STATUS_LOST = 3
"""The worker died or was killed before answering; ``body`` is ``{"reason", "detail"}``."""

FailureReason = Literal["worker_crashed", "step_timeout", "worker_lost", "env_error", "pool_closed"]


def _default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        return item()
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        return tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)


def dumps(value: Any) -> bytes:
    """JSON-encode env output; numpy values become plain numbers, unknown objects their repr."""
    return orjson.dumps(
        value, default=_default, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    )


@dataclass(slots=True)
class ResetResult:
    """A started episode: its id in the pool, the opening messages and info."""

    episode: int
    observation: list[dict[str, Any]]
    info: dict[str, Any]

    failed = False


@dataclass(slots=True)
class StepResult:
    """One applied step, exactly as ``TextEnv.step`` returned it."""

    episode: int
    observation: list[dict[str, Any]]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]

    failed = False

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


@dataclass(slots=True)
class EpisodeFailure:
    """An episode that could not go on, and why. Returned, never raised.

    ``reason``: ``worker_crashed`` (its worker process/actor died), ``step_timeout`` (this
    episode's call ran past the timeout; the worker was killed and replaced),
    ``worker_lost`` (another episode on the same worker crashed or hung it), ``env_error``
    (the env raised; ``detail`` has the exception), ``pool_closed``. ``turn`` counts the
    steps that were applied before the failure.
    """

    episode: int
    reason: FailureReason
    detail: str
    worker: str
    turn: int = 0

    failed = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class PoolStats:
    """A snapshot of the pool, for metrics and tests."""

    backend: str
    workers: int
    workers_alive: int
    episodes: int
    capacity: int | None
    steps: int
    resets: int
    failures: int
    worker_restarts: int
    placement: dict[str, str] = field(default_factory=dict)
    """worker name -> where it runs (``pid 1234`` locally, the Ray node id on a cluster)."""


class Worker(Protocol):
    """What ``EnvPool`` needs from a backend's worker (see the module docstring)."""

    name: str
    location: str
    """Where it runs: ``pid N`` or a Ray node id; for placement reports."""

    @property
    def alive(self) -> bool: ...

    @property
    def inflight(self) -> int:
        """Requests submitted and not yet answered."""
        ...

    @property
    def head_since(self) -> float:
        """``loop.time()`` when the oldest unanswered request started running."""
        ...

    @property
    def head_episode(self) -> int:
        """The episode of the oldest unanswered request (-1 for none)."""
        ...

    async def start(self) -> None:
        """Start the process/actor and wait until it can build envs."""
        ...

    def submit(self, op: int, episode: int, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        """Queue one request; the future resolves to ``(status, body)``, never raises (a request
        that cannot be sent resolves at once with ``STATUS_USAGE_ERROR`` and is not queued)."""
        ...

    def probe(self) -> None:
        """Check that an idle worker is still there: one found dead dies as if it crashed
        (the pool replaces it). The watchdog calls it about once a second."""
        ...

    def kill(self, reason: str, detail: str) -> None:
        """Kill at once; pending futures resolve with ``STATUS_LOST`` and this reason."""
        ...

    async def stop(self) -> None:
        """Stop politely (close envs), falling back to ``kill``."""
        ...
