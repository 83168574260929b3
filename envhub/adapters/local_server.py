"""An ASGI app (an OpenEnv env server) run as a child process on a loopback port.

``LocalServer("pkg.server.app:app").start()`` binds a socket on ``127.0.0.1`` with a port the
OS picks, hands the socket itself to ``uvicorn --fd`` in a child process (so no other process
can take the port between choosing and serving it), and returns when uvicorn logs that the
application started, or raises ``SourceConnectionError`` with the child's last output if it
exits or does not start within ``start_timeout_s``. ``stop()`` terminates the child (then
kills it) and is safe to call twice; a finaliser stops it if the owner is garbage collected
or the interpreter exits.

The child also dies with its owner process, however the owner ends (SIGKILL, the OOM killer):
it holds the read end of a pipe whose only write end the owner holds (its *lifeline*), and a
thread in the child that reads it sees end-of-file when the owner's process is gone, then
stops uvicorn (SIGTERM to itself; ``os._exit`` if that has not ended it 10 s later). A pipe,
not ``PR_SET_PDEATHSIG`` as the pool's workers use: that signal follows the *thread* that
started the child, and the trainer runs each env call in a thread of its own, so a server
started in a reset would die when that call's thread ended. Not covered: a child the owner
made with a bare ``os.fork`` (no exec) holds a copy of the write end, so the server outlives
the owner until that child exits too.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
import weakref
from typing import IO, cast

from envhub.errors import SourceConnectionError

__all__ = ["LocalServer"]

_STARTED = "Application startup complete"
_WATCHED_UVICORN = """
import os, signal, sys, threading, time
def watch():
    while os.read(0, 4096):  # the lifeline: end-of-file once the owner's process is gone
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os._exit(1)
threading.Thread(target=watch, daemon=True).start()
import uvicorn
sys.argv[0] = "uvicorn"
uvicorn.main()
"""
"""``python -m uvicorn`` with the lifeline watched (module docstring); argv is uvicorn's."""


class LocalServer:
    """One uvicorn child serving ``app`` (``"module:attr"``) on a loopback port."""

    def __init__(
        self, app: str, *, start_timeout_s: float = 120.0, env: dict[str, str] | None = None
    ) -> None:
        self.app = app
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._output: collections.deque[str] = collections.deque(maxlen=30)
        self._finalizer: weakref.finalize | None = None

    def start(self) -> str:
        """Start the child; return its base URL (``http://127.0.0.1:PORT``)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        command = [sys.executable, "-c", _WATCHED_UVICORN, self.app]
        command += ["--fd", str(listener.fileno()), "--log-level", "info", "--no-access-log"]
        lifeline, lifeline_end = os.pipe()  # not inherited by other children (O_CLOEXEC)
        try:
            self._process = subprocess.Popen(
                command,
                stdin=lifeline,
                pass_fds=(listener.fileno(),),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
            )
        except BaseException:
            os.close(lifeline_end)
            raise
        finally:
            listener.close()  # the child holds its own copies
            os.close(lifeline)
        self._finalizer = weakref.finalize(self, _terminate, self._process, lifeline_end)
        started = threading.Event()
        stream = cast(IO[bytes], self._process.stdout)  # stdout=PIPE above
        threading.Thread(target=self._read, args=(stream, started), daemon=True).start()
        if not started.wait(self.start_timeout_s) or self._process.poll() is not None:
            self.stop()
            raise SourceConnectionError(
                f"the OpenEnv server {self.app!r} did not start within {self.start_timeout_s:g} s "
                f"(exit code {self._process.returncode}); its last output:\n{self.output}"
            )
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def _read(self, stream: IO[bytes], started: threading.Event) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            self._output.append(line)
            if _STARTED in line:
                started.set()
        started.set()  # the child exited: start() sees poll() is not None

    def stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def output(self) -> str:
        """The child's last lines of output (at most 30), for error messages."""
        return "\n".join(self._output) or "(no output)"

    @property
    def exit_code(self) -> int | None:
        """The child's exit code once it has exited, else None."""
        return None if self._process is None else self._process.poll()


def _terminate(process: subprocess.Popen[bytes], lifeline: int) -> None:
    os.close(lifeline)
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()
