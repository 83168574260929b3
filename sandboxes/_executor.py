"""The warm executor: a fork server (the *zygote*, ``_zygote.py``) inside a local sandbox.

Why: a fresh bubblewrap per run costs a user, PID, mount and network namespace each time, and a
Python run another ~15 ms of interpreter start-up and imports. A warm sandbox instead starts,
once, a small pre-imported Python *inside* its namespaces. A run is then one fork there (often
done ahead: the zygote keeps a spare child forked between runs), followed by an exec for
commands, or, for ``python3 -I FILE|-c CODE ...`` (``run_code``, the code envs' test runner),
by running the code in the forked interpreter itself (see ``_zygote._run_python`` for what that
reproduces of a real ``python3 -I``). ``in_process(argv, env)`` says which.

Protocol: ``_zygote.py``'s docstring. The host side treats the zygote, which sandboxed code
shares a uid and namespaces with, as hostile: every reply is one fixed-size message, parsed
strictly (a wrong size, kind or value ends the zygote); file descriptors it sends are dropped;
the wall-time deadline, output caps and the sweep of the run's processes are the host's, never
the zygote's; what a run asks for (argv, env, code) reaches the child through a memfd, never the
zygote's memory.

Containment does not depend on the zygote's good behaviour: runs live in the sandbox's ``run``
cgroup, and after every run (or on timeout) the host SIGKILLs every process there except the
zygote (and its launcher), spare children included. Nothing the sandboxed code can reach
outlives a run, and nothing a run does reaches the next one:

- every run is a **fresh fork** of the zygote, which never runs code of a run itself: modules a
  run imports, globals it sets, threads, signal handlers and open files die with its process;
- the zygote is **PID 1** of the sandbox's PID namespace (``bwrap --as-pid-1``, or exec'd in
  place of the ``unshare`` script), so there is no bubblewrap init for the code to attach to,
  and signals it has no handler for (SIGKILL, SIGSTOP, SIGTERM...) sent from inside are
  ignored by the kernel; it reaps the run's orphans;
- it is **non-dumpable** (``PR_SET_DUMPABLE=0``): the sandboxed code, same uid, can neither
  ptrace it nor open its ``/proc/PID/mem`` or ``/proc/PID/fd``; the seccomp filter
  (``_seccomp.py``) denies ``ptrace`` and ``process_vm_*`` outright;
- a zygote that dies anyway (the OOM killer may pick it, as any process of the sandbox) or
  breaks the protocol costs a restart: the run is reported as killed (exit 137, a note on
  stderr), and the next run starts a fresh zygote in fresh namespaces.

On ``reset()``, ``clean()`` sweeps the cgroup, empties every writable place from the host,
through the zygote's ``/proc/PID/root`` and following no symlink (and SysV IPC where seccomp
allows it, with ``ipcrm``), and checks that ``/dev`` is as it was; ``verify()``
checks what it spares (nothing but the zygote and its launcher left in the cgroup, neither
traced nor stopped, the zygote still under its seccomp filter, and what its runs inherit from
it — rlimits, nice, CPU affinity, scheduling policy, which a run of the same uid can change
through ``prlimit``/``setpriority``/``sched_*`` — as it was at start); the sandbox starts a
fresh zygote, in fresh namespaces, when either fails.

Not protected: every Python run of one zygote shares its hash seed (``str`` hashes are
randomised per zygote, not per run) and its address-space layout; a run can learn both, which
tells it nothing about another run's data.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from sandboxes import _host, _seccomp
from sandboxes._host import Cgroup
from sandboxes._proc import Captured, pump
from sandboxes.errors import SandboxError

__all__ = ["WarmExecutor", "in_process", "zygote_source"]

_POLL_S = 0.05
"""How often a run that closed its pipes checks that the zygote can still answer."""
_REPLY = struct.Struct("!ci")
"""The zygote's only message shape: a kind byte and a signed 32-bit value."""
_STARTUP_ENV = ("PATH", "LANG", "LANGUAGE", "TZ")
"""Variables (with every ``LC_*``) that shape a Python interpreter as it starts: a run forked
from the zygote has the zygote's, so a run that sets other values is exec'd instead."""
_LOST = (
    "envhub: the sandbox's process server (zygote) died or misbehaved during this run; "
    "the next run starts a fresh one\n"
)


