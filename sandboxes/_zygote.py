"""The zygote: the fork server that runs *inside* a warm local sandbox (PID 1 of its namespaces).

This file is not imported by the host: ``_executor.py`` passes its source to the sandbox's own
``python3 -I -c SOURCE FD`` (stdlib only, no project code inside the sandbox). It pre-imports
what Python runs commonly need, then forks one child per run. A child either execs a command
(shell commands, any program) or, for ``python3 -I FILE|-c CODE ...``, runs the code in the
forked interpreter itself: no interpreter start-up, no imports already done.

Protocol, on the ``SOCK_SEQPACKET`` socket ``FD`` (one message each; the host trusts none):

- host -> zygote ``R`` + fds ``[stdin, stdout, stderr, request]``: start a run. ``request`` is a
  memfd holding the run's JSON (``mode``, ``argv``, ``env``, ``cwd``, ``cpu``, ...), read by the
  *child*: what a run asks for (its code, argv, environment) never enters the zygote's memory,
  so nothing of one user's run is in the heap that the next user's runs are forked from.
- host -> zygote ``S``: fork a spare child now (the host sends it after sweeping a finished
  run): the next run's fork is then already done.
- zygote -> host ``X`` + int32: the run's child exited with this status (shell convention:
  128+N for signal N); ``F`` + int32: fork failed with this errno (the run never started).

What a child does before any code of the run (in this order): close every zygote fd, take the
run's pipes as 0/1/2, read the request, ``setsid()``, clear the signal mask, lower RLIMIT_CPU to
the run's ``cpu`` seconds, ``chdir(cwd)``; then ``exec`` with default signal dispositions, or run
Python as ``python3 -I`` would (see ``_run_python``). Cleaning up between users is the host's
job, from outside (``_executor.WarmExecutor.clean``): the zygote never looks at what a run left.
"""

from __future__ import annotations

import atexit

# Pre-imported for the runs (the code envs' test runner and common solutions use them). Each
# one makes the zygote larger, and a larger process forks more slowly: keep this list short.
import bisect  # noqa: F401
import collections  # noqa: F401
import contextlib
import ctypes
import functools  # noqa: F401
import gc
import heapq  # noqa: F401
import io  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import re  # noqa: F401
import resource
import signal
import socket
import stat
import string  # noqa: F401
import struct
import sys
import threading
import traceback  # noqa: F401
import types
import zipimport
from typing import NoReturn

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_DUMPABLE = 4
_IGNORED = (signal.SIGPIPE, signal.SIGXFSZ)
"""What Python ignores (the zygote too); every other signal is at its default there."""
_PRELOADED = frozenset(sys.modules)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _reap() -> set[int]:
    """Reap every exited child (as PID 1 the zygote also inherits the runs' orphans)."""
    done: set[int] = set()
    try:
        while True:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if not pid:
                return done
            done.add(pid)
    except ChildProcessError:
        return done


# ---- the child: everything from here to os._exit runs in a forked process ----------------------
def _child(fds: list[int], ctl: socket.socket, spare_sock: socket.socket | None) -> NoReturn:
    """Set up one run in a freshly forked child and run it; never returns."""
    try:
        ctl.close()
        if spare_sock is not None:  # a spare receives its fds over this socket first
            fds = _receive(spare_sock)
        req = json.loads(_read_request(fds[3]))
        for i in range(3):
            os.dup2(fds[i], i)
        os.closerange(3, 1 << 20)
        os.setsid()
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        cpu = int(req["cpu"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        os.chdir(req["cwd"])
        mode = req["mode"]
        if mode == "python":
            _run_python(req["argv"], req["env"])
        _exec(req["argv"], req["env"])
    except BaseException as e:  # noqa: BLE001 - the child must never return into the zygote
        try:
            os.write(2, f"envhub: cannot start the run: {e}\n".encode())
        finally:
            os._exit(127)


def _read_request(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket) -> list[int]:
    msg, fds, _, _ = socket.recv_fds(sock, 1, 4)
    sock.close()
    if msg != b"r" or len(fds) != 4:
        os._exit(126)
    return list(fds)


def _exec(argv: list[str], env: dict[str, str]) -> NoReturn:
    for sig in _IGNORED:  # the only dispositions an exec keeps (see _default_signals)
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"envhub: cannot run {argv[0]!r}: {e}\n".encode())
        os._exit(126 if isinstance(e, PermissionError) else 127)


def _run_python(argv: list[str], env: dict[str, str]) -> NoReturn:
    """Run ``python3 -I FILE ARGS`` / ``python3 -I -c CODE ARGS`` as that command would.

    Same interpreter, flags and ``sys.path``; a fresh ``__main__``; ``sys.argv``, ``os.environ``,
    std streams and signal handlers as a new ``python3 -I`` has them; tracebacks, ``SystemExit``
    and exit codes as CPython reports them. At the end: non-daemon threads are joined, atexit
    handlers run, ``__main__`` and the modules the run imported are cleared and collected (open
    files are flushed, ``__del__`` runs), the std streams flushed; the rest of interpreter
    teardown is skipped. Whatever the fast path cannot reproduce (a directory or zip to run,
    source the compiler refuses outright) is handed to the real ``python3`` by exec.
    """
    os.environ.clear()
    os.environ.update(env)
    # what a new interpreter sets up (SIGPIPE and SIGXFSZ are ignored, as in the zygote)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main = types.ModuleType("__main__")
    namespace = vars(main)
    namespace.update(__annotations__={}, __builtins__=sys.modules["builtins"])
    source: str | bytes
    if argv[2] == "-c":
        source, filename = argv[3], "<string>"
        sys.argv = ["-c", *argv[4:]]
        namespace["__loader__"] = sys.modules["_frozen_importlib"].BuiltinImporter
    else:
        filename = os.path.abspath(argv[2])
        try:
            with open(argv[2], "rb") as handle:
                regular = stat.S_ISREG(os.fstat(handle.fileno()).st_mode)
                source = handle.read() if regular else b""
        except OSError as e:
            sys.stderr.write(
                f"{argv[0]}: can't open file {filename!r}: [Errno {e.errno}] {e.strerror}\n"
            )
            _finish(2, main)
        if not regular or _is_zip(argv[2]):
            _exec(argv, env)  # a directory or zip archive with __main__.py: the real interpreter
        sys.argv = argv[2:]
        loader = sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", filename)
        namespace.update(__file__=filename, __cached__=None, __loader__=loader)
    sys.orig_argv = list(argv)
    try:
        code = compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        sys.excepthook(type(e), e.with_traceback(None), None)
        _finish(1, main)
    except (ValueError, TypeError):  # e.g. NUL bytes: let CPython say it its own way
        _exec(argv, env)
    sys.modules["__main__"] = main
    _LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # like any exec'd program (the zygote is not)
    try:
        exec(code, namespace)  # noqa: S102 - running the run's code is the point
    except SystemExit as e:
        _finish(_system_exit(e), main)
    except BaseException as e:  # noqa: BLE001 - an uncaught exception, reported as CPython does
        # the traceback starts at the run's code, as in a fresh interpreter: not at this frame
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        e.with_traceback(tb)
        try:
            sys.excepthook(type(e), e, tb)
        except BaseException:  # noqa: BLE001 - a broken hook: the default one, as CPython
            sys.__excepthook__(type(e), e, tb)
        _finish(1, main, interrupted=isinstance(e, KeyboardInterrupt))
    _finish(0, main)


def _is_zip(path: str) -> bool:
    try:
        zipimport.zipimporter(path)
    except zipimport.ZipImportError:
        return False
    except OSError:
        return False
    return True


def _system_exit(e: SystemExit) -> int:
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):  # a broken __str__ still exits 1, as in CPython
        sys.stderr.write(str(code) + "\n")
    return 1


