"""Local worker backends: ``process`` (one child process per worker) and ``inline``.

``ProcessWorker`` starts ``python -m envhub.pool._child`` with one end of a socketpair and
talks a tiny binary framing over it (no pickling on the hot path)::

    request  = u32 length | u32 request id | u8 op | u32 episode | body
    response = u32 length | u32 request id | u8 status | body (JSON)

A step's body is the action's UTF-8 bytes; a reset's is ``[seed, options]`` as JSON.
Requests queued in one event-loop turn go out in one write and the child answers a batch
in one write, so at high concurrency the per-step cost is dominated by the env itself. A
worker that dies (crash, ``kill``) closes the socket; every pending request resolves with
``STATUS_LOST`` and the pool replaces the worker.

``InlineWorker`` runs the env host in the caller's event loop: no process, no copies, the
fastest path, but no isolation and no way to stop a hung env. Use it only for trusted envs
whose steps take microseconds (it is what benchmarks use to find the stack's limit).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import orjson

from envhub.pool.base import STATUS_LOST, STATUS_OK, dumps
from envhub.pool.errors import WorkerStartError
from envhub.pool.host import EnvHost, spec_factory

__all__ = ["InlineWorker", "ProcessWorker", "WorkerBase"]

_REQ = struct.Struct("<IIBI")
_RESP = struct.Struct("<IIB")

DeathCallback = Callable[[Any, str, str], None]
"""``on_dead(worker, reason, detail)``, called once, before pending requests resolve."""


class WorkerBase:
    """In-flight bookkeeping every backend shares: a FIFO of pending requests."""

    kind = "base"

    def __init__(self, name: str, on_dead: DeathCallback) -> None:
        self.name = name
        self.location = "?"
        self.on_dead = on_dead
        self._loop = asyncio.get_running_loop()
        self._pending: collections.deque[tuple[int, int, asyncio.Future[tuple[int, bytes]]]] = (
            collections.deque()
        )
        self._head_since = 0.0
        self._alive = False
        self._dead_reason: tuple[str, str] | None = None

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def inflight(self) -> int:
        return len(self._pending)

    @property
    def head_since(self) -> float:
        return self._head_since

    @property
    def head_episode(self) -> int:
        return self._pending[0][1] if self._pending else -1

    def _lost_future(self) -> asyncio.Future[tuple[int, bytes]]:
        future = self._loop.create_future()
        reason, detail = self._dead_reason or ("worker_lost", f"worker {self.name} is not running")
        future.set_result((STATUS_LOST, dumps({"reason": reason, "detail": detail})))
        return future

    def _die(self, reason: str, detail: str) -> None:
        """Mark dead once, tell the pool, then resolve everything pending as lost."""
        if self._dead_reason is not None:
            return
        self._alive = False
        self._dead_reason = (reason, detail)
        self.on_dead(self, reason, detail)
        body = dumps({"reason": reason, "detail": detail})
        while self._pending:
            _, _, future = self._pending.popleft()
            if not future.done():
                future.set_result((STATUS_LOST, body))


class ProcessWorker(WorkerBase, asyncio.Protocol):
    """One child process hosting many envs (see the module docstring)."""

    kind = "process"

    def __init__(
        self,
        name: str,
        env: Any,
        env_kwargs: dict[str, Any],
        on_dead: DeathCallback,
        *,
        start_timeout_s: float = 60.0,
    ) -> None:
        WorkerBase.__init__(self, name, on_dead)
        self._setup = pickle.dumps((env, env_kwargs))
        self._start_timeout_s = start_timeout_s
        self._ids = itertools.count(1)
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self.pid = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self._proc = subprocess.Popen(  # noqa: ASYNC220 - returns once forked; I/O is async
                [sys.executable, "-m", "envhub.pool._child", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self.pid = self._proc.pid
        self.location = f"pid {self.pid}"
        parent.setblocking(False)
        self._transport, _ = await self._loop.create_connection(lambda: self, sock=parent)
        self._alive = True
        ready = self.submit(0, 0, self._setup)
        try:
            status, body = await asyncio.wait_for(ready, self._start_timeout_s)
        except TimeoutError:
            self.kill("worker_crashed", "start timed out")
            raise WorkerStartError(
                f"worker {self.name} did not start within {self._start_timeout_s:.0f} s; "
                "raise start_timeout_s if the env is slow to import"
            ) from None
        if status != STATUS_OK:
            self._stopping = True
            self.kill("worker_crashed", "start failed")
            detail = orjson.loads(body)
            message = detail.get("message") or detail.get("detail") or ""
            raise WorkerStartError(f"worker {self.name} could not build the env:\n{message}")

    def kill(self, reason: str, detail: str) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._die(reason, detail)
        if self._transport is not None:
            try:
                self._transport.abort()
            except RuntimeError:  # its event loop is already closed
                pass
        self._reap()

    async def stop(self) -> None:
        self._stopping = True
        if self._alive and self._transport is not None:
            if self._transport.can_write_eof():
                self._transport.write_eof()
            else:
                self._transport.close()
            deadline = self._loop.time() + 5
            while (
                self._proc is not None
                and self._proc.poll() is None
                and self._loop.time() < deadline
            ):
                await asyncio.sleep(0.02)
        self.kill("pool_closed", "the pool was closed")

    def _reap(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            threading.Thread(target=proc.wait, name=f"reap-{self.name}", daemon=True).start()

    # ------------------------------------------------------------------ requests
    def submit(self, op: int, episode: int, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        if not self._alive:
            return self._lost_future()
        req_id = next(self._ids) if op else 0
        future = self._loop.create_future()
        if not self._pending:
            self._head_since = self._loop.time()
        self._pending.append((req_id, episode, future))
        self._out.append(_REQ.pack(9 + len(body), req_id, op, episode))
        self._out.append(body)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is not None and self._out:
            self._transport.write(b"".join(self._out))
        self._out.clear()

    # ------------------------------------------------------------------ asyncio.Protocol
    def data_received(self, data: bytes) -> None:
        if self._buf:  # the rest of a frame that came cut (rare: the child writes whole batches)
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        pos, end = 0, len(data)
        pending = self._pending
        unpack_from = _RESP.unpack_from
        while end - pos >= _RESP.size:
            length, req_id, status = unpack_from(data, pos)
            stop = pos + 4 + length
            if stop > end:
                break
            body = data[pos + _RESP.size : stop]
            pos = stop
            if not pending or pending[0][0] != req_id:
                self.kill("worker_crashed", f"protocol error: unexpected answer {req_id}")
                return
            _, _, future = pending.popleft()
            if not future.done():
                future.set_result((status, body))
        if pos < end:
            self._buf += memoryview(data)[pos:]
        self._head_since = self._loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._dead_reason is not None:
            return
        if self._stopping:
            self._die("pool_closed", "the pool was closed")
            self._reap()
            return
        code = self._proc.poll() if self._proc is not None else None
        if code is None and self._proc is not None:
            try:
                code = self._proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        self._die("worker_crashed", f"worker {self.name} ({self.location}) died: {how}")
        self._reap()


class InlineWorker(WorkerBase):
    """Runs the env host in the caller's event loop (see the module docstring)."""

    kind = "inline"

    def __init__(
        self, name: str, env: Any, env_kwargs: dict[str, Any], on_dead: DeathCallback, **_: Any
    ) -> None:
        super().__init__(name, on_dead)
        self._host = EnvHost(spec_factory(env, env_kwargs))
        self.location = f"pid {os.getpid()} (inline)"

    async def start(self) -> None:
        try:
            self._host.idle.append(self._host.factory())
        except Exception as exc:
            raise WorkerStartError(
                f"worker {self.name} could not build the env: {type(exc).__name__}: {exc}"
            ) from exc
        self._alive = True

    def submit(self, op: int, episode: int, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        if not self._alive:
            return self._lost_future()
        future = self._loop.create_future()
        future.set_result(self._host.handle(op, episode, body))
        return future

    def kill(self, reason: str, detail: str) -> None:
        self._die(reason, detail)
        self._host.close()

    async def stop(self) -> None:
        self.kill("pool_closed", "the pool was closed")
