"""``docker exec`` for the docker backend: streamed, bounded, and cleaned up from outside.

Every program, cleanup and file transfer of a ``DockerSandbox`` is an exec in its container,
driven through the engine's low-level API over the exec's hijacked socket (no ``docker`` CLI).
:class:`ContainerExecs` is what the sandbox uses; ``ExecStream`` and ``ExecProcess`` are the
socket and a ``Popen``-like view of it for persistent sessions.

What it guarantees:

1. **Bounded time**: whatever the program does, :meth:`ContainerExecs.run` stops reading it
   ``_GRACE_S`` after ``timeout`` (or after the kill of guarantee 3) and then waits about a
   second at most for the engine's exit code; past the deadline the run is ``timed_out``.
   Every engine call is bounded too (:func:`engine_call`): an engine that does not answer by
   the run's deadline plus ``ENGINE_GRACE_S`` raises ``SandboxError``, whatever it is doing.
2. **Bounded output**: at most ``max_bytes`` per stream are kept; past them the run is killed
   and reported ``output_truncated``.
3. **Kill from outside**: a program that timed out, flooded its output, or exited while
   something it started still holds the output open, is killed by a *second* exec of
   ``KILL_ALL`` as ``kill_user``, so nothing the program did to itself can stop the kill; the
   first exec's output keeps being read meanwhile (the engine stalls new execs while an exec's
   output is left unread). A kill that has not finished ``_KILL_BOUND_S`` later was stopped
   by the program (``kill(-1, SIGSTOP)`` stops the killer too, in ``runc init``, and the
   engine then blocks on the container): the container is *compromised*. Its processes are
   SIGKILLed from the host where we can (:class:`~sandboxes._docker_host.HostCgroup`), every
   later exec is refused, and ``SandboxError`` is raised, so its owner (or a pool) stops it.
4. **Honest status**: the exit code is the engine's (128+N for signal N); a run the engine
   gives no exit code for raises ``SandboxError``, unless we killed it (timeout, output cap:
   137). ``oom_killed`` only when the container's cgroup counted an OOM kill during the run
   (from the host; elsewhere, when the engine logged an ``oom`` event since the run began);
   ``cpu_time_exceeded`` for SIGXCPU.
5. **Environment**: an exec gets the ``env`` it is given and nothing of the host's.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any, TypeVar

from sandboxes._docker_host import HostCgroup
from sandboxes.base import ExecResult, _decode
from sandboxes.errors import SandboxError

__all__ = ["KILL_ALL", "ContainerExecs", "ExecProcess", "ExecStream", "engine_call"]

T = TypeVar("T")

KILL_ALL = (
    "kill -9 -1 2>/dev/null; "
    'while read -r k v _; do [ "$k" = Uid: ] && me=$v && break; done </proc/$$/status; i=0; '
    "while [ $i -lt 2000 ]; do i=$((i+1)); left=; for f in /proc/[0-9]*/status; do "
    '[ "$f" = /proc/$$/status ] && continue; s=; '
    "while read -r k v _; do case $k in State:) s=$v;; "
    'Uid:) [ "$v" = "$me" ] && [ "$s" != Z ] && left=$f; break;; esac; '
    'done 2>/dev/null <"$f"; done; '
    '[ -z "$left" ] && break; done'
)
"""SIGKILL every process of the caller's uid, then wait (a bounded busy wait; the shell's
builtins only) until none of them runs any more: each is gone or a zombie. (``kill -0 -1``
cannot tell: it succeeds while any process of the namespace exists, signalable or not.)"""
_GRACE_S = 2.0
"""How long a killed run's output is still drained before the run is given up on."""
_KILL_BOUND_S = 5.0
"""How long a kill from outside may take before the container counts as compromised."""
ENGINE_GRACE_S = 10.0
"""How long past a run's deadline the engine may take to answer before ``SandboxError``."""
ENGINE_HINT = (
    "is dockerd running, and not hung or overloaded? Start it (e.g. `sudo dockerd` or "
    "`systemctl start docker`) or point DOCKER_HOST / base_url= at a running engine"
)
"""The fix an error about an unreachable engine suggests."""


