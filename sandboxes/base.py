"""The sandbox contract: ``Limits`` in, ``ExecResult`` out, one ``Sandbox`` lifecycle.

A *sandbox* is a private place to run untrusted, model-written code: a scratch directory the
code may write, a read-only view of the system it may use, and limits it cannot exceed. Every
backend (``local``, ``docker``, ``e2b``) implements this one class, so an environment never
knows which one it holds.

What a backend guarantees (each one's module docstring says *how*, and what it does not cover):

- ``run`` never raises because of what the program did. Crashes, timeouts, memory exhaustion,
  fork bombs and output floods come back as data in :class:`ExecResult`; only failures of the
  machinery itself raise :class:`~sandboxes.errors.SandboxError`.
- Every ``run`` is bounded by ``Limits.wall_time_s`` (or ``timeout=``): when it passes, the
  whole process tree of that run is killed, and ``timed_out`` is set.
- Nothing of a ``run`` outlives it except files in scratch: background processes it leaves
  behind are killed when it returns. Persistent state lives in a :class:`Session`.
- The host's environment variables never reach the program; it gets a small fixed
  environment (``PATH``, ``HOME``, ``LANG``, ...) plus the ``env=`` you pass.
- ``stop()`` kills everything the sandbox started and frees what it holds; it is idempotent.
- One ``run`` at a time per sandbox (calls from several threads are serialised); use a
  :class:`~sandboxes.pool.SandboxPool` for parallelism.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import dataclasses
import math
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any, ClassVar, Self

from sandboxes.errors import SandboxConfigError, SandboxFileError, SandboxStateError

__all__ = ["BASE_ENV", "LANGUAGES", "ExecResult", "Limits", "Protection", "Sandbox", "Session"]

BASE_ENV: dict[str, str] = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}
"""The whole environment a sandboxed program starts with (plus ``HOME``, set to scratch)."""

LANGUAGES: dict[str, tuple[str, list[str]]] = {
    "python": (".py", ["python3", "-I"]),
    "bash": (".sh", ["bash"]),
    "sh": (".sh", ["sh"]),
    "node": (".js", ["node"]),
}
"""``run_code`` languages: name -> (file suffix, interpreter argv the file path is appended to)."""

NAME_MAX, PATH_MAX = 255, 4000
"""Longest file name and scratch-relative path (bytes) ``write_file``/``read_file`` accept: Linux's
limits, checked up front so every backend refuses the same paths with a ``SandboxFileError``."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Everything a sandboxed program may use, in one typed object.

    Defaults suit a unit-test-sized program. Each backend enforces each field by the means
    its docstring lists; ``network=False`` means no network interface but loopback (or none).
    """

    wall_time_s: float = 10.0
    """Wall-clock budget of one ``run`` (``timeout=`` overrides it per call)."""
    cpu_time_s: float = 10.0
    """CPU seconds per process (RLIMIT_CPU); a busy loop is killed after this much CPU."""
    memory_mb: int = 512
    """Memory of the whole sandbox (cgroup) or, where no cgroup is available, per process."""
    max_processes: int = 64
    """Processes and threads alive at once (pids cgroup / RLIMIT_NPROC): stops fork bombs."""
    max_file_size_mb: int = 64
    """Largest single file a program may write (RLIMIT_FSIZE)."""
    max_output_bytes: int = 1_000_000
    """Bytes kept per stream (stdout, stderr); a program printing more is killed."""
    network: bool = False
    """Whether the program may use the network at all."""
    disk_mb: int = 256
    """Size of each writable tmpfs (scratch, ``/tmp``, ``/dev/shm``), but ``memory_mb / 8`` at
    most (``place_mb``); SysV shared memory and POSIX message queues are capped by it too where
    a backend allows them."""

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise SandboxConfigError(
                    f"Limits.{name} must be a positive number of seconds, got {value!r}"
                )
        for name in (
            "memory_mb",
            "max_processes",
            "max_file_size_mb",
            "max_output_bytes",
            "disk_mb",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SandboxConfigError(f"Limits.{name} must be a positive int, got {value!r}")
        if self.max_processes < 4:
            raise SandboxConfigError(
                f"Limits.max_processes={self.max_processes} is too small to start anything "
                "(the sandbox's own init and shell need a few); use at least 4"
            )
        if not isinstance(self.network, bool):
            raise SandboxConfigError(f"Limits.network must be True or False, got {self.network!r}")

    @property
    def place_mb(self) -> int:
        """The cap of each writable place (scratch, ``/tmp``, ``/dev/shm``, SysV shared memory):
        ``disk_mb``, but at most ``memory_mb / 8``. Their pages are the sandbox's memory, so four
        full places hold half of ``memory_mb`` at most and a full disk is never a memory bomb
        that OOM-kills the runs after it (three of the default ``disk_mb=256`` are more than the
        default ``memory_mb=512``)."""
        return max(1, min(self.disk_mb, self.memory_mb // 8))

    def replace(self, **changes: Any) -> Limits:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """What one command did. Limits that fired are flags here, never exceptions.

    ``exit_code`` follows the shell convention on every backend: 0-255 from the program,
    128+N when a signal N killed it (137 = SIGKILL, e.g. after a timeout).
    """

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    wall_time_s: float = 0.0
    timed_out: bool = False
    """The wall-time budget ran out and the run's whole process tree was killed."""
    oom_killed: bool = False
    """The memory limit killed a process of this run."""
    output_truncated: bool = False
    """A stream went past ``max_output_bytes``: the run was killed and output cut there."""
    cpu_time_exceeded: bool = False
    """A process used up ``cpu_time_s`` and the kernel killed it (SIGXCPU/SIGKILL)."""

    @property
    def ok(self) -> bool:
        """Exit code 0 and no limit fired."""
        return (
            self.exit_code == 0
            and not self.timed_out
            and not self.oom_killed
            and not self.output_truncated
            and not self.cpu_time_exceeded
        )

    @property
    def signal(self) -> int | None:
        """The signal that killed the program (from the 128+N convention), if any."""
        return self.exit_code - 128 if 128 < self.exit_code < 128 + 65 else None

    def describe(self) -> str:
        """One line for people: 'exit 0 in 12 ms' or 'killed: wall time limit (2.0 s)'."""
        reasons = [
            name
            for name, hit in (
                ("wall time limit", self.timed_out),
                ("memory limit", self.oom_killed),
                ("output limit", self.output_truncated),
                ("CPU time limit", self.cpu_time_exceeded),
            )
            if hit
        ]
        how = f"killed by {', '.join(reasons)}; " if reasons else ""
        return f"{how}exit {self.exit_code} in {self.wall_time_s * 1000:.0f} ms"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