def _finish(status: int, main: types.ModuleType, *, interrupted: bool = False) -> NoReturn:
    """The part of interpreter shutdown a run can observe, then ``os._exit``."""
    with contextlib.suppress(BaseException):  # as CPython: shutdown goes on regardless
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads
    atexit._run_exitfuncs()
    status = _flush(status)
    imported = [m for name, m in list(sys.modules.items()) if name not in _PRELOADED]
    for module in [main, *imported]:
        with contextlib.suppress(BaseException):  # odd module objects: skip, as teardown does
            vars(module).clear()
    with contextlib.suppress(BaseException):  # a __del__ that raises is reported, not fatal
        gc.collect()
    status = _flush(status)
    if interrupted:  # CPython re-raises SIGINT on itself after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _flush(status: int) -> int:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:  # noqa: BLE001 - CPython exits 120 when flushing stdout fails
            status = 120 if status == 0 else status
    return status


# ---- the zygote ---------------------------------------------------------------------------------
class Zygote:
    """The fork server's loop (see the module docstring)."""

    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.spare: tuple[int, socket.socket] | None = None

    def serve(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self.ctl, 16, 4)
            except OSError:
                return
            if not msg:
                return
            self._forget_dead_spare(_reap())
            if msg == b"S" and not fds:
                if self.spare is None:
                    self.spare = self._fork_spare()
            elif msg == b"R" and len(fds) == 4:
                self._run(fds)
            else:  # not from our host: close what came with it and refuse
                for fd in fds:
                    os.close(fd)
                return

    def _forget_dead_spare(self, reaped: set[int]) -> None:
        if self.spare is not None and self.spare[0] in reaped:
            self.spare[1].close()
            self.spare = None

    def _fork_spare(self) -> tuple[int, socket.socket] | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            ours.close()
            _child([], self.ctl, theirs)
        theirs.close()
        return pid, ours

    def _run(self, fds: list[int]) -> None:
        pid = 0
        if self.spare is not None:
            pid, sock = self.spare
            self.spare = None
            try:
                socket.send_fds(sock, [b"r"], fds)
            except OSError:
                pid = 0
            sock.close()
        if not pid:
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                self.ctl.send(b"F" + struct.pack("!i", e.errno or 0))
                return
            if pid == 0:
                _child(fds, self.ctl, None)
        for fd in fds:
            os.close(fd)
        while True:  # reap the run's orphans too (zombies would count against pids.max)
            try:
                done, status = os.waitpid(-1, 0)
            except ChildProcessError:  # the child vanished without a status: report a kill
                done, status = pid, signal.SIGKILL
            if done == pid:
                break
        self.ctl.send(b"X" + struct.pack("!i", _exit_code(status)))


def _default_signals() -> None:
    """Every disposition at its default but ``_IGNORED``: as PID 1, a signal from inside reaches
    the zygote only through a handler, so it keeps none (Python's SIGINT handler would let a run
    stop it); and a child then starts from a known state, whatever the host ignored."""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP, *_IGNORED):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)


def main() -> None:
    _LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/PID/mem from the runs
    _default_signals()
    ctl = socket.socket(fileno=int(sys.argv[1]))
    gc.freeze()  # what is imported by now is shared with every child, untouched by their GC
    Zygote(ctl).serve()


if __name__ == "__main__":
    main()
