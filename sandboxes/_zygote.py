"""The zygote: the fork server that runs *inside* a warm local sandbox (PID 1 of its namespaces).

This file is not imported by the host: ``_executor.py`` passes its source to the sandbox's own
``python3 -I -c SOURCE CTL SPAWNER CPU`` (stdlib only, no project code inside the sandbox).
First it forks the *spawner* (``_spawner``), a small process that starts commands with
``posix_spawn``; then it imports ``PRELOAD`` and serves Python runs: for ``python3 -I FILE|-c
CODE ...`` it forks a child that runs the code in the forked interpreter itself (no interpreter
start-up, no imports already done). It also forks commands when the spawner has retired.

Protocol, on ``SOCK_SEQPACKET`` sockets (one message each; the host trusts none, see
``_wire.py``):

- host -> zygote (``CTL``) or spawner (``SPAWNER``) ``R`` + uint32 run number + fds
  ``[stdin, stdout, stderr, request]``: start a run. ``request`` is a memfd holding the run's
  JSON (``mode``, ``argv``, ``env``, ``cwd``, ``cpu``), read by the zygote's *child* or by the
  spawner: what a run asks for (its code, argv, environment) never enters the zygote's memory,
  so nothing of one user's run is in the heap that the next user's runs are forked from.
- host -> zygote ``S``: fork a spare child now (the host sends it after sweeping a finished
  run): the next run's fork is then already done, and its compiler warmed up (``_warm_up``).
- zygote -> host ``X`` + int32 + the run's number: the run's child exited with this status
  (shell convention: 128+N for signal N); ``F`` + int32 + number: fork failed with this errno
  (the run never started).
- spawner -> host ``H`` (hello, once), then per run ``X`` + int32 + number, or ``Y`` (the same,
  and it retires after this run, see ``_spawner``).

What a child does before any code of the run (in this order): close every zygote fd, take the
run's pipes as 0/1/2, read the request, ``setsid()``, clear the signal mask, lower RLIMIT_CPU to
the run's ``cpu`` seconds, ``chdir(cwd)``; then ``exec`` with default signal dispositions, or run
Python as ``python3 -I`` would (see ``_run_python``). A spawned program gets the same, from
``posix_spawn``'s attributes and the spawner's own limits. Cleaning up between users is the
host's job, from outside (``_executor.WarmExecutor.clean``): neither process looks at what a
run left.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import types
import zipimport

TYPE_CHECKING = False
if TYPE_CHECKING:  # (not imported at run time: every module makes every fork dearer)
    from typing import NoReturn

PRELOAD = (
    "atexit",
    "bisect",
    "collections",
    "functools",
    "heapq",
    "io",
    "itertools",
    "math",
    "re",
    "string",
    "threading",
    "traceback",
    "typing",
)
"""What the zygote imports for the Python runs (the code envs' test runner and common solutions
use them: ``typing``, one of the slowest stdlib imports, is in nearly every HumanEval prompt),
after the spawner is forked off: each one makes every fork of the zygote slower, so the list
stays short."""
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_DUMPABLE = 4
_IGNORED = (signal.SIGPIPE, signal.SIGXFSZ)
"""What Python ignores (the zygote too); every other signal is at its default there."""
_REQUEST = struct.Struct("!cI")
"""``R`` and the run's number (the fds ride along)."""
_REPLY = struct.Struct("!ciI")
"""A kind, a value, and the number of the run it answers (0 for ``H``)."""
_PRELOADED: set[str] = set()
"""``sys.modules`` as the zygote forks a run: what a run imports is what is not in here."""


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
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if spare_sock is not None:  # a spare receives its fds over this socket first
            _warm_up()
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


_WARM_UP = "def f(a, *b, k=None, **c):\n    for x in [a, *b]:\n        yield {x: f'{x!r}'}\n"
"""Compiled once by a spare while it waits: the compiler's first use in a forked child copies
the pages it writes (and maps its arenas), which a run would otherwise wait for."""


def _warm_up() -> None:
    """What a spare does before it is handed a run; nothing of a run exists yet, and a constant
    program is all it leaves (see ``_WARM_UP``)."""
    compile(_WARM_UP, "<warm-up>", "exec", dont_inherit=True)


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
    import atexit
    import threading

    with contextlib.suppress(BaseException):  # as CPython: shutdown goes on regardless
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads
    atexit._run_exitfuncs()
    status = _flush(status)
    imported = []
    if len(sys.modules) > len(_PRELOADED):  # (walking them all touches pages of every module)
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


# ---- the spawner: commands, started with posix_spawn --------------------------------------------
_SPAWN_DEFAULTS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU)
"""The only dispositions not at their default in the spawner (the rest: ``_default_signals``)."""


