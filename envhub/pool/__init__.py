"""Env pools: many episodes over N self-healing env workers, behind an async API.

The trainer's rollout scheduler and ``envhub serve`` both drive environments through an
``EnvPool``. Workers are local processes by default, Ray actors on a cluster, or (for
trusted microsecond envs) the caller's own event loop::

    from envhub.pool import EnvPool, EpisodeFailure

    async with EnvPool("games/sokoban-v0", num_workers=4, step_timeout_s=30) as pool:
        first = await pool.reset(seed=0)                 # ResetResult | EpisodeFailure
        result = await pool.step(first.episode, "<answer>up</answer>")
        if result.failed:                                 # EpisodeFailure: data, not an error
            print(result.reason, result.detail)
        await pool.close_episode(first.episode)

API (every call is a coroutine unless noted)
--------------------------------------------
``EnvPool(env, *, num_workers=2, backend="process"|"ray"|"inline", env_kwargs=None,
step_timeout_s=30, reset_timeout_s=None, start_timeout_s=60, max_episodes=None,
ray_options=None, restart_attempts=5, retry_after_s=30, max_message_bytes=64 MiB)``
    ``env`` is a registered id or an ``EnvSpec``; ``env_kwargs`` override its defaults.
    ``max_episodes`` bounds the open episodes (``None``: unbounded). ``ray_options`` go to
    ``ray.remote`` for each worker actor (``num_cpus``, ``resources``, ``scheduling_strategy``;
    the default spreads workers across nodes). ``restart_attempts``: starts of a crashed
    worker's replacement tried in a row (0.2 s, 0.4 s, ... apart) before its slot is given up;
    ``retry_after_s``: how long a given-up pool refuses resets before one tries again.
    ``max_message_bytes``: the largest answer (one reset's or step's JSON) a process or Ray
    worker sends; a larger one fails its episode as ``env_error``.
``start()``
    Start the workers (``reset`` starts them on first use). Raises ``WorkerStartError``
    with the worker's traceback when the env cannot be built.
``reset(episode=None, *, seed=None, options=None, wait_s=None) -> ResetResult | EpisodeFailure``
    Without ``episode``: start a new episode on the live worker holding the fewest; when
    ``max_episodes`` are open, wait for one to close (back-pressure; ``wait_s`` bounds the
    wait, then ``PoolFullError``). With ``episode``: restart that episode in place (a failed
    one gets a fresh env on a live worker, same id).
``step(episode, action) -> StepResult | EpisodeFailure``
    Apply the model's text. ``ResetNeededError``/``EpisodeOverError`` are raised exactly
    as the local env raises them; ``UnknownEpisodeError`` for an id the pool never reset.
``close_episode(episode)``
    Free the slot; the env is kept for reuse. Unknown ids are ignored.
``reset_json`` / ``step_json``
    The same calls returning the worker's JSON bytes (what the server forwards as is).
``aclose()`` / ``close()`` (sync) / ``async with``
    Stop every worker; ``close()`` kills at once. No process or actor is left behind.
``stats() -> PoolStats`` (sync)
    Workers alive, open episodes, steps, failures, worker restarts, placement.

Failure, never a hang
---------------------
Every call is bounded: a worker that makes no progress on a request for longer than
``step_timeout_s`` (``reset_timeout_s`` for resets) is killed and replaced, and so is a
worker that crashes. Each episode it held comes back as an ``EpisodeFailure`` (reason
``step_timeout`` for the one that hung, ``worker_crashed`` for the one that crashed it,
``worker_lost`` for its neighbours, ``env_error`` when the env raised, even ``SystemExit``,
or returned a reward that is not a finite number). Later calls on that episode return the same
record until it is reset or closed. Episodes share a worker, so ``num_workers`` trades
isolation for memory. Each request is timed from when the worker starts it, so a step queued
behind a slow neighbour is not charged for its wait, and a hang is blamed on the episode that
hung. A worker's death is seen when its process exits (even while a helper it forked holds its
socket), and helpers an env starts (sandboxes, browsers) die with its worker: each worker runs
in a process group of its own (``envhub.pool.procs``). A replacement that cannot start is
retried ``restart_attempts`` times; then resets waiting for a worker (and later ones) raise
``WorkerStartError`` with the env id and the last start error, never a hang, and the first reset
``retry_after_s`` later runs one more round of starts (``given_up`` says which state the pool
is in): an env fixed meanwhile (a dependency back up) serves again without a new pool. A reset the
caller gives up on (cancelled, e.g. by ``asyncio.wait_for``) leaves no episode behind.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "EnvPool",
    "EpisodeFailure",
    "PoolClosedError",
    "PoolError",
    "PoolFullError",
    "PoolStats",
    "RayConnectError",
    "ResetResult",
    "StepResult",
    "UnknownEpisodeError",
    "WorkerStartError",
]

_LAZY = {
    "EnvPool": "envhub.pool.pool",
    "ResetResult": "envhub.pool.base",
    "StepResult": "envhub.pool.base",
    "EpisodeFailure": "envhub.pool.base",
    "PoolStats": "envhub.pool.base",
    "PoolError": "envhub.pool.errors",
    "PoolClosedError": "envhub.pool.errors",
    "PoolFullError": "envhub.pool.errors",
    "UnknownEpisodeError": "envhub.pool.errors",
    "WorkerStartError": "envhub.pool.errors",
    "RayConnectError": "envhub.pool.errors",
}

if TYPE_CHECKING:  # pragma: no cover
    from envhub.pool.base import EpisodeFailure, PoolStats, ResetResult, StepResult
    from envhub.pool.errors import (
        PoolClosedError,
        PoolError,
        PoolFullError,
        RayConnectError,
        UnknownEpisodeError,
        WorkerStartError,
    )
    from envhub.pool.pool import EnvPool


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'envhub.pool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
