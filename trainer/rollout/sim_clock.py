"""``VirtualClockLoop``: an asyncio event loop whose clock is the driver's CPU time plus the
simulated time it skips.

The cluster simulation (``trainer.rollout.sim_engine``, ``benchmarks/rollout_scale.py``) runs
the real scheduler, router and env managers against simulated GPUs whose steps take
*simulated* seconds (``asyncio.sleep`` on this loop). The loop's clock is:

- the CPU time of the loop's thread, while Python runs in it (the scheduler, the router, the
  env managers, the envs): the driver's own cost is charged to the simulated timeline as it
  would be on a cluster, so a driver that cannot keep up shows as engines waiting for it.
  CPU time, not wall time: on a shared machine other processes would stretch wall time;
- plus the time it jumps: when nothing is ready and the loop would block until its next
  timer (an engine step ending, a training step, a timeout), the clock jumps to it.

Code that simulates rather than is simulated (the simulated engines: on a cluster they run in
other processes) runs inside ``uncharged()`` (or between ``stop_charging`` and
``start_charging``; both nest): its CPU is not charged to the driver's timeline
(``uncharged_s`` counts it). Work handed to a thread through
``run_in_executor`` / ``asyncio.to_thread`` is waited for (the clock does not jump past a
thread that has not answered) but not charged; threads that report back otherwise (e.g.
``call_soon_threadsafe``) are not waited for: a simulation must not use them. Another
process's answers are waited for when they are announced with ``owe`` (env worker processes
in lockstep: ``trainer.rollout.env_workers``).

``run(coro)`` is ``asyncio.run`` on this loop. Timers and ``asyncio.wait_for`` timeouts run
in simulated seconds; ``time.monotonic()`` stays real (pass ``clock=loop.time`` where a
component takes a clock, such as ``EngineRouter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar

__all__ = ["VirtualClockLoop", "run"]

T = TypeVar("T")


class _SkippingSelector(selectors.DefaultSelector):
    """A selector whose waits become clock jumps when no thread owes the loop an answer."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if self._loop.threads_pending or timeout is None:
            # a thread will answer through the self-pipe (real time passes), or nothing is
            # scheduled at all: a real wait, as on any loop
            return super().select(timeout)
        self._loop.skip(timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """The loop thread's CPU time while Python works, a jump to the next timer while it would
    wait (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(_SkippingSelector(self))
        self._uncharged = _Uncharged(self)
        self.clock_reads = 0
        """Reads of the CPU clock so far (each a system call the driver's clock pays: the
        simulation's own cost, reported apart by benchmarks/rollout_scale.py)."""
        self._cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
        self._offset = -time.clock_gettime(self._cpu_clock)
        self._paused_at: float | None = None
        self._paused_cpu = 0.0
        self._pauses = 0
        """Nesting depth of ``stop_charging`` calls not ended yet."""
        self._threads = 0
        self._threads_lock = threading.Lock()
        self.skipped_s = 0.0
        """Simulated seconds jumped over."""
        self.uncharged_s = 0.0
        """CPU seconds spent inside ``uncharged()`` (not on the clock)."""

    def time(self) -> float:
        if self._paused_at is not None:
            return self._paused_at
        self.clock_reads += 1
        return time.clock_gettime(self._cpu_clock) + self._offset

    @property
    def charged_s(self) -> float:
        """CPU seconds of the loop thread on the clock so far (the driver's)."""
        return self.time() - self.skipped_s

    def skip(self, seconds: float) -> None:
        """Advance the clock by ``seconds`` without waiting."""
        self._offset += seconds
        self.skipped_s += seconds

    def stop_charging(self) -> None:
        """From now on CPU is not charged: the clock stands still until the matching
        ``start_charging`` (calls nest: the outermost pair decides)."""
        self._pauses += 1
        if self._pauses == 1:  # one read of the CPU clock (a system call)
            self.clock_reads += 1
            self._paused_cpu = time.clock_gettime(self._cpu_clock)
            self._paused_at = self._paused_cpu + self._offset

    def start_charging(self) -> float:
        """End a ``stop_charging``; returns the CPU seconds left uncharged, once the outermost
        one ends (0 for an inner one, or without a ``stop_charging``)."""
        if self._pauses == 0:
            return 0.0
        self._pauses -= 1
        if self._pauses:
            return 0.0
        self.clock_reads += 1
        spent = time.clock_gettime(self._cpu_clock) - self._paused_cpu
        self._offset -= spent
        self.uncharged_s += spent
        self._paused_at = None
        return spent

    def uncharged(self) -> contextlib.AbstractContextManager[None]:
        """The block's CPU is not charged to the clock (it stands still meanwhile)."""
        return self._uncharged

    @property
    def threads_pending(self) -> int:
        """Calls handed to threads (or frames to processes, ``owe``) whose answer the loop has
        not taken yet."""
        return self._threads

    def owe(self, answers: int) -> None:
        """``answers`` more answers (negative: fewer) are owed to the loop by another process
        (``trainer.rollout.env_workers``' lockstep): the clock does not jump while any is."""
        with self._threads_lock:
            self._threads += answers

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        with self._threads_lock:
            self._threads += 1
        # counted down once the loop has taken the answer (not when the thread returns): the
        # clock never jumps between the two
        future.add_done_callback(self._thread_answered)
        return future

    def _thread_answered(self, _: asyncio.Future[Any]) -> None:
        with self._threads_lock:
            self._threads -= 1


class _Uncharged:
    """``VirtualClockLoop.uncharged()``: one object per loop, reusable and nestable (the state
    is the loop's), cheaper than a generator-based context manager on a path taken per engine
    step."""

    __slots__ = ("_loop",)

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._loop = loop

    def __enter__(self) -> None:
        self._loop.stop_charging()

    def __exit__(self, *exc: object) -> None:
        self._loop.start_charging()


def run(coro: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """``asyncio.run(coro)`` on a fresh ``VirtualClockLoop``."""
    with asyncio.Runner(debug=debug, loop_factory=VirtualClockLoop) as runner:
        return runner.run(coro)