_LIVE: weakref.WeakSet[Sandbox] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    """Sandboxes nobody stopped are stopped at interpreter exit (mounts, cgroups, containers)."""
    for sandbox in list(_LIVE):
        with contextlib.suppress(Exception):  # best effort at exit
            sandbox.stop()


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class Session(abc.ABC):
    """A long-lived interpreter inside a sandbox whose state survives between calls.

    ``session.run("cd /tmp; X=1")`` then ``session.run("echo $X; pwd")`` prints ``1`` and
    ``/tmp`` for a shell; for Python, variables and imports persist between cells. A call
    that runs past its timeout is interrupted (the state survives where the backend can stop
    just that command; otherwise the session restarts and ``restarted`` says so). Close it,
    or let ``Sandbox.stop()`` do it.
    """

    language: str
    restarts: int = 0
    """How many times the session had to be restarted (state lost) after a hung command."""

    @abc.abstractmethod
    def run(self, code: str, *, timeout: float | None = None) -> ExecResult:
        """Run ``code`` in the persistent interpreter and return its output."""

    @abc.abstractmethod
    def close(self) -> None:
        """Kill the interpreter and everything it started. Idempotent."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the interpreter is still running."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class Protection:
    """One property a backend protects, how, and the tests that attack it (``file::test``).

    Each backend lists its own in ``Sandbox.PROTECTS`` (and what it does not cover in
    ``NOT_PROTECTED``); ``envhub sandbox info`` prints both, and a test checks that every named
    test exists and that the backend's docstring names it too.
    """

    name: str
    how: str
    tests: tuple[str, ...]


class Sandbox(abc.ABC):
    """One isolated place to run commands; see the module docstring for the guarantees.

    Subclasses implement the ``_start``/``_stop``/``_exec``/file/``_open_session`` hooks;
    this class validates arguments, serialises runs and tracks the lifecycle.
    """

    backend: ClassVar[str]
    PROTECTS: ClassVar[tuple[Protection, ...]] = ()
    """What this backend protects against, how, and which tests guard it."""
    NOT_PROTECTED: ClassVar[tuple[str, ...]] = ()
    """What it does not protect against (said plainly, so nobody relies on it)."""
    workdir: str = "/sandbox"
    """The scratch directory as the sandboxed program sees it (its cwd and ``HOME``)."""

    def __init__(self, *, limits: Limits | None = None) -> None:
        if limits is not None and not isinstance(limits, Limits):
            raise SandboxConfigError(
                f"limits must be a sandboxes.Limits, got {type(limits).__name__}"
            )
        self.limits = limits or Limits()
        self.id = uuid.uuid4().hex[:12]
        self._state = "new"  # new -> started -> stopped
        self._lock = threading.RLock()
        self._sessions: list[Session] = []
        self._cell = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Self:
        """Create the sandbox (scratch, limits, container...). Calling it again is a no-op."""
        with self._lock:
            if self._state == "stopped":
                raise SandboxStateError(
                    f"{self!r} was stopped; sandboxes are not restartable, make a new one"
                )
            if self._state == "new":
                self._start()
                self._state = "started"
                _LIVE.add(self)
        return self

    def stop(self) -> None:
        """Kill every process of the sandbox and free its resources. Idempotent.

        Safe from another thread while a ``run`` is in flight: that run is killed first (it
        returns its result, flagged by what killed it) instead of being waited for.
        """
        if self._state == "started":
            self._kill_running()
        with self._lock:
            if self._state == "stopped":
                return
            was_started = self._state == "started"
            self._state = "stopped"
            for session in self._sessions:
                session.close()
            self._sessions.clear()
            if was_started:
                self._stop()

    close = stop

    @property
    def started(self) -> bool:
        return self._state == "started"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend} id={self.id} {self._state}>"

    def _require_started(self) -> None:
        if self._state != "started":
            hint = (
                "make a new sandbox"
                if self._state == "stopped"
                else "call start() or use `with sandbox:`"
            )
            raise SandboxStateError(f"{self!r} is {self._state}, not started; {hint}")

    # ---- running ---------------------------------------------------------------------------
    def run(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        """Run a command: a list is an argv (``PATH`` lookup), a str runs via ``/bin/sh -c``.

        ``timeout`` (seconds) overrides ``limits.wall_time_s``; ``stdin`` is fed to the
        program; ``env`` is added to the base environment; ``files`` (path -> content) are
        written into scratch first.
        """
        argv = self._argv(command)
        wall = self._timeout(timeout)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        if data is not None and not isinstance(data, bytes):
            raise SandboxConfigError(
                f"stdin must be str, bytes or None, got {type(stdin).__name__}"
            )
        full_env = self._env(env)
        with self._lock:
            self._require_started()
            for path, content in (files or {}).items():
                self.write_file(path, content)
            return self._exec(argv, timeout=wall, stdin=data, env=full_env)

    def run_code(
        self,
        code: str,
        language: str = "python",
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        """Write ``code`` to a scratch file and run it with the language's interpreter."""
        if language not in LANGUAGES:
            raise SandboxConfigError(
                f"unknown language {language!r}; choose one of {sorted(LANGUAGES)}"
            )
        suffix, interpreter = LANGUAGES[language]
        with self._lock:
            self._cell += 1
            path = f".envhub/cell_{self._cell}{suffix}"
            self.write_file(path, code)
            return self.run(
                [*interpreter, f"{self.workdir}/{path}"],
                timeout=timeout,
                stdin=stdin,
                env=env,
                files=files,
            )

    def session(self, language: str = "bash") -> Session:
        """Start a persistent interpreter (``"bash"`` or ``"python"``) in this sandbox."""
        if language not in ("bash", "python"):
            raise SandboxConfigError(f"sessions support 'bash' and 'python', got {language!r}")
        with self._lock:
            self._require_started()
            session = self._open_session(language)
            self._sessions.append(session)
            return session

    # ---- files -----------------------------------------------------------------------------
    def write_file(self, path: str, content: str | bytes) -> None:
        """Write a file in scratch (parents created). ``path`` is relative to scratch."""
        data = content.encode() if isinstance(content, str) else content
        if not isinstance(data, bytes):
            raise SandboxConfigError(
                f"content for {path!r} must be str or bytes, got {type(content).__name__}"
            )
        parts = self._rel_parts(path)
        with self._lock:
            self._require_started()
            self._write_bytes(parts, data)

    def read_bytes(self, path: str) -> bytes:
        """Read a file from scratch as bytes."""
        parts = self._rel_parts(path)
        with self._lock:
            self._require_started()
            return self._read_bytes(parts)

    def read_file(self, path: str) -> str:
        """Read a file from scratch as text (UTF-8, undecodable bytes replaced)."""
        return _decode(self.read_bytes(path))

    def reset(self) -> None:
        """Empty scratch and close sessions, so the next user finds a fresh sandbox."""
        with self._lock:
            self._require_started()
            for session in self._sessions:
                session.close()
            self._sessions.clear()
            self._reset()

    def healthy(self) -> bool:
        """A cheap end-to-end check (runs ``true``); pools replace sandboxes that fail it."""
        if not self.started:
            return False
        try:
            return self.run(["true"], timeout=max(5.0, self.limits.wall_time_s)).exit_code == 0
        except Exception:  # noqa: BLE001 - any failure means "replace me"
            return False

    # ---- validation helpers ----------------------------------------------------------------
    def _argv(self, command: str | Sequence[str]) -> list[str]:
        if isinstance(command, str):
            if not command.strip():
                raise SandboxConfigError(
                    "command is an empty string; pass a shell command like 'echo hi'"
                )
            return ["/bin/sh", "-c", command]
        argv = list(command)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxConfigError(
                f"command must be a str or a non-empty list of str, got {command!r}"
            )
        return argv

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.limits.wall_time_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise SandboxConfigError(
                f"timeout must be a positive number of seconds, got {timeout!r}"
            )
        return float(timeout)

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        full = {**BASE_ENV, "HOME": self.workdir}
        for key, value in (env or {}).items():
            if not isinstance(key, str) or not key or "=" in key or "\0" in key:
                raise SandboxConfigError(
                    f"env var name {key!r} is invalid (non-empty, no '=' or NUL)"
                )
            if not isinstance(value, str) or "\0" in value:
                raise SandboxConfigError(f"env var {key} must be a str without NUL, got {value!r}")
            full[key] = value
        return full

    def _rel_parts(self, path: str) -> tuple[str, ...]:
        if not isinstance(path, str) or not path:
            raise SandboxFileError(f"path must be a non-empty str, got {path!r}")
        pure = PurePosixPath(path)
        if pure.is_absolute():
            try:
                pure = pure.relative_to(self.workdir)
            except ValueError:
                raise SandboxFileError(
                    f"{path!r} is outside the scratch directory {self.workdir}; "
                    "use a path relative to it"
                ) from None
        parts = tuple(p for p in pure.parts if p not in ("", "."))
        if not parts or ".." in parts or any("\0" in p for p in parts):
            raise SandboxFileError(
                f"{path!r} must name a file inside scratch (no '..', not scratch itself)"
            )
        longest = max(len(p.encode("utf-8", "surrogateescape")) for p in parts)
        if longest > NAME_MAX or len("/".join(parts).encode("utf-8", "surrogateescape")) > PATH_MAX:
            raise SandboxFileError(
                f"{path[:80]!r}... is too long: each name may have at most {NAME_MAX} bytes "
                f"and the whole path {PATH_MAX}; use a shorter path"
            )
        return parts

    # ---- backend hooks ---------------------------------------------------------------------
    def _kill_running(self) -> None:
        """Kill whatever runs in the sandbox now, without taking the lock (called by ``stop``).

        The default does nothing; backends that can interrupt a run override this.
        """

    @abc.abstractmethod
    def _start(self) -> None: ...

    @abc.abstractmethod
    def _stop(self) -> None: ...

    @abc.abstractmethod
    def _exec(
        self, argv: list[str], *, timeout: float, stdin: bytes | None, env: dict[str, str]
    ) -> ExecResult: ...

    @abc.abstractmethod
    def _write_bytes(self, parts: tuple[str, ...], data: bytes) -> None: ...

    @abc.abstractmethod
    def _read_bytes(self, parts: tuple[str, ...]) -> bytes: ...

    @abc.abstractmethod
    def _reset(self) -> None: ...

    @abc.abstractmethod
    def _open_session(self, language: str) -> Session: ...
