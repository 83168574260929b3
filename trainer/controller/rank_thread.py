"""``RankThread``: the thread one in-process worker runs its calls on (the local backend).

It does what a one-thread ``ThreadPoolExecutor`` does (calls run in submission order; each
returns a ``concurrent.futures.Future``) with two differences that let a run end while a call
is stuck (a user's reward function that never returns, a rank waiting in a collective for a
peer that died):

1. its thread is a daemon, which the interpreter does not wait for at exit (an executor's
   threads are joined at exit, so one stuck call keeps the process alive after ``main``);
2. :meth:`close` waits at most ``timeout`` seconds and says what was still running, instead
   of joining forever.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RankThread"]

_Call = tuple[cf.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class RankThread:
    """One daemon thread running one worker's calls in the order they were submitted."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.running: str | None = None
        """The name of the method being run now (None when idle)."""
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> cf.Future[Any]:
        """Queue ``fn(*args, **kwargs)``; its future answers with the result or the exception."""
        future: cf.Future[Any] = cf.Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def close(self, timeout: float) -> str | None:
        """Cancel the queued calls, let the running one finish within ``timeout`` seconds;
        return the name of the method still running after that (None when the thread ended)."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)
        self._thread.join(timeout)
        return self.running if self._thread.is_alive() else None

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            self.running = getattr(fn, "__name__", repr(fn))
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - the caller's future re-raises it
                future.set_exception(error)
            finally:
                self.running = None