def _spawner(sock: socket.socket, cpu: int) -> NoReturn:
    """Start each command the host sends with ``posix_spawn`` and answer with its exit status.

    Why a process of its own: ``posix_spawn`` (vfork) starts a program without copying the
    address space of the process that asks, but that process then reads what the run asks for
    (argv, environment), which must never enter the zygote's memory, from which Python runs
    are forked. The spawner is forked before the zygote imports ``PRELOAD`` and never forks
    anything but programs that exec at once, so nothing of its memory reaches a run.

    ``posix_spawn`` cannot set a resource limit in the child, so the spawner holds the run's
    RLIMIT_CPU (``cpu``, ``cpu`` + 1) itself (ignoring SIGXCPU) and every program inherits it.
    Its own CPU time counts against the same limit: once it has used half of ``cpu`` it answers
    ``Y`` instead of ``X`` and exits; the host then has commands forked by the zygote until the
    next reset brings up fresh ones. The host learns its pid from the kernel (SO_PASSCRED) with
    its first message, ``H``.
    """
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        for name in os.listdir("/proc/self/fd"):  # a spawned program inherits only 0, 1, 2
            with contextlib.suppress(OSError):
                os.set_inheritable(int(name), False)
        sock.send(_REPLY.pack(b"H", 0, 0))
        while True:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 4)
            if len(msg) != _REQUEST.size or msg[:1] != b"R" or len(fds) != 4:
                break
            run = _REQUEST.unpack(msg)[1]
            code = _spawn(fds)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            done = usage.ru_utime + usage.ru_stime > cpu / 2
            sock.send(_REPLY.pack(b"Y" if done else b"X", code, run))
            if done:
                break
    finally:
        os._exit(0)


def _spawn(fds: list[int]) -> int:
    """Start the command ``fds[3]`` describes on the pipes ``fds[:3]``; its exit status."""
    try:
        for fd in fds:
            os.set_inheritable(fd, False)
        req = json.loads(_read_request(fds[3]))
        argv, env = req["argv"], req["env"]
        actions = [(os.POSIX_SPAWN_DUP2, fds[i], i) for i in range(3)]
        try:
            os.chdir(req["cwd"])
            pid = _spawn_on_path(argv, env, actions)
        except (OSError, ValueError) as e:
            os.write(fds[2], f"envhub: cannot run {argv[0]!r}: {e}\n".encode())
            return 126 if isinstance(e, PermissionError) else 127
    finally:  # the run's pipes end with its processes, even if a run stops the spawner
        for fd in fds:
            os.close(fd)
    while True:
        try:
            done, status = os.waitpid(pid, 0)
        except ChildProcessError:  # it vanished without a status: report a kill
            return 128 + signal.SIGKILL
        if done == pid:
            return _exit_code(status)


def _spawn_on_path(
    argv: list[str], env: dict[str, str], actions: list[tuple[int, int, int]]
) -> int:
    """``posix_spawn`` with ``execvpe``'s search of the run's ``PATH`` (glibc's ``posix_spawnp``
    would search the spawner's own)."""

    def spawn(path: str) -> int:
        return os.posix_spawn(
            path,
            argv,
            env,
            file_actions=actions,
            setsid=True,
            setsigmask=(),
            setsigdef=_SPAWN_DEFAULTS,
        )

    if "/" in argv[0]:
        return spawn(argv[0])
    first: OSError | None = None
    last: OSError = FileNotFoundError(2, "No such file or directory", argv[0])
    for directory in env.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(directory or ".", argv[0])
        try:
            os.stat(path)  # (a missing file costs a stat here, not a failed vfork and exec)
            return spawn(path)
        except (FileNotFoundError, NotADirectoryError) as e:
            last = e
        except OSError as e:
            last = e
            first = first or e
    raise first or last


# ---- the zygote ---------------------------------------------------------------------------------
class Zygote:
    """The fork server's loop (see the module docstring)."""

    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.spare: tuple[int, socket.socket] | None = None
        # Orphans of the spawner's programs are the zygote's to reap, between messages too:
        # a SIGCHLD handler (a no-op; as PID 1 it gets only signals it handles) wakes the loop.
        self.wake, wake_w = os.pipe()
        os.set_blocking(self.wake, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, _nothing)

    def serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.ctl.fileno(), self.wake], [], [])
            if self.wake in ready:
                with contextlib.suppress(OSError):
                    os.read(self.wake, 4096)
                self._forget_dead_spare(_reap())
            if self.ctl.fileno() not in ready:
                continue
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
            elif len(msg) == _REQUEST.size and msg[:1] == b"R" and len(fds) == 4:
                self._run(fds, _REQUEST.unpack(msg)[1])
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

    def _run(self, fds: list[int], run: int) -> None:
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
                self.ctl.send(_REPLY.pack(b"F", e.errno or 0, run))
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
        self.ctl.send(_REPLY.pack(b"X", _exit_code(status), run))


def _nothing(signum: int, frame: object) -> None:
    """SIGCHLD's handler in the zygote: its only effect is the wake-up write."""


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
    to_spawner = socket.socket(fileno=int(sys.argv[2]))
    if os.fork() == 0:  # before the preloads: the spawner stays small
        ctl.close()
        _spawner(to_spawner, int(sys.argv[3]))
    to_spawner.close()
    for name in PRELOAD:
        __import__(name)
    _PRELOADED.update(sys.modules)
    gc.freeze()  # what is imported by now is shared with every child, untouched by their GC
    Zygote(ctl).serve()


if __name__ == "__main__":
    main()
