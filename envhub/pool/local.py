"""Local worker backends: ``process`` (one child process per worker) and ``inline``.

``ProcessWorker`` starts ``python -m envhub.pool._child`` with one end of a socketpair and
talks a tiny binary framing over it (``envhub.pool.framing``; no pickling on the hot path).
A step's body is the action's UTF-8 bytes; a reset's is ``[seed, options]`` as JSON.
Requests queued in one event-loop turn go out in one write; the child answers each as soon
as it is handled, so the pool times the request actually running. The worker runs in a
process group of its own: killing it kills the helpers its envs started
(``envhub.pool.procs``). Its death is seen when the process exits (a pidfd watch), even
while a forked helper keeps the socket open; every pending request then resolves with
``STATUS_LOST`` and the pool replaces the worker. An answer larger than
``max_message_bytes`` fails its episode (``env_error``) instead of reaching the parent.

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
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import orjson

from envhub.pool.base import STATUS_LOST, STATUS_OK, STATUS_USAGE_ERROR, dumps
from envhub.pool.errors import WorkerStartError
from envhub.pool.framing import (
    DEFAULT_MAX_MESSAGE_BYTES,
    REQUEST,
    RESPONSE,
    FrameReader,
    FrameTooLargeError,
)
from envhub.pool.host import EnvHost, spec_factory
from envhub.pool.procs import ExitWatch, describe_exit, kill_group

__all__ = ["InlineWorker", "ProcessWorker", "WorkerBase"]

_FRAME_SLACK = 1024
"""Bytes a response frame may carry beyond ``max_message_bytes`` (its header)."""
_REQUEST_IDS = 1 << 32
"""Request ids travel as 32-bit numbers, so they wrap around (only their order matters)."""

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

    def probe(self) -> None:
        """Nothing to do: a process's exit is seen at once, and an inline worker cannot die."""

    def _lost_future(self) -> asyncio.Future[tuple[int, bytes]]:
        future = self._loop.create_future()
        reason, detail = self._dead_reason or ("worker_lost", f"worker {self.name} is not running")
        future.set_result((STATUS_LOST, dumps({"reason": reason, "detail": detail})))
        return future

    def _refused_future(self, detail: str) -> asyncio.Future[tuple[int, bytes]]:
        """A request that could not be sent: the call raises ``EpisodeError`` with ``detail``;
        the worker and the episode's env are as they were."""
        future = self._loop.create_future()
        body = dumps({"error": "RequestRefusedError", "message": detail})
        future.set_result((STATUS_USAGE_ERROR, body))
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
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        WorkerBase.__init__(self, name, on_dead)
        self._setup = pickle.dumps((env, env_kwargs, max_message_bytes))
        self._start_timeout_s = start_timeout_s
        self._ids = itertools.count(1)
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._reader = FrameReader(limit=max_message_bytes + _FRAME_SLACK)
        self._transport: asyncio.Transport | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._watch: ExitWatch | None = None
        self._stopping = False
        self.pid = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the process and wait for its env to build; on any failure, cancellation
        included, the process (and its group) is killed before this returns."""
        try:
            await self._start()
        except BaseException:
            self._stopping = True
            self.kill("worker_crashed", "start failed")
            raise

    async def _start(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self._proc = subprocess.Popen(  # noqa: ASYNC220 - returns once forked; I/O is async
                [sys.executable, "-m", "envhub.pool._child", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: kill_group takes the env's helpers too
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.pid = self._proc.pid
        self.location = f"pid {self.pid}"
        self._watch = ExitWatch(self._proc, self._exited, sock=parent)
        parent.setblocking(False)
        self._transport, _ = await self._loop.create_connection(lambda: self, sock=parent)
        if self._dead_reason is not None:  # it exited before we were connected
            raise WorkerStartError(f"worker {self.name} exited at start: {self._dead_reason[1]}")
        self._alive = True
        ready = self.submit(0, 0, self._setup)
        try:
            status, body = await asyncio.wait_for(ready, self._start_timeout_s)
        except TimeoutError:
            raise WorkerStartError(
                f"worker {self.name} did not start within {self._start_timeout_s:.0f} s; "
                "raise start_timeout_s if the env is slow to import"
            ) from None
        if status != STATUS_OK:
            detail = orjson.loads(body)
            message = detail.get("message") or detail.get("detail") or ""
            raise WorkerStartError(f"worker {self.name} could not build the env:\n{message}")

    def kill(self, reason: str, detail: str) -> None:
        if self._proc is not None:
            kill_group(self._proc)
        if self._watch is not None:
            self._watch.cancel()
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
        req_id = next(self._ids) % _REQUEST_IDS if op else 0
        try:  # before it is queued: a request that cannot be sent must not wait for an answer
            header = REQUEST.pack(REQUEST.size - 4 + len(body), req_id, op, episode)
        except struct.error as exc:
            return self._refused_future(
                f"worker {self.name} cannot send a request of {len(body)} bytes for episode "
                f"{episode}: {exc} (a request body must be under 4 GiB)"
            )
        future = self._loop.create_future()
        if not self._pending:
            self._head_since = self._loop.time()
        self._pending.append((req_id, episode, future))
        self._out.append(header)
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
        try:
            frames = self._reader.feed(data)
        except FrameTooLargeError as e:
            self.kill("worker_crashed", f"protocol error: {e} (the worker caps its answers)")
            return
        pending = self._pending
        unpack_from = RESPONSE.unpack_from
        for frame in frames:
            _, req_id, status = unpack_from(frame, 0)
            if not pending or pending[0][0] != req_id:
                self.kill("worker_crashed", f"protocol error: unexpected answer {req_id}")
                return
            _, _, future = pending.popleft()
            if not future.done():
                future.set_result((status, bytes(frame[RESPONSE.size :])))
        if frames:  # the next request (if any) starts now
            self._head_since = self._loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone()

    def _exited(self) -> None:
        """The process exited (its socket may still be open: a forked helper holds it)."""
        self._gone()

    def _gone(self) -> None:
        """The socket closed or the process exited: the worker is dead, say how."""
        if self._dead_reason is not None:
            return
        if self._stopping:
            self.kill("pool_closed", "the pool was closed")
            return
        code = self._proc.poll() if self._proc is not None else None
        if code is None and self._proc is not None:
            try:
                code = self._proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        how = describe_exit(code)
        self.kill("worker_crashed", f"worker {self.name} ({self.location}) died: {how}")


class InlineWorker(WorkerBase):
    """Runs the env host in the caller's event loop (see the module docstring)."""

    kind = "inline"

    def __init__(
        self, name: str, env: Any, env_kwargs: dict[str, Any], on_dead: DeathCallback, **_: Any
    ) -> None:
        super().__init__(name, on_dead)
        self._host = EnvHost(spec_factory(env, env_kwargs), isolated=False)
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