def engine_call(what: str, within: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, an engine call, or ``SandboxError`` if it has not answered
    within ``within`` seconds (the SDK's own timeout is per socket read, 60 s, and a hung engine
    keeps a connection open without answering). The call goes on in a daemon thread meanwhile."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=call, daemon=True, name="docker-engine-call")
    thread.start()
    thread.join(max(0.0, within))
    if thread.is_alive():
        raise SandboxError(
            f"the Docker engine did not answer {what} within {within:.1f} s; {ENGINE_HINT}"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


class ExecStream:
    """A hijacked ``docker exec`` socket.

    Writes stdin and reads (stream, bytes) frames with a deadline.
    """

    def __init__(self, api: Any, exec_id: str, *, within: float = ENGINE_GRACE_S) -> None:
        self.exec_id = exec_id
        self._wrapper = engine_call(
            "exec_start", within, api.exec_start, exec_id, socket=True, demux=False
        )
        self.sock: socket.socket = getattr(self._wrapper, "_sock", self._wrapper)
        self.sock.setblocking(False)
        self._buf = bytearray()
        self.eof = False

    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view and time.monotonic() < deadline:
            _, ready, _ = select.select([], [self.sock], [], 0.2)
            if ready:
                try:
                    view = view[self.sock.send(view[:65536]) :]
                except BlockingIOError:
                    continue
                except OSError:
                    return

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def frames(self, timeout: float) -> list[tuple[int, bytes]]:
        """Frames available within ``timeout`` (empty list if none); sets ``eof`` at the end."""
        ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if ready:
            try:
                chunk = self.sock.recv(65536)
            except BlockingIOError:
                chunk = None
            except OSError:
                chunk = b""
            if chunk == b"":
                self.eof = True
            elif chunk:
                self._buf += chunk
        out = []
        while len(self._buf) >= 8:
            kind, size = self._buf[0], struct.unpack(">I", self._buf[4:8])[0]
            if len(self._buf) < 8 + size:
                break
            out.append((kind, bytes(self._buf[8 : 8 + size])))
            del self._buf[: 8 + size]
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(Exception):
            self._wrapper.close()


class ContainerExecs:
    """Execs in one container (``container_id``) through ``api``, a ``docker.APIClient``.

    ``name`` says which sandbox in error messages; every exec starts in ``workdir``. ``host``:
    the container's cgroup on this host, where we can reach it (kills and OOM counts that need
    no exec).
    """

    def __init__(
        self,
        api: Any,
        container_id: str,
        *,
        workdir: str,
        name: str,
        host: HostCgroup | None = None,
    ) -> None:
        self.api, self.container_id = api, container_id
        self.workdir, self.name, self.host = workdir, name, host
        self.compromised = ""
        """Why the container cannot be trusted any more ("" while it can): no exec runs in it."""
        self.stopping = False
        """Set by ``stop()`` before it kills the container: a run it interrupts then returns
        as killed (137) instead of raising because its exec vanished."""

    def open(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str],
        user: str,
        within: float = ENGINE_GRACE_S,
    ) -> ExecStream:
        """Start ``argv`` as ``user`` and return its stream; ``SandboxError`` if the engine
        refuses (container gone, engine down) or does not answer within ``within`` s."""
        if self.compromised:
            raise SandboxError(f"{self.name} is compromised ({self.compromised}); stop() it")
        try:
            created = engine_call(
                "exec_create",
                within,
                self.api.exec_create,
                self.container_id,
                argv,
                stdin=True,
                stdout=True,
                stderr=True,
                tty=False,
                environment=dict(env),
                workdir=self.workdir,
                user=user,
            )
            return ExecStream(self.api, created["Id"], within=within)
        except SandboxError:
            raise
        except Exception as e:  # container gone, engine down
            raise SandboxError(f"docker exec in {self.name} failed: {e}. {ENGINE_HINT}") from e

    def kill_user(self, user: str) -> None:
        """SIGKILL every process of ``user``; returns once none of them runs. ``SandboxError``
        if the kill does not finish within ``_KILL_BOUND_S`` (the container is compromised)."""
        killer = self.open(["/bin/sh", "-c", KILL_ALL], env={}, user=user)
        killer.close_stdin()
        self._await_kill(killer, user)

    def _await_kill(self, killer: ExecStream, user: str) -> None:
        """Wait for a ``KILL_ALL`` exec to end; past ``_KILL_BOUND_S``, :meth:`_compromise`."""
        deadline = time.monotonic() + _KILL_BOUND_S
        try:
            while not killer.eof and time.monotonic() < deadline:
                killer.frames(0.2)
        finally:
            killer.close()
        if not killer.eof:
            self._compromise(user, f"the kill of uid {user.partition(':')[0]} was stopped")

    def _compromise(self, user: str, why: str) -> None:
        """Refuse every later exec, SIGKILL ``user``'s processes from the host where we can
        (which also frees the engine from the stopped exec), and raise ``SandboxError``."""
        self.compromised = why
        killed = self.host is not None and self.host.kill(int(user.partition(":")[0]))
        raise SandboxError(
            f"{self.name} is compromised: {why} (not done within {_KILL_BOUND_S:.0f} s); "
            + (
                "its processes were killed from the host. "
                if killed
                else "they may still run until the container is removed. "
            )
            + "stop() the sandbox and use a new one (a SandboxPool replaces it by itself)"
        )

    def run(
        self,
        argv: list[str],
        *,
        user: str,
        env: Mapping[str, str],
        stdin: bytes | None,
        timeout: float,
        max_bytes: int,
        kill_user: str,
    ) -> ExecResult:
        """Run ``argv`` as ``user`` to its end (guarantees 1-4); ``kill_user``'s processes are
        what a kill from outside SIGKILLs."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        oom_before = self.host.oom_kills() if self.host is not None else None
        stream = self.open(argv, env=env, user=user, within=timeout + ENGINE_GRACE_S)
        if stdin:
            stream.send(stdin, deadline)
        stream.close_stdin()
        bufs = {1: bytearray(), 2: bytearray()}
        timed_out = truncated = exited = False
        killer: ExecStream | None = None
        give_up: float | None = None
        poll_every, next_poll = 0.02, t0 + 0.02
        try:
            while not stream.eof:
                now = time.monotonic()
                if killer is None and now >= deadline:
                    timed_out = True
                if killer is None and not (timed_out or truncated) and now >= next_poll:
                    # the program exited but something it started still holds the output open
                    exited = not self._running(stream.exec_id, deadline + ENGINE_GRACE_S)
                    poll_every = min(0.25, poll_every * 2)
                    next_poll = now + poll_every
                if killer is None and (timed_out or truncated or exited):
                    # kill from a second exec, and keep draining this one (guarantee 3)
                    killer = self.open(["/bin/sh", "-c", KILL_ALL], env={}, user=kill_user)
                    killer.close_stdin()
                    give_up = time.monotonic() + _GRACE_S
                if give_up is not None and now >= give_up:
                    break
                wait = (give_up or min(deadline, next_poll)) - now
                for kind, data in stream.frames(min(0.5, max(0.0, wait))):
                    buf = bufs.get(kind, bufs[2])
                    room = max_bytes - len(buf)
                    buf += data[: max(0, room)]
                    truncated = truncated or len(data) > room
                if killer is not None and not killer.eof:
                    killer.frames(0)
            if killer is not None:
                self._await_kill(killer, kill_user)
        except SandboxError:
            if not self.stopping:
                raise
        finally:
            stream.close()
            if killer is not None:
                killer.close()
        try:
            code = self.exit_code(stream.exec_id, killed=timed_out or truncated or self.stopping)
        except SandboxError:
            if not self.stopping:
                raise
            code = 137  # stop() killed the container under the run: a result, not an error
        if code in (137, 143) and not (timed_out or truncated or self.stopping):
            self._require_container_running()
        wall = time.monotonic() - t0
        oom = code == 137 and not timed_out and not truncated and self._oom(oom_before, wall)
        return ExecResult(
            exit_code=code,
            stdout=_decode(bytes(bufs[1])),
            stderr=_decode(bytes(bufs[2])),
            wall_time_s=wall,
            timed_out=timed_out,
            oom_killed=oom,
            output_truncated=truncated,
            cpu_time_exceeded=code == 152 and not timed_out,
        )

    def _running(self, exec_id: str, by: float) -> bool:
        """Whether the exec still runs; ``SandboxError`` if the engine does not say by ``by``."""
        try:
            info = engine_call(
                "exec_inspect", by - time.monotonic(), self.api.exec_inspect, exec_id
            )
        except SandboxError:
            raise
        except Exception:  # noqa: BLE001 - engine hiccup: keep waiting for the stream or the deadline
            return True
        # an exec the engine has not started yet is "Running: False" too, with no exit code
        return bool(info.get("Running")) or info.get("ExitCode") is None

    def exit_code(self, exec_id: str, *, killed: bool = False) -> int:
        """The exec's exit code, once the engine has one (~1 s at most). One it never gives is
        137 for a run we ``killed``, else ``SandboxError``: a status not read is never made up."""
        info: dict[str, Any] = {}
        try:
            for _ in range(100):
                info = engine_call("exec_inspect", ENGINE_GRACE_S, self.api.exec_inspect, exec_id)
                if not info.get("Running") and info.get("ExitCode") is not None:
                    return int(info["ExitCode"])
                time.sleep(0.01)
        except SandboxError:
            raise
        except Exception as e:
            raise SandboxError(
                f"the Docker engine lost the exec in {self.name} ({e}): the run's status is "
                f"unknown. {ENGINE_HINT}"
            ) from e
        if killed:
            return 137
        raise SandboxError(
            f"the Docker engine reports no exit code for a run in {self.name} "
            f"(Running: {info.get('Running')}); its status is unknown"
        )

    def _require_container_running(self) -> None:
        """A run killed by a signal we did not send: ``SandboxError`` if the whole container
        went down with it (an engine stopping or restarting kills every container)."""
        try:
            info = engine_call(
                "container inspect", ENGINE_GRACE_S, self.api.inspect_container, self.container_id
            )
            running = bool(info["State"]["Running"])
        except SandboxError:
            raise
        except Exception as e:
            raise SandboxError(
                f"{self.name}'s container is gone ({e}); the run was killed with it. {ENGINE_HINT}"
            ) from e
        if not running:
            raise SandboxError(
                f"{self.name}'s container stopped during the run (did the engine restart?); "
                "the run was killed with it: stop() this sandbox and use a new one"
            )

    def _oom(self, before: int | None, wall: float) -> bool:
        """Whether the kernel OOM-killed something in the container during the run: its cgroup's
        counter moved (from the host), else an engine ``oom`` event within the last ``wall`` s."""
        if self.host is not None and before is not None:
            after = self.host.oom_kills()
            return after is not None and after > before
        since = time.time() - wall - 1.0
        try:
            events = self.api.events(
                since=int(since),
                until=int(time.time()) + 1,
                decode=True,
                filters={"container": self.container_id, "event": "oom"},
            )
            return any(True for _ in events)
        except Exception:  # noqa: BLE001 - no event stream: report what we know
            return False


class ExecProcess:
    """Enough of ``subprocess.Popen`` over a docker exec for ``PipeSession``: real OS pipes for
    stdin/stdout/stderr, pumped to and from the exec socket by one thread."""

    def __init__(self, api: Any, stream: ExecStream) -> None:
        self._api, self._stream = api, stream
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.stdin: IO[bytes] = os.fdopen(in_w, "wb")
        self.stdout: IO[bytes] = os.fdopen(out_r, "rb")
        self.stderr: IO[bytes] = os.fdopen(err_r, "rb")
        self._fds = (in_r, out_w, err_w)
        self.returncode: int | None = None
        self._pid = 0
        self._thread = threading.Thread(target=self._pump, daemon=True, name="docker-session-pump")
        self._thread.start()

    def _pump(self) -> None:
        in_r, out_w, err_w = self._fds
        os.set_blocking(in_r, False)
        try:
            while not self._stream.eof:
                with contextlib.suppress(BlockingIOError):
                    data = os.read(in_r, 65536)
                    if data:
                        self._stream.send(data, time.monotonic() + 30)
                for kind, chunk in self._stream.frames(0.02):
                    with contextlib.suppress(OSError):
                        os.write(out_w if kind == 1 else err_w, chunk)
        finally:
            self._stream.close()
            for fd in self._fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            info: dict[str, Any] = {}
            with contextlib.suppress(Exception):
                for _ in range(50):
                    info = self._api.exec_inspect(self._stream.exec_id)
                    if not info.get("Running"):
                        break
                    time.sleep(0.01)
            code = info.get("ExitCode")
            self.returncode = int(code) if code is not None else 137

    @property
    def pid(self) -> int:
        """The exec's host pid (0 if the engine does not say, e.g. a remote engine)."""
        for _ in range(50):
            if self._pid or self.returncode is not None:
                break
            with contextlib.suppress(Exception):
                self._pid = int(self._api.exec_inspect(self._stream.exec_id).get("Pid") or 0)
            if not self._pid:
                time.sleep(0.01)
        return self._pid

    def poll(self) -> int | None:
        return self.returncode if not self._thread.is_alive() else None

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("docker exec", timeout or 0)
        return self.returncode if self.returncode is not None else 137

    def kill(self) -> None:
        self._stream.close()