@functools.cache
def zygote_source() -> str:
    """The program the sandbox's ``python3 -I -c`` runs (``_zygote.py``, read once)."""
    return Path(__file__).with_name("_zygote.py").read_text()


def in_process(argv: Sequence[str], env: Mapping[str, str], zygote_env: Mapping[str, str]) -> bool:
    """Whether ``argv`` is ``python3 -I FILE ...`` or ``python3 -I -c CODE ...`` with the same
    interpreter-shaping environment as the zygote: then the zygote's fork runs it in place."""
    if len(argv) < 3 or argv[0] != "python3" or argv[1] != "-I":
        return False
    script = argv[2]
    if (script == "-c" and len(argv) < 4) or (script != "-c" and script[:1] in ("", "-")):
        return False
    keys = {k for k in (*env, *zygote_env) if k in _STARTUP_ENV or k.startswith("LC_")}
    return all(env.get(k) == zygote_env.get(k) for k in keys)


def _descendants(pid: int) -> list[int]:
    out, i = [pid], 0
    while i < len(out):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{out[i]}/task"):
                with contextlib.suppress(OSError):
                    out += [
                        int(x)
                        for x in Path(f"/proc/{out[i]}/task/{task}/children").read_text().split()
                    ]
        i += 1
    return out[1:]


def _proc(pid: int, name: str) -> str:
    """``/proc/PID/NAME`` in one read (small files: status, stat, limits)."""
    fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)


class _ProtocolError(Exception):
    """The zygote sent something it never sends: it is no longer trusted."""


def _parse(sock: socket.socket) -> tuple[bytes, int] | None:
    """One reply from the zygote: ``(b"X", exit status)`` or ``(b"F", errno)``; None at EOF.

    Anything else raises ``_ProtocolError``. No buffer for ancillary data is offered, so file
    descriptors the zygote might send are closed by the kernel, never installed here."""
    data, _, flags, _ = sock.recvmsg(_REPLY.size + 1)
    if not data:
        return None
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) != _REPLY.size:
        raise _ProtocolError(f"a {len(data)}-byte message (flags {flags:#x})")
    kind, value = _REPLY.unpack(data)
    if (kind == b"X" and 0 <= value <= 255) or (kind == b"F" and 0 <= value < 4096):
        return kind, value
    raise _ProtocolError(f"message {kind!r} {value}")


