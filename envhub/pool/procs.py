"""Worker processes as a unit: their own process group, killed whole, watched for their exit.

Env workers (``envhub.pool.local.ProcessWorker``, the trainer's env worker processes) host
code nobody vetted, and that code starts helpers of its own: a sandbox, a browser, a
``multiprocessing`` child forked with the worker's sockets. Two guarantees follow from here:

1. **A worker's helpers die with it.** A worker is started in a session (and process group)
   of its own (``start_new_session=True``); ``kill_group`` kills the whole group, so whatever
   the env started goes with the worker. A helper that starts a session of its own (``setsid``)
   leaves the group and is not covered.
2. **A worker's death is seen when it happens**, not when its socket closes: a forked helper
   holds a copy of the socket, so the socket stays open after the worker is gone. ``ExitWatch``
   watches the process itself (a pidfd in the event loop on Linux >= 5.3, else ``poll()`` on a
   timer) and calls back once it exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
from collections.abc import Callable

__all__ = ["ExitWatch", "describe_exit", "kill_group"]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group led by ``proc`` (started with ``start_new_session=True``):
    the worker and every helper it started. A group that is gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def describe_exit(code: int | None) -> str:
    """``exit code 3``, ``killed by SIGKILL``, or ``killed by signal 40`` (real-time signals
    have no name in ``signal.Signals``)."""
    if code is None:
        return "exit code unknown"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


class ExitWatch:
    """Call ``on_exit()`` once, from the event loop, when ``proc`` has exited.

    Uses a pidfd (readable once the process exits) where the OS has one, else polls
    ``proc.poll()`` every ``poll_s`` seconds. With ``sock`` (the parent's end of the worker's
    socket, read by the loop), ``on_exit`` waits until the loop has read what the process wrote
    before it died (a step it answered is not lost). ``cancel()`` stops watching (idempotent)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        on_exit: Callable[[], None],
        *,
        sock: socket.socket | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self._proc, self._on_exit, self._poll_s, self._sock = proc, on_exit, poll_s, sock
        self._drain_checks = 0
        self._loop = asyncio.get_running_loop()
        self._fd = -1
        self._timer: asyncio.TimerHandle | None = None
        self._done = False
        try:
            self._fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:  # gone (and reaped) already
            self._loop.call_soon(self._fire)
        except (AttributeError, OSError):  # no pidfd here: poll
            self._timer = self._loop.call_later(poll_s, self._poll)
        else:
            self._loop.add_reader(self._fd, self._fire)

    def _poll(self) -> None:
        if self._done:
            return
        if self._proc.poll() is None:
            self._timer = self._loop.call_later(self._poll_s, self._poll)
        else:
            self._fire()

    def _fire(self) -> None:
        if self._done:
            return
        if self._drain_checks < 100 and _readable(self._sock):
            self._drain_checks += 1  # the loop's reader takes it in its next iteration
            if self._fd >= 0:
                self._loop.remove_reader(self._fd)
            self._loop.call_soon(self._fire)
            return
        self.cancel()
        self._on_exit()

    def cancel(self) -> None:
        """Stop watching; ``on_exit`` will not be called."""
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fd >= 0:
            with contextlib.suppress(Exception):  # the loop may be closed already
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


def _readable(sock: socket.socket | None) -> bool:
    """Whether ``sock`` has bytes (or its end) waiting to be read."""
    if sock is None or sock.fileno() < 0:
        return False
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return False
