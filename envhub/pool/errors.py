"""The exceptions ``envhub.pool`` raises.

A worker that crashes or hangs is *not* an exception: the pool answers with an
``EpisodeFailure`` record (see ``envhub.pool.base``). Exceptions are kept for caller
mistakes (an unknown episode, a call on a closed pool) and for a pool that cannot start.

    EnvhubError
    └── PoolError
        ├── PoolClosedError        a call on a pool that was closed
        ├── PoolFullError          no episode slot freed up within the wait timeout
        ├── UnknownEpisodeError    step/close of an episode id the pool never reset
        ├── WorkerStartError       a worker could not start (bad env id, import error)
        └── RayConnectError        the Ray cluster named by an address could not be joined
"""

from __future__ import annotations

from envhub.errors import EnvhubError

__all__ = [
    "PoolClosedError",
    "PoolError",
    "PoolFullError",
    "RayConnectError",
    "UnknownEpisodeError",
    "WorkerStartError",
]


class PoolError(EnvhubError):
    """Base class of the pool's own errors."""


class PoolClosedError(PoolError, RuntimeError):
    """The pool was closed; build a new ``EnvPool``."""


class PoolFullError(PoolError, TimeoutError):
    """Every episode slot stayed busy for the whole wait; close episodes or raise capacity."""


class UnknownEpisodeError(PoolError, KeyError):
    """An episode id the pool does not hold (never reset, or already closed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class WorkerStartError(PoolError, RuntimeError):
    """A worker process or actor failed to start; the message carries its error output."""


class RayConnectError(PoolError, ConnectionError):
    """Joining a Ray cluster failed; the message says why (token authentication, nothing at the
    address) and the fix."""
