"""Warm pools: N started sandboxes handed out one at a time and recycled in the background.

```python
pool = SandboxPool("local", size=4, limits=Limits(wall_time_s=5))
with pool.acquire() as sb:        # a started sandbox, scratch empty, no sessions
    sb.run_code(solution)
pool.close()                       # stops every sandbox, idle or handed out
```

Pooled ``local`` sandboxes default to ``warm_exec=True``: each keeps a fork server (the
zygote) inside its namespaces, and a run is a fork there, then an exec, or for ``python3 -I``
the code itself in the forked interpreter (see ``sandboxes/_executor.py``).
Release never blocks the caller: the sandbox goes to a background worker that ``reset()``s it
(empties scratch, closes sessions) and puts it back. A sandbox that raised a
``SandboxError`` while handed out, fails its reset, or (with ``check_health=True``) fails a
``true`` run is stopped and replaced by a new one. ``close()`` waits for the workers and
stops everything, so nothing leaks.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

from sandboxes.base import Limits, Sandbox
from sandboxes.errors import PoolClosedError, SandboxConfigError, SandboxError

__all__ = ["SandboxPool"]


class SandboxPool:
    """``size`` pre-started sandboxes of one backend; see the module docstring."""

    def __init__(
        self,
        backend: str = "local",
        *,
        size: int = 4,
        limits: Limits | None = None,
        check_health: bool = False,
        **backend_kwargs: Any,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise SandboxConfigError(f"pool size must be an int >= 1, got {size!r}")
        self.backend, self.size, self.limits = backend, size, limits
        self.check_health = check_health
        self._kwargs = backend_kwargs
        self._idle: queue.Queue[Sandbox] = queue.Queue()
        self._all: set[Sandbox] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.replaced = 0
        """How many broken sandboxes were replaced."""
        self._workers = ThreadPoolExecutor(
            max_workers=min(4, size), thread_name_prefix="sandbox-pool"
        )
        try:
            for sandbox in self._workers.map(lambda _: self._new(), range(size)):
                self._idle.put(sandbox)
        except BaseException:
            self.close()
            raise

    def _new(self) -> Sandbox:
        from sandboxes import make_sandbox

        kwargs = dict(self._kwargs)
        if self.backend == "local":  # pooled local sandboxes fork runs from a warm executor
            kwargs.setdefault("warm_exec", True)
        sandbox = make_sandbox(self.backend, limits=self.limits, **kwargs)
        with self._lock:
            if self._closed:
                raise PoolClosedError("the pool was closed while starting a sandbox")
            self._all.add(sandbox)
        try:
            sandbox.start()
        except BaseException:
            self._discard(sandbox)
            raise
        return sandbox

    def _discard(self, sandbox: Sandbox) -> None:
        with self._lock:
            self._all.discard(sandbox)
        with contextlib.suppress(Exception):
            sandbox.stop()

    @property
    def idle(self) -> int:
        """Sandboxes ready to hand out right now."""
        return self._idle.qsize()

    @contextlib.contextmanager
    def acquire(self, timeout: float | None = None) -> Iterator[Sandbox]:
        """A started, clean sandbox for the ``with`` block; waits up to ``timeout`` s for one."""
        if self._closed:
            raise PoolClosedError(f"this {self.backend} pool is closed; make a new SandboxPool")
        try:
            sandbox = self._idle.get(timeout=timeout)
        except queue.Empty:
            raise SandboxError(
                f"no {self.backend} sandbox free within {timeout} s (pool size {self.size}); "
                "raise size= or release sandboxes sooner"
            ) from None
        broken = False
        try:
            yield sandbox
        except SandboxError:
            broken = True
            raise
        finally:
            self._release(sandbox, broken)

    def _release(self, sandbox: Sandbox, broken: bool) -> None:
        if self._closed:
            self._discard(sandbox)
            return
        try:
            self._workers.submit(self._recycle, sandbox, broken)
        except RuntimeError:  # executor shut down by close()
            self._discard(sandbox)

    def _recycle(self, sandbox: Sandbox, broken: bool) -> None:
        if not broken:
            try:
                sandbox.reset()
                broken = self.check_health and not sandbox.healthy()
            except Exception:  # noqa: BLE001 - a failed reset means "replace it"
                broken = True
        if broken or not sandbox.started:
            self._discard(sandbox)
            with self._lock:
                self.replaced += 1
            try:
                sandbox = self._new()
            except Exception:  # noqa: BLE001 - retried on the next release; the pool shrinks meanwhile
                return
        if self._closed:
            self._discard(sandbox)
        else:
            self._idle.put(sandbox)

    def close(self) -> None:
        """Stop every sandbox (idle or handed out) and the workers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._workers.shutdown(wait=True, cancel_futures=False)
        with self._lock:
            everything = list(self._all)
            self._all.clear()
        for sandbox in everything:
            with contextlib.suppress(Exception):
                sandbox.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
