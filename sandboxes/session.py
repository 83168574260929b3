"""Persistent sessions: one long-lived ``bash`` or Python interpreter inside a sandbox.

The interpreter reads commands from a pipe. Each call sends the code plus a random nonce;
the interpreter runs it *in its own state* (``eval`` in bash, ``exec`` in one globals dict in
Python) with stdin from ``/dev/null``, then prints an end marker carrying the exit status on
stdout and a second one on stderr. We read both streams until both markers arrive.

The interpreter keeps copies of its stdout and stderr pipes, made when it starts, and points
fds 1 and 2 back at them after every command before it writes the markers: a command that
redirects or closes the shell's own streams (``exec 2>&1``, ``exec >/dev/null``, ``exec 2>&-``)
changes them for the rest of that command only, as far as the caller can tell. Should the exit
status come but the stderr marker not (a command that reached the saved copies themselves),
the interpreter is restarted at once rather than the finished command reported killed.
A Python cell that closes fd 1 or 2 and then opens a file (or socket) that takes the number
cannot have its fd pointed back at the pipe: the file's later writes would silently reach the
output. The interpreter sees that (fd 1 or 2 is no longer the pipe, and a file object of the
cell's holds it), says so in stderr and is restarted; a plain redirect (``os.dup2(null, 1)``) is
undone as in bash. (A bare fd number the cell keeps in an ``int`` is not seen.) In bash no
command can own fd 1 that way: ``exec {fd}>file`` gets a number of 10 or more.

On timeout we first interrupt just the command (SIGKILL to the shell's descendants; SIGINT
to the Python interpreter, which raises ``KeyboardInterrupt`` in the cell), so cwd, variables
and imports survive. If the marker still does not come, the interpreter is killed and
restarted, and ``restarts`` counts it. Output past ``max_output_bytes`` interrupts the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from sandboxes.base import ExecResult, Limits, Session, _decode
from sandboxes.errors import SessionError

__all__ = [
    "BASH_PRELUDE",
    "PYTHON_DRIVER",
    "PipeSession",
    "SessionProcess",
    "bash_frame",
    "python_frame",
]

_MARK = b"__ENVHUB_END_"
_GRACE_S = 2.0

PYTHON_DRIVER = r"""
import ast, gc, io, os, signal, sys, traceback
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background launch may have ignored it
proto = os.fdopen(os.dup(0), "rb", buffering=0)
saved_out, saved_err = os.dup(1), os.dup(2)  # the protocol's pipes, whatever a cell does to 1, 2
pipes = {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)}
std = [s for t in (sys.stdout, sys.stderr) for s in (t, t.buffer, getattr(t.buffer, "raw", None))]
def holder(fd):
    # what of the cell's own (a file object or socket) holds fd: it took the number after the
    # cell closed fd; pointing fd back at the pipe would send its writes to the output
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    if (st.st_dev, st.st_ino) == pipes[fd]:
        return None
    sock = sys.modules.get("socket")
    kinds = (io.FileIO, sock.socket) if sock is not None else (io.FileIO,)
    for obj in gc.get_objects():
        kind = next((k for k in kinds if issubclass(type(obj), k)), None)
        if kind is not None and not any(obj is s for s in std):
            try:
                if kind.fileno(obj) == fd:
                    return obj
            except (OSError, ValueError):
                pass
    return None