class WarmExecutor:
    """Host side of one zygote, in ``cgroup`` (the sandbox's run cgroup, which it sweeps).

    ``spawn(argv, pass_fd)`` must start ``argv`` in the sandbox, inheriting ``pass_fd``, inside
    ``cgroup``. ``env`` and ``cpu`` (RLIMIT_CPU) are what the zygote starts with and its own
    checks run with; Python runs whose ``env`` differs from it where interpreter start-up
    reads it are exec'd instead of forked (see ``in_process``).
    """

    def __init__(
        self,
        spawn: Callable[[list[str], int], subprocess.Popen[bytes]],
        cgroup: Cgroup,
        *,
        env: dict[str, str],
        cpu: int,
    ) -> None:
        self._spawn, self._cgroup = spawn, cgroup
        self.env, self._cpu = env, cpu
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.host_pid = 0
        self.keep: set[int] = set()
        """The zygote and its launcher's processes: the only ones a sweep spares."""
        self._baseline: dict[str, str] = {}
        self._dev = b""
        self._proc_fd: int | None = None
        self._swept = False
        """No process of a run is left: every one since was forked by the zygote for itself."""

    def _kill_others(self, exclude: set[int]) -> bool:
        """SIGKILL every process of the cgroup but ``exclude``; False if some survived. Whatever it
        could not kill stays there, where ``verify()`` finds it: ``clean()`` then fails and the
        sandbox starts over."""
        return self._cgroup.kill_all(exclude=exclude)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.sock is not None

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = self._spawn(
                ["python3", "-I", "-c", zygote_source(), str(theirs.fileno())], theirs.fileno()
            )
        finally:
            theirs.close()
        self.sock = ours
        deadline = time.monotonic() + 30
        while not self.host_pid and time.monotonic() < deadline:  # find it to spare it from sweeps
            for pid in _descendants(self.proc.pid):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "python3":
                        self.host_pid = pid
                        break
            if self.proc.poll() is not None:
                break
            time.sleep(0.001)
        if not self.host_pid:
            stderr = self.proc.stderr
            exited = self.proc.poll() is not None
            err = stderr.read().decode(errors="replace") if exited and stderr is not None else ""
            self.stop()
            raise SandboxError(f"the warm executor did not start: {err.strip() or 'not found'}")
        self._baseline = self._inherited()
        self.keep = {self.host_pid}  # and its ancestors up to the launcher (bwrap, its init...)
        pid = self.host_pid
        while pid != self.proc.pid and pid > 1:
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
            self.keep.add(pid)
        try:
            self._proc_fd = os.open(f"/proc/{self.host_pid}", os.O_RDONLY | os.O_DIRECTORY)
            cap = self._own(["true"], restart=False)  # it forks and execs
            # the first look at /dev, in fresh namespaces, is what clean() compares with
            self._dev = self._dev_listing()
        except BaseException:
            self.stop()
            raise
        if cap.returncode != 0 or cap.timed_out:
            err = cap.stderr.decode(errors="replace").strip()
            self.stop()
            raise SandboxError(f"the warm executor failed its first run: {err or 'no reason'}")
        self._swept = True
        self._prefork()

    def clean(self, writable: Sequence[str]) -> bool:
        """Make the sandbox fit for its next user without new namespaces: sweep every process but
        the zygote (and a spare it forked for itself), empty ``writable`` (every place a run can
        write) and SysV IPC, check that ``/dev`` looks as it did at the start, and ``verify()``
        what was spared. False if anything is left or untrustworthy (a directory too big to
        empty, a traced zygote...): the caller then starts over in fresh namespaces.

        The emptying is done from the host, as root, through ``/proc/PID/root`` of the zygote
        (by a handle on that very process, never a pid that could be reused), following no
        symlink: nothing of what a run left is ever read inside the sandbox."""
        if not self.alive:
            return False
        spare = self._spare(self._cgroup.pids())
        if not self._cgroup.kill_all(exclude=self.keep | spare, timeout=1.0):
            return False  # (nothing runs from here on: what runs left is still as they left it)
        if _seccomp.program() is None:  # SysV IPC is not denied: remove what runs made
            try:
                cap = self._own(["ipcrm", "-a"])
            except SandboxError:
                return False
            if cap.returncode != 0 or cap.timed_out:
                return False
        try:
            root = os.open("root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._fd())
            try:
                for path in writable:
                    fd = _host.open_dir_at(root, path)
                    try:
                        if not _host.empty_dir(fd):
                            return False
                    finally:
                        os.close(fd)
            finally:
                os.close(root)
            # /dev is read-only inside, but a tampered /dev/null must never reach the next user
            if self._dev_listing() != self._dev:
                return False
        except OSError:  # the zygote is gone, or a path was replaced by a symlink
            return False
        if self.verify() is not None:
            return False
        self._swept = True
        self._prefork()
        return True

    def _fd(self) -> int:
        if self._proc_fd is None:
            raise OSError(f"no handle on the zygote's /proc directory ({self.host_pid})")
        return self._proc_fd

    def _dev_listing(self) -> bytes:
        root = os.open("root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._fd())
        try:
            dev = _host.open_dir_at(root, "dev")
        finally:
            os.close(root)
        try:
            return _host.dir_listing(dev)
        finally:
            os.close(dev)

    def _spare(self, present: set[int]) -> set[int]:
        """The zygote's spare child (forked, or being forked), if that is the only other process
        in the sandbox and no run has run since the last sweep that left nothing: then only the
        zygote can have forked it, for itself, and it never ran code of a run (``verify`` checks
        it as it checks the zygote)."""
        extra = present - self.keep if self._swept else set()
        if len(extra) != 1:
            return set()
        pid = next(iter(extra))
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return set()
        return {pid} if fields[0] in ("R", "S", "D") and fields[1] == str(self.host_pid) else set()

    def _own(self, argv: list[str], *, restart: bool = True) -> Captured:
        """A run of the executor's own (30 s at most), not of a user: ``argv`` is trusted."""
        if not restart and not self.alive:
            raise SandboxError("the warm executor died as it started")
        return self.run(
            argv, env=self.env, cwd="/", cpu=self._cpu, stdin=None, timeout=30, max_bytes=65536,
            own=True,
        )  # fmt: skip

    def _prefork(self) -> None:
        """Ask for a spare child now that the sandbox holds nothing but the zygote."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.send(b"S", socket.MSG_DONTWAIT)

    def state(self) -> str:
        """The zygote's state letter from ``/proc`` (``R``, ``S``, ``T``...; ``X`` when gone)."""
        try:
            return Path(f"/proc/{self.host_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "X"

    def _inherited(self, status: str | None = None) -> dict[str, str]:
        """What every run forked by the zygote inherits from it and a run of the same uid could
        change through its pid (``prlimit``, ``setpriority``, ``sched_setaffinity``,
        ``sched_setscheduler``): rlimits, nice, CPU affinity, scheduling policy."""
        try:
            stat = _proc(self.host_pid, "stat").rsplit(")", 1)[1].split()
            limits = _proc(self.host_pid, "limits")
            status = _proc(self.host_pid, "status") if status is None else status
        except (OSError, IndexError):
            return {}
        cpus = next(
            (line for line in status.splitlines() if line.startswith("Cpus_allowed_list:")), ""
        )
        return {"limits": limits, "nice": stat[16], "policy": stat[38], "cpus": cpus}

    def verify(self) -> str | None:
        """Why the processes a reset spares (the zygote, its launcher and its spare child) cannot
        be trusted with the next user (None if they can). The zygote must be under a seccomp
        filter where this host has one."""
        if not self.alive or not self.host_pid:
            return "the executor is not running"
        present = self._cgroup.pids()
        spare = self._spare(present)  # (one asked for earlier may have been forked by now)
        seccomp = _seccomp.program() is not None
        if present != self.keep | spare:
            survivors = sorted(present - self.keep - spare)
            return f"processes other than the executor survived the sweep: {survivors}"
        zygote_status = ""
        for pid in self.keep | spare:
            try:
                text = _proc(pid, "status")
            except OSError:
                return f"spared process {pid} is gone"
            status = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
            if status.get("TracerPid", "0").strip() != "0":
                return f"spared process {pid} is being traced by {status['TracerPid'].strip()}"
            if status.get("State", "").strip()[:1] in ("T", "t", "Z"):
                return f"spared process {pid} is {status['State'].strip()}"
            if pid == self.host_pid:
                zygote_status = text
                if seccomp and status.get("Seccomp", "0").strip() != "2":
                    return "the executor runs without its seccomp filter"
        inherited = self._inherited(zygote_status)
        changed = [k for k, v in inherited.items() if self._baseline.get(k) != v]
        # e.g. a run lowered its rlimits or CPU share: every later run would inherit them
        if changed:
            return f"a run changed what the executor passes to later runs: {', '.join(changed)}"
        return None

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
            self.proc = None
        if self._proc_fd is not None:
            os.close(self._proc_fd)
            self._proc_fd = None
        self.host_pid = 0
        self.keep = set()
        self._swept = False

    def _drain(self, sock: socket.socket) -> None:
        """Before a run: a reply nobody asked for means a zygote that lies; stop it."""
        try:
            sock.recvmsg(_REPLY.size + 1, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            pass
        self.stop()

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        cpu: int,
        stdin: bytes | None,
        timeout: float,
        max_bytes: int,
        own: bool = False,
    ) -> Captured:
        """Run ``argv`` (forked and exec'd, or forked and run in place: ``in_process``) with the
        host's deadline and output cap. ``own``: a run of the executor's own, not of a user."""
        if self.sock is not None:
            self._drain(self.sock)
        if not self.alive:
            self.stop()
            self.start()
        sock = self.sock
        if sock is None:
            raise SandboxError("the warm executor has no control socket; it failed to start")
        kind = "python" if in_process(argv, env, self.env) else "exec"
        request = {"mode": kind, "argv": argv, "env": env, "cwd": cwd, "cpu": cpu}
        started = time.monotonic()
        fds = [_seccomp.memfd("envhub-run", json.dumps(request).encode())]
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if not own:
            self._swept = False  # code of a run is about to run
        try:
            socket.send_fds(sock, [b"R"], [in_r, out_w, err_w, fds[0]])
        except OSError as e:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w, fds[0]):
                os.close(fd)
            self.stop()
            raise SandboxError(
                f"the warm executor is gone ({e}); the next run starts a new one"
            ) from e
        for fd in (in_r, out_w, err_w, fds[0]):
            os.close(fd)
        state: dict[str, int] = {}
        keep = set(self.keep)

        def on_control() -> bool:
            try:
                reply = _parse(sock)
            except TimeoutError:
                state["stalled"] = 1
                return False
            except (OSError, _ProtocolError):
                reply = None
            if reply is None:  # EOF or a lie: the zygote is gone or untrusted; sweep, replace it
                state.update(exit=137, lost=1)
                self._kill_others(set())
                return True
            if reply[0] == b"F":  # it could not fork: the run never started
                state.update(exit=126, lost=1, errno=reply[1])
                return True
            state["exit"] = reply[1]
            # leftovers of the run die with it, like a PID namespace
            swept = self._kill_others(keep)
            if not own:  # the executor's own runs ask for the spare when they are done
                self._swept = swept
                self._prefork()
            return True

        try:
            cap = pump(
                in_w,
                out_r,
                err_r,
                stdin=stdin,
                timeout=timeout,
                max_bytes=max_bytes,
                kill=lambda: self._kill_others(keep),
                started=started,
                control_fd=sock.fileno(),
                on_control=on_control,
            )
            killed = cap.timed_out or cap.truncated
            waited_after_kill = 0.0
            while "exit" not in state:  # pipes closed, but the program may still run
                left = started + timeout - time.monotonic()
                if left <= 0 and not killed:
                    cap.timed_out = killed = True
                    self._kill_others(keep)
                sock.settimeout(_POLL_S)
                if on_control():
                    break
                if not state.pop("stalled", 0):
                    continue
                if self.state() in ("T", "t", "Z", "X"):  # stopped or dead: it will never answer
                    state.update(exit=137, lost=1)
                    self._kill_others(set())
                elif killed:
                    waited_after_kill += _POLL_S
                    if waited_after_kill >= 2.0:  # killed, yet no exit status: assume it is lost
                        state.update(exit=137, lost=1)
                        self._kill_others(set())
        except (OSError, ValueError) as e:
            self.stop()
            raise SandboxError(f"the warm executor failed mid-run: {e}") from e
        finally:
            if self.sock is not None:
                self.sock.settimeout(None)
            for fd in (out_r, err_r):
                os.close(fd)
        note = ""
        if "errno" in state:
            why = os.strerror(state["errno"])
            note = f"envhub: the sandbox could not start this run: fork: {why}\n"
        elif state.get("lost"):
            note = _LOST
        if note:  # on a line of its own after whatever the run printed
            cap.stderr += (b"\n" if cap.stderr[-1:] not in (b"", b"\n") else b"") + note.encode()
        if state.get("lost") or not self.alive:
            self.stop()
        cap.returncode = state.get("exit", 137)
        cap.wall_time_s = time.monotonic() - started
        return cap
