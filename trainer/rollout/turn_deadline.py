"""``rollout.generate_timeout_s`` for one turn: a deadline that does not count weight updates.

A weight update pauses the router (``EngineRouter.update_weights_live``): every turn in flight is
preempted and held until the new weights are loaded, however long the load takes. That wait is
no fault of the engine, so it must not fail the turn: a load slower than the timeout would
otherwise fail every group in play at each update (and short episodes, which are more often
between turns, would survive more often: a bias). The deadline therefore restarts, with the
whole ``generate_timeout_s``, when it finds that the router is paused, was paused when it last
looked, or went through an update (its policy version moved) since then: a turn is failed only
after ``generate_timeout_s`` of generation with no weight update in it.

The router is looked at only when a deadline falls due (no polling). In an env worker it is
the worker's own router (``rollout.route_in_workers``: paused by the driver's
``WorkerRouters``), or the ``RemoteEngine`` that stands for the driver's router, which the
driver tells of each pause and resume (``EngineRouter.gate_watchers``). An engine that tells
neither a pause nor a version gets the plain deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

from trainer.strategies.base import GenerationRequest, GenerationResult

__all__ = ["bounded_generate", "pause_state"]


def pause_state(engine: Any) -> tuple[bool, int] | None:
    """``(paused now, policy version)`` of the router behind ``engine`` (an ``EngineRouter``, a
    worker's ``LocalRoute`` over one, or its ``RemoteEngine``); None when it tells neither."""
    router = getattr(engine, "router", engine)
    paused = getattr(router, "paused", None)
    version = getattr(router, "version", None)
    if not isinstance(paused, bool) or not isinstance(version, int):
        return None
    return paused, version


def _ignore_outcome(task: asyncio.Task[Any]) -> None:
    """Done-callback of a fire-and-forget task: its outcome is retrieved and dropped."""
    if not task.cancelled():
        task.exception()


async def bounded_generate(
    engine: Any, request: GenerationRequest, limit: float | None
) -> GenerationResult:
    """``engine.generate(request)`` within ``limit`` seconds not paused (module docstring).

    Timers rather than a task per turn: at the deadline the request is aborted in the engine (a
    live one answers within a step); if no answer comes within another ``limit`` the call is
    cancelled (abandoned). Either way ``TimeoutError`` naming ``rollout.generate_timeout_s``."""
    if limit is None:
        return await engine.generate(request)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None:  # not inside a task: a plain wait_for
        return await asyncio.wait_for(engine.generate(request), limit)
    timers: list[asyncio.TimerHandle] = []
    late: list[str] = []  # "expired", then "abandoned"
    seen = pause_state(engine)  # what the router said when the deadline last looked

    def due() -> None:
        nonlocal seen
        now = pause_state(engine)
        if seen is not None and now is not None and (now[0] or seen[0] or now[1] != seen[1]):
            seen = now  # a weight update held the turn: the deadline starts again
            timers.append(loop.call_later(limit, due))
            return
        late.append("expired")
        aborting = loop.create_task(engine.abort(request.request_id))
        aborting.add_done_callback(_ignore_outcome)
        timers.append(loop.call_later(limit, abandon))

    def abandon() -> None:
        late.append("abandoned")
        task.cancel()

    timers.append(loop.call_later(limit, due))
    try:
        result = await engine.generate(request)
    except asyncio.CancelledError:
        if "abandoned" not in late:
            raise
        task.uncancel()
        result = None
    finally:
        for timer in timers:
            timer.cancel()
    if late or result is None:
        raise TimeoutError(
            f"no generation within {limit} s (rollout.generate_timeout_s)"
            + ("; the engine did not answer the abort either" if result is None else "")
        )
    return result
