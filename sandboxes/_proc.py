"""Drive one run's pipes with bounded time and bounded output, without threads.

``pump`` is the core of ``Popen.communicate`` with the two limits a sandbox needs: a deadline
(after which a caller-supplied ``kill`` takes down the whole tree) and a per-stream byte cap
(past which the run is killed rather than drained forever). One ``select`` loop feeds stdin
and reads stdout/stderr, so a program that floods one stream while we write the other cannot
deadlock us. An optional control fd (the warm executor's socket) is watched in the same loop.
``communicate`` wraps it for a ``Popen``.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import subprocess
import time
from collections.abc import Callable

__all__ = ["Captured", "communicate", "exit_status", "pump"]

_CHUNK = 65536
_DRAIN_AFTER_KILL_S = 2.0


@dataclasses.dataclass
class Captured:
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    wall_time_s: float
    returncode: int = 0


def exit_status(returncode: int) -> int:
    """Popen's ``-N`` (killed by signal N) -> the shell's ``128+N``; other codes unchanged."""
    return 128 - returncode if returncode < 0 else returncode


def pump(
    in_fd: int | None,
    out_fd: int,
    err_fd: int,
    *,
    stdin: bytes | None,
    timeout: float,
    max_bytes: int,
    kill: Callable[[], object],
    started: float,
    control_fd: int | None = None,
    on_control: Callable[[], bool] | None = None,
) -> Captured:
    """Feed ``stdin`` to ``in_fd``; read ``out_fd``/``err_fd`` to EOF (``max_bytes`` each).

    ``kill`` must kill every process of the run so the pipes reach EOF; it is called at most
    once, on timeout or overflow. When ``control_fd`` is readable, ``on_control()`` is called;
    it returns True once it has seen the end of the run (then the control fd is dropped).
    The caller owns (and closes) the fds.
    """
    deadline = started + timeout
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    timed_out = truncated = killed = False
    sel = selectors.DefaultSelector()
    for fd in (out_fd, err_fd):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    if control_fd is not None:
        sel.register(control_fd, selectors.EVENT_READ)
    pending = memoryview(stdin) if stdin else None
    if in_fd is not None:
        if pending is None:
            os.close(in_fd)
            in_fd = None
        else:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
    kill_deadline: float | None = None
    while any(k.fd in buffers for k in sel.get_map().values()):
        now = time.monotonic()
        if not killed and now >= deadline:
            timed_out = killed = True
            kill()
            kill_deadline = now + _DRAIN_AFTER_KILL_S
        if kill_deadline is not None and now >= kill_deadline:
            break  # something outside our reach holds the pipe; give up on the rest
        wait = (kill_deadline if kill_deadline is not None else deadline) - now
        for key, _ in sel.select(timeout=max(0.0, min(wait, 1.0))):
            fd = key.fd
            if fd == in_fd:
                try:
                    written = os.write(fd, pending[:_CHUNK]) if pending is not None else 0
                    pending = pending[written:] if pending is not None else None
                except BlockingIOError:
                    continue
                except OSError:
                    pending = None
                if not pending:
                    sel.unregister(fd)
                    os.close(fd)
                    in_fd = None
                continue
            if fd == control_fd:
                if on_control is not None and on_control():
                    sel.unregister(fd)
                continue
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                continue
            buf = buffers[fd]
            room = max_bytes - len(buf)
            buf += chunk[:room]
            if len(chunk) > room and not killed:
                truncated = killed = True
                kill()
                kill_deadline = time.monotonic() + _DRAIN_AFTER_KILL_S
    sel.close()
    if in_fd is not None:
        os.close(in_fd)
    return Captured(
        bytes(buffers[out_fd]),
        bytes(buffers[err_fd]),
        timed_out,
        truncated,
        time.monotonic() - started,
    )


def communicate(
    proc: subprocess.Popen[bytes],
    *,
    stdin: bytes | None,
    timeout: float,
    max_bytes: int,
    kill: Callable[[], object],
    started: float,
) -> Captured:
    """``pump`` over a ``Popen``'s pipes, then reap it (killing it if it outlives the deadline)."""
    if proc.stdout is None or proc.stderr is None:
        raise ValueError("communicate() needs a Popen with stdout=PIPE and stderr=PIPE")
    in_fd = os.dup(proc.stdin.fileno()) if proc.stdin is not None else None
    if proc.stdin is not None:
        proc.stdin.close()
    cap = pump(
        in_fd,
        proc.stdout.fileno(),
        proc.stderr.fileno(),
        stdin=stdin,
        timeout=timeout,
        max_bytes=max_bytes,
        kill=kill,
        started=started,
    )
    try:
        cap.returncode = proc.wait(
            timeout=max(0.1, started + timeout + _DRAIN_AFTER_KILL_S - time.monotonic())
        )
    except subprocess.TimeoutExpired:
        if not (cap.timed_out or cap.truncated):
            cap.timed_out = True
        kill()
        cap.returncode = proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    cap.wall_time_s = time.monotonic() - started
    return cap