null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)
sys.stdin = open(os.devnull)
g = {"__name__": "__main__", "__builtins__": __builtins__}
def read_exact(n):
    data = b""
    while len(data) < n:
        chunk = proto.read(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data
while True:
    try:
        line = b""
        while not line.endswith(b"\n"):
            c = proto.read(1)
            if not c:
                raise EOFError
            line += c
        nonce, size = line.split()
        code = read_exact(int(size)).decode()
    except EOFError:
        break
    rc = 0
    try:
        try:
            tree = ast.parse(code, "<cell>", "exec")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<cell>", "exec"), g)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), g)
                if value is not None:
                    print(repr(value))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:
            traceback.print_exc(); rc = 130
        except BaseException:
            traceback.print_exc(); rc = 1
    except KeyboardInterrupt:
        rc = 130
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    held = [(fd, holder(fd)) for fd in (1, 2)]
    held = [(fd, obj) for fd, obj in held if obj is not None]
    if held:  # say so, ask for a restart, and end here: no dup2 redirects the cell's file
        for fd, obj in held:
            name = repr(getattr(obj, "name", type(obj).__name__))[:80]
            os.write(saved_err, (
                f"\n[envhub: the cell left fd {fd} open on its own {name} (it closed fd {fd}, "
                f"and what it opened next took that number); pointing fd {fd} back at the "
                "output would send that file's writes there, so the session restarted, "
                "state lost]\n").encode())
        os.write(saved_out, b"\n__ENVHUB_END_" + nonce + b"_RC_" + str(rc).encode() + b"_RESTART\n")
        os.write(saved_err, b"\n__ENVHUB_END_" + nonce + b"\n")
        os._exit(0)
    os.dup2(saved_out, 1); os.dup2(saved_err, 2)
    os.write(1, b"\n__ENVHUB_END_" + nonce + b"_RC_" + str(rc).encode() + b"\n")
    os.write(2, b"\n__ENVHUB_END_" + nonce + b"\n")
"""


_SAVED_OUT, _SAVED_ERR = 62, 63
"""Where a bash session keeps copies of its stdout and stderr pipes: clear of the 3-9 scripts
use and of the 10 and up that bash hands out (``exec {fd}>file``) and saves fds on."""
BASH_PRELUDE = f"exec {_SAVED_OUT}>&1 {_SAVED_ERR}>&2\n".encode()
"""Sent once when a bash session starts."""


def bash_frame(code: str, nonce: str) -> bytes:
    """``eval $'<code as \\xHH>' </dev/null``, fds 1 and 2 restored, then the end markers.

    Any text, even broken syntax, is safe to send this way. The saved pipes are closed for the
    command (bash puts them back after it), so it cannot touch them, and nothing it starts in
    the background holds the session's pipes open once it has redirected its own output.
    ``eval``, ``exec`` and ``printf`` are called as ``\\command NAME``: the builtin itself, past
    any function or alias of that name a command defined (``printf() { :; }``, or an alias
    once it ran ``shopt -s expand_aliases``), which stays defined for the commands after it.
    (``command exec``, unlike ``builtin exec``, keeps its redirections.) A function named
    ``command`` itself still breaks the frame: the call times out and the session restarts.
    """
    quoted = "".join(f"\\x{b:02x}" for b in code.encode())
    saved = f"{_SAVED_OUT}>&- {_SAVED_ERR}>&-"
    return (
        f"\\command eval $'{quoted}' </dev/null {saved}\n__envhub_rc=$?\n"
        f"\\command exec 1>&{_SAVED_OUT} 2>&{_SAVED_ERR}\n"
        f"\\command printf '\\n{_MARK.decode()}{nonce}_RC_%d\\n' \"$__envhub_rc\"\n"
        f"\\command printf '\\n{_MARK.decode()}{nonce}\\n' >&2\n"
    ).encode()


def python_frame(code: str, nonce: str) -> bytes:
    data = code.encode()
    return f"{nonce} {len(data)}\n".encode() + data


_COMMANDS = {
    "bash": (["bash", "--noprofile", "--norc"], BASH_PRELUDE, bash_frame, "bash"),
    "python": (["python3", "-I", "-u", "-c", PYTHON_DRIVER], b"", python_frame, "python3"),
}


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                kids += [
                    int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                ]
    return kids


def _descendants(pid: int) -> list[int]:
    out, i = [pid], 0  # breadth-first, so the shallowest match comes first
    while i < len(out):
        out += [kid for kid in _children(out[i]) if kid not in out]
        i += 1
    return out[1:]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class _Stream:
    """One output stream: keeps up to ``cap`` bytes and spots the end marker."""

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.window, self.truncated = cap, bytearray(), bytearray(), False

    def feed(self, chunk: bytes, marker: re.Pattern[bytes]) -> re.Match[bytes] | None:
        self.window += chunk
        found = marker.search(self.window)
        body = (
            self.window[: found.start()] if found else self.window[: max(0, len(self.window) - 96)]
        )
        room = self.cap - len(self.kept)
        if len(body) > room:
            self.truncated = True
        self.kept += body[: max(0, room)]
        self.window = self.window[found.end() :] if found else self.window[len(body) :]
        return found


class SessionProcess(Protocol):
    """What ``PipeSession`` needs of its interpreter's process: ``subprocess.Popen[bytes]`` is
    one; the docker backend's exec (``_docker_exec.ExecProcess``) is another. ``pid`` is a host
    pid, or 0 when there is none to signal (then a timeout restarts the interpreter)."""

    @property
    def stdin(self) -> IO[bytes] | None: ...
    @property
    def stdout(self) -> IO[bytes] | None: ...
    @property
    def stderr(self) -> IO[bytes] | None: ...
    @property
    def pid(self) -> int: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...


class PipeSession(Session):
    """A persistent interpreter driven over pipes; backends supply ``spawn`` and ``kill``."""

    def __init__(
        self,
        language: str,
        *,
        spawn: Callable[[list[str]], SessionProcess],
        kill: Callable[[SessionProcess], None],
        cleanup: Callable[[], None],
        limits: Limits,
        workdir: str,
    ) -> None:
        self.language = language
        self._argv, self._prelude, self._frame, self._comm = _COMMANDS[language]
        self._spawn, self._kill, self._cleanup = spawn, kill, cleanup
        self._limits, self.workdir = limits, workdir
        self._proc: SessionProcess | None = None
        self._closed = False
        self.restarts = 0
        self._launch()

    def _launch(self) -> None:
        self._proc = self._spawn(self._argv)
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is None:
                self._kill(self._proc)
                raise SessionError(
                    f"the {self.language} interpreter was started without output pipes"
                )
            os.set_blocking(stream.fileno(), False)
        if self._prelude and self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, OSError):  # (then the first run restarts)
                self._proc.stdin.write(self._prelude)
                self._proc.stdin.flush()

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._proc is not None:
            self._kill(self._proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
                if stream is not None:
                    stream.close()
        self._cleanup()

    def _restart(self) -> None:
        if self._proc is not None:
            self._kill(self._proc)
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
                if stream is not None:
                    stream.close()
        self.restarts += 1
        self._launch()

    def _interpreter_pid(self) -> int | None:
        """The host pid of the interpreter (the shallowest descendant named like it)."""
        if self._proc is None or not self._proc.pid:
            return None
        for pid in [self._proc.pid, *_descendants(self._proc.pid)]:
            if _comm(pid) == self._comm:
                return pid
        return None

    def _interrupt(self) -> None:
        """Stop the running command but keep the interpreter (and its state)."""
        pid = self._interpreter_pid()
        if pid is None:
            return
        for _ in range(3):
            for kid in _descendants(pid):
                with contextlib.suppress(OSError):
                    os.kill(kid, signal.SIGKILL)
        if self.language == "python":
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)

    def run(self, code: str, *, timeout: float | None = None) -> ExecResult:
        if self._closed:
            raise SessionError(
                f"this {self.language} session is closed; open a new one with sandbox.session()"
            )
        if not isinstance(code, str):
            raise SessionError(f"session code must be a str, got {type(code).__name__}")
        if not self.alive:
            self._restart()
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None or proc.stderr is None:
            raise SessionError(
                f"the {self.language} session has no interpreter pipes; open a new session"
            )
        wall = timeout if timeout is not None else self._limits.wall_time_s
        nonce = uuid.uuid4().hex
        out_marker = re.compile(b"\n" + _MARK + nonce.encode() + rb"_RC_(-?\d+)(_RESTART)?\n")
        err_marker = re.compile(b"\n" + _MARK + nonce.encode() + b"\n")
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        streams = {
            out_fd: _Stream(self._limits.max_output_bytes),
            err_fd: _Stream(self._limits.max_output_bytes),
        }
        t0 = time.monotonic()
        try:
            proc.stdin.write(self._frame(code, nonce))
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        rc: int | None = None
        err_done = timed_out = interrupted = restart_asked = False
        give_up = t0 + wall
        sel = selectors.DefaultSelector()
        for fd in streams:
            sel.register(fd, selectors.EVENT_READ)
        while rc is None or not err_done:
            now = time.monotonic()
            if now >= give_up:
                if interrupted or rc is not None:
                    break
                timed_out = interrupted = True
                self._interrupt()
                give_up = now + _GRACE_S
            events = sel.select(timeout=max(0.0, min(give_up - now, 0.5)))
            for key, _ in events:
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                stream = streams[key.fd]
                if key.fd == out_fd:
                    found = stream.feed(chunk, out_marker)
                    if found:
                        rc = int(found.group(1))  # (the stderr marker follows at once, or never)
                        restart_asked = found.group(2) is not None
                        give_up = min(give_up, time.monotonic() + _GRACE_S)
                else:
                    err_done = err_done or stream.feed(chunk, err_marker) is not None
                if stream.truncated and not interrupted:
                    interrupted = True
                    self._interrupt()
                    give_up = time.monotonic() + _GRACE_S
            if not sel.get_map():
                break  # the interpreter exited (e.g. `exit` in bash)
        note = b""
        if rc is not None and err_done and restart_asked:
            self._restart()  # the interpreter said why in stderr, and exited
        elif rc is not None and not err_done:
            self._restart()  # the command finished, but its stderr can no longer be delimited
            note = (
                b"\n[envhub: the session lost its stderr end marker (the command redirected the "
                b"interpreter's own streams); session restarted, state lost]\n"
            )
        elif rc is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                if not sel.get_map():
                    proc.wait(timeout=1)
            status = proc.poll()
            if status is not None:
                rc = 128 - status if status < 0 else status
                note = (
                    b"\n[envhub: the session's interpreter exited; "
                    b"the next call starts a fresh one]\n"
                )
            else:
                rc = 137
                self._restart()
                note = (
                    b"\n[envhub: the command could not be interrupted; "
                    b"session restarted, state lost]\n"
                )
        sel.close()
        out, err = streams[out_fd], streams[err_fd]
        return ExecResult(
            exit_code=rc,
            stdout=_decode(bytes(out.kept)),
            stderr=_decode(bytes(err.kept) + note),
            wall_time_s=time.monotonic() - t0,
            timed_out=timed_out,
            output_truncated=out.truncated or err.truncated,
        )
