"""The warm executor: a fork server (the *zygote*, ``_zygote.py``) inside a local sandbox.

Why: a fresh bubblewrap per run costs a user, PID, mount and network namespace each time, and a
Python run another ~15 ms of interpreter start-up and imports. A warm sandbox instead starts,
once, a small pre-imported Python *inside* its namespaces, and next to it a *spawner*, forked
from it before the pre-imports. A command is then one ``posix_spawn`` by the spawner (a vfork:
nothing of a large address space is copied); ``python3 -I FILE|-c CODE ...`` (``run_code``,
the code envs' test runner) is a fork of the zygote (often done ahead: it keeps a spare child
forked between runs) that runs the code in the forked interpreter itself (see
``_zygote._run_python`` for what that reproduces of a real ``python3 -I``);
``_wire.in_process(argv, env)`` says which.

Protocol: ``_zygote.py``'s docstring; what the host accepts of it: ``_wire.py``. The host treats
both processes, which sandboxed code shares a uid and namespaces with, as hostile: every reply is
one fixed-size message, parsed strictly (anything else ends them); file descriptors they send
are dropped; the spawner's pid comes from the kernel; the wall-time deadline, output caps and the
sweep of the run's processes are the host's, never theirs; what a run asks for (argv, env, code)
reaches the spawner or the forked child through a memfd, never the zygote's memory.

Containment does not depend on their good behaviour: runs live in the sandbox's ``run`` cgroup,
and after every run (or on timeout) the host SIGKILLs every process there except the zygote, the
spawner and the launcher (and the zygote's spare, when no run has run since it was forked or the
run only used the spawner). Nothing the sandboxed code can reach outlives a run, and nothing a
run does reaches the next one:

- every Python run is a **fresh fork** of the zygote, which never runs code of a run itself:
  modules a run imports, globals it sets, threads, signal handlers and open files die with its
  process; a command is a fresh program;
- the zygote is **PID 1** of the sandbox's PID namespace (``bwrap --as-pid-1``, or exec'd in
  place of the ``unshare`` script), so there is no bubblewrap init for the code to attach to,
  and signals it has no handler for (it keeps none) sent from inside are ignored by the kernel;
  it reaps the run's orphans. The spawner is not PID 1: a run can stop or kill it, which costs
  a restart (its state is checked before every command it would start);
- both are **non-dumpable** (``PR_SET_DUMPABLE=0``): the sandboxed code, same uid, can neither
  ptrace them nor open their ``/proc/PID/mem`` or ``/proc/PID/fd``; the seccomp filter
  (``_seccomp.py``) denies ``ptrace`` and ``process_vm_*`` outright;
- a zygote or spawner that dies anyway (the OOM killer may pick it, as any process of the
  sandbox) or breaks the protocol costs a restart: the run is reported as killed (exit 137, a
  note on stderr), and the next run starts both afresh in fresh namespaces.

On ``reset()``, ``clean()`` sweeps the cgroup, empties every writable place from the host,
through the zygote's ``/proc/PID/root`` and following no symlink (and SysV IPC where seccomp
allows it, with ``ipcrm``), and checks that ``/dev`` is as it was; ``verify()`` checks what it
spares (nothing but the zygote, the spawner, the launcher and a spare no run has seen left in
the cgroup, none traced nor stopped, zygote and spawner still under the seccomp filter, and what
runs inherit from them — rlimits, nice, CPU affinity, scheduling policy, which a run of the same
uid can change through ``prlimit``/``setpriority``/``sched_*`` — as it was at start); the
sandbox starts afresh, in fresh namespaces, when either fails.

Not protected: every Python run of one zygote shares its hash seed (``str`` hashes are
randomised per zygote, not per run) and its address-space layout; a run can learn both, which
tells it nothing about another run's data.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

from sandboxes import _host, _seccomp
from sandboxes._host import Cgroup
from sandboxes._proc import Captured, pump
from sandboxes._wire import (
    REQUEST,
    ProtocolError,
    Reply,
    descendants,
    in_process,
    inherited,
    proc,
    proc_stat,
    reply,
    status_fields,
    zygote_source,
)
from sandboxes.errors import SandboxError

__all__ = ["WarmExecutor"]

_POLL_S = 0.05
"""How often a run that closed its pipes checks that the zygote can still answer."""
_LOST = (
    "envhub: the sandbox's process server (zygote) died or misbehaved during this run; "
    "the next run starts a fresh one\n"
)
_RUNNING = ("R", "S", "D")


class WarmExecutor:
    """Host side of one zygote and its spawner, in ``cgroup`` (the sandbox's run cgroup, which
    it sweeps).

    ``spawn(argv, pass_fds)`` must start ``argv`` in the sandbox, inheriting ``pass_fds``, inside
    ``cgroup``. ``env`` and ``cpu`` (RLIMIT_CPU) are what the zygote starts with, its own checks
    run with and every run gets; Python runs whose ``env`` differs from it where interpreter
    start-up reads it are exec'd instead of forked (see ``_wire.in_process``).
    """

    def __init__(
        self,
        spawn: Callable[[list[str], tuple[int, ...]], subprocess.Popen[bytes]],
        cgroup: Cgroup,
        *,
        env: dict[str, str],
        cpu: int,
        writable: Sequence[str] = (),
    ) -> None:
        """``writable``: every place a run can write (emptied, and checked, by ``clean``)."""
        self._spawn, self._cgroup = spawn, cgroup
        self.env, self._cpu, self.writable = env, cpu, tuple(writable)
        self._places: dict[str, _host.DirState] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        """To the zygote: Python runs, spares, commands once the spawner has retired."""
        self.spawner: socket.socket | None = None
        """To the spawner: commands."""
        self.host_pid = 0
        self.spawner_pid = 0
        self.keep: set[int] = set()
        """The zygote, the spawner and the launcher's processes: what every sweep spares."""
        self._baseline: dict[int, dict[str, str]] = {}
        self._dev: _host.DirListing = ()
        self._proc_fd: int | None = None
        self._swept = False
        """No process of a run is left: every one since was forked by the zygote for itself."""
        self._spare_seen = False
        """A run ran (on the spawner) while the zygote's spare was there: it may have touched it."""
        self._retired = False
        """The spawner used up its CPU budget: commands are forked by the zygote until reset."""
        self._python_ran = False
        """A Python run ran since the last reset: the next user is likely to run Python too."""
        self._runs = 0
        """Runs sent so far: each reply must name the run it answers."""

    def _kill_others(self, exclude: set[int]) -> bool:
        """SIGKILL every process of the cgroup but ``exclude``; False if some survived. Whatever it
        could not kill stays there, where ``verify()`` finds it: ``clean()`` then fails and the
        sandbox starts over."""
        return self._cgroup.kill_all(exclude=exclude)

    @property
    def alive(self) -> bool:
        return (
            self.proc is not None
            and self.proc.poll() is None
            and self.sock is not None
            and self.spawner is not None
        )

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        to_spawner, spawner_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        to_spawner.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        ends = (theirs.fileno(), spawner_end.fileno())
        try:
            argv = ["python3", "-I", "-c", zygote_source(), *map(str, ends), str(self._cpu)]
            self.proc = self._spawn(argv, ends)
        except BaseException:
            ours.close()
            to_spawner.close()
            raise
        finally:
            theirs.close()
            spawner_end.close()
        self.sock, self.spawner = ours, to_spawner
        try:
            self._find_processes()
            self._proc_fd = os.open(f"/proc/{self.host_pid}", os.O_RDONLY | os.O_DIRECTORY)
            cap = self._own(["true"])  # the spawner starts a program
            # the first look at /dev and the writable places, in fresh namespaces, is what
            # clean() compares with
            self._dev = self._dev_listing()
            root = self._root()
            try:
                self._places = _host.place_states(root, self.writable)
            finally:
                os.close(root)
        except BaseException:
            self.stop()
            raise
        if cap.returncode != 0 or cap.timed_out:
            err = cap.stderr.decode(errors="replace").strip()
            self.stop()
            raise SandboxError(f"the warm executor failed its first run: {err or 'no reason'}")
        self._swept, self._spare_seen, self._retired = True, False, False

    def _find_processes(self) -> None:
        """The zygote (the first ``python3`` below the launcher), its ancestors up to the
        launcher, and the spawner (the pid the kernel attaches to its hello): ``keep``."""
        if self.proc is None or self.spawner is None:
            raise SandboxError("the warm executor was not launched")
        deadline = time.monotonic() + 30
        while not self.host_pid and time.monotonic() < deadline:
            for pid in descendants(self.proc.pid):
                with contextlib.suppress(OSError):
                    if proc(pid, "comm").strip() == "python3":
                        self.host_pid = pid
                        break
            if self.proc.poll() is not None:
                break
            time.sleep(0.001)
        hello: Reply | None = None
        if self.host_pid:
            self.spawner.settimeout(max(1.0, deadline - time.monotonic()))
            with contextlib.suppress(OSError, ProtocolError):
                hello = reply(self.spawner, credentials=True)
            self.spawner.settimeout(None)
        parent = ""
        if hello is not None and hello[0] == b"H" and hello[2] == 0:
            with contextlib.suppress(OSError):
                parent = proc_stat(hello[3])[1]
        if parent != str(self.host_pid) or hello is None:
            stderr = self.proc.stderr
            exited = self.proc.poll() is not None
            err = stderr.read().decode(errors="replace") if exited and stderr is not None else ""
            raise SandboxError(f"the warm executor did not start: {err.strip() or 'not found'}")
        self.spawner_pid = hello[3]
        self.keep = {self.host_pid, self.spawner_pid}
        pid = self.host_pid
        while pid != self.proc.pid and pid > 1:  # the launcher: bwrap and its monitor
            try:
                pid = int(proc_stat(pid)[1])
            except (OSError, ValueError):
                break
            self.keep.add(pid)
        self._baseline = {pid: inherited(pid) for pid in (self.host_pid, self.spawner_pid)}

    def stop(self) -> None:
        for sock in (self.sock, self.spawner):
            if sock is not None:
                sock.close()
        self.sock = self.spawner = None
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
        self.host_pid = self.spawner_pid = 0
        self.keep = set()
        self._swept = self._retired = False

    # ---- between users -----------------------------------------------------------------------
    def clean(self) -> bool:
        """Make the sandbox fit for its next user without new namespaces: sweep every process but
        the zygote, its spawner (and a spare no run has seen), empty ``writable`` and SysV IPC,
        check that those places themselves (mode, owner, attributes) and ``/dev`` look as they
        did at the start and that no socket is left in the network namespace (internet, or UNIX
        held by no spared process: ``_sockets_left``), and
        ``verify()`` what was spared. False if anything is left or untrustworthy (a directory
        too big to empty, a traced zygote, a spawner that retired...): the caller then starts
        over in fresh namespaces.

        The emptying is done from the host, as root, through ``/proc/PID/root`` of the zygote
        (by a handle on that very process, never a pid that could be reused), following no
        symlink: nothing of what a run left is ever read inside the sandbox."""
        if not self.alive or self._retired:
            return False
        present = self._cgroup.pids()
        spare = set() if self._spare_seen else self._spare(present)
        if present - self.keep - spare:  # what a run left (its own sweep failed)
            if not self._cgroup.kill_all(exclude=self.keep | spare, timeout=1.0):
                return False  # (nothing runs from here on: what runs left is as they left it)
            present = self._cgroup.pids()
        self._spare_seen = False  # it is dead if a run saw it
        if _seccomp.program() is None:  # SysV IPC is not denied: remove what runs made
            try:
                cap = self._own(["ipcrm", "-a"])
            except SandboxError:
                return False
            if cap.returncode != 0 or cap.timed_out:
                return False
            present = self._cgroup.pids()
        try:
            root = self._root()
            try:
                if not _host.empty_places(root, self._places):
                    return False
            finally:
                os.close(root)
            # /dev is read-only inside, but a tampered /dev/null must never reach the next user;
            # a socket left in the network namespace would (a name bound, memory in flight)
            if self._dev_listing() != self._dev or self._sockets_left():
                return False
        except OSError:  # the zygote is gone, or a path was replaced by a symlink
            return False
        # (only the zygote, for itself, could have forked since ``present`` was read)
        if self.verify(present) is not None:
            return False
        self._swept = True
        if self._python_ran:  # a spare for the next user's first Python run, forked now
            self._prefork()
        self._python_ran = False
        return True

    def _sockets_left(self) -> bool:
        """Any internet socket in the namespace, or UNIX socket no spared process holds (one
        in an SCM_RIGHTS cycle outlives its processes until the kernel collects it, at a time
        nothing bounds): fresh namespaces then, where the next user sees none of them."""
        fd = self._fd()
        return bool(_host.inet_sockets(fd) or _host.unix_sockets_left(fd, self._cgroup.pids))

    def _fd(self) -> int:
        if self._proc_fd is None:
            raise OSError(f"no handle on the zygote's /proc directory ({self.host_pid})")
        return self._proc_fd

    def _root(self) -> int:
        """The sandbox's ``/`` (the zygote's root, as the host sees it); the caller closes it."""
        return os.open("root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._fd())

    def _dev_listing(self) -> _host.DirListing:
        root = self._root()
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
        in the sandbox and no process of a run has been left since the last sweep: then only the
        zygote can have forked it, for itself (``verify`` checks it as it checks the zygote)."""
        extra = present - self.keep if self._swept else set()
        if len(extra) != 1:
            return set()
        pid = next(iter(extra))
        try:
            fields = proc_stat(pid)
        except OSError:
            return set()
        return {pid} if fields[0] in _RUNNING and fields[1] == str(self.host_pid) else set()

    def state(self, pid: int = 0) -> str:
        """The state letter of ``pid`` (the zygote's by default) from ``/proc`` (``R``, ``S``,
        ``T``...; ``X`` when gone)."""
        try:
            return proc_stat(pid or self.host_pid)[0]
        except OSError:
            return "X"

    def ready(self, pid: int) -> bool:
        """``pid`` runs and has no signal on its way to it. A run's ``kill()`` returns before its
        target has died or stopped (it must be scheduled first): a process whose state still
        reads ``R`` or ``S`` but has, say, a SIGKILL pending is as good as gone, and a run sent
        to it would be lost."""
        try:
            text = proc(pid, "status")
        except OSError:
            return False
        fields = status_fields(text, ("State", "SigPnd", "ShdPnd"))
        pending = int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)
        return fields.get("State", "X").strip()[:1] in _RUNNING and not pending

    def verify(self, present: set[int] | None = None) -> str | None:
        """Why the processes a reset spares (the zygote, its spawner, its launcher and a spare
        child no run has seen) cannot be trusted with the next user (None if they can). Zygote
        and spawner must be under a seccomp filter where this host has one. ``present``: the
        sandbox's processes, when the caller has just read them with nothing of a run left."""
        if not self.alive or not self.host_pid:
            return "the executor is not running"
        present = self._cgroup.pids() if present is None else present
        spare = set() if self._spare_seen else self._spare(present)
        seccomp = _seccomp.program() is not None
        if present != self.keep | spare:
            survivors = sorted(present - self.keep - spare)
            return f"processes other than the executor survived the sweep: {survivors}"
        for pid in self.keep | spare:
            try:
                text = proc(pid, "status")
            except OSError:
                return f"spared process {pid} is gone"
            status = status_fields(text, ("TracerPid", "State", "Seccomp"))
            if status.get("TracerPid", "0").strip() != "0":
                return f"spared process {pid} is being traced by {status['TracerPid'].strip()}"
            if status.get("State", "").strip()[:1] in ("T", "t", "Z"):
                return f"spared process {pid} is {status['State'].strip()}"
            if pid not in self._baseline:
                continue
            if seccomp and status.get("Seccomp", "0").strip() != "2":
                return f"spared process {pid} runs without its seccomp filter"
            now = inherited(pid, text)
            changed = [k for k, v in self._baseline[pid].items() if now.get(k) != v]
            # e.g. a run lowered its rlimits or CPU share: every later run would inherit them
            if changed:
                return f"{pid} is not as the sandbox started it: {', '.join(changed)} changed"
        return None

    # ---- runs --------------------------------------------------------------------------------
    def _own(self, argv: list[str]) -> Captured:
        """A run of the executor's own (30 s at most), not of a user: ``argv`` is trusted."""
        return self.run(
            argv, env=self.env, cwd="/", cpu=self._cpu, stdin=None, timeout=30, max_bytes=65536,
            own=True,
        )  # fmt: skip

    def _prefork(self) -> None:
        """Ask for a spare child now that the sandbox holds nothing of a run (after a Python run,
        or a reset that followed some: commands, on the spawner, need none)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.send(b"S", socket.MSG_DONTWAIT)

    def _drain(self) -> None:
        """Before a run: a reply nobody asked for means a zygote or spawner that lies; stop."""
        for sock in (self.sock, self.spawner):
            if sock is None:
                continue
            try:
                sock.recvmsg(16, 64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                pass
            self.stop()
            return

    def _route(self, argv: list[str], env: dict[str, str], cpu: int) -> tuple[str, bool]:
        """``(mode, on the spawner)`` for a run; restarts what a run stopped or killed."""
        if not self.alive:
            self.stop()
            self.start()
        if in_process(argv, env, self.env):
            return "python", False
        if self._retired or cpu != self._cpu:
            return "exec", False
        if not self.ready(self.spawner_pid):  # a run stopped or killed it (or is about to)
            self.stop()
            self.start()
        return "exec", True

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
        """Run ``argv`` (spawned, or forked and run in place: ``_wire.in_process``) with the
        host's deadline and output cap. ``own``: a run of the executor's own, not of a user."""
        self._drain()
        mode, on_spawner = self._route(argv, env, cpu)
        sock = self.spawner if on_spawner else self.sock
        if sock is None:
            raise SandboxError("the warm executor has no control socket; it failed to start")
        request = {"mode": mode, "argv": argv, "env": env, "cwd": cwd, "cpu": cpu}
        started = time.monotonic()
        request_fd = _seccomp.memfd("envhub-run", json.dumps(request).encode())
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        # a spare that saw no run is spared by this run's sweep if it only used the spawner
        spare = self._started(self._spare(self._cgroup.pids())) if on_spawner else {}
        if not own:
            self._swept = False  # code of a run is about to run
            self._spare_seen = self._spare_seen or bool(spare)
        try:
            self._runs += 1
            socket.send_fds(
                sock, [REQUEST.pack(b"R", self._runs)], [in_r, out_w, err_w, request_fd]
            )
        except OSError as e:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w, request_fd):
                os.close(fd)
            self.stop()
            raise SandboxError(
                f"the warm executor is gone ({e}); the next run starts a new one"
            ) from e
        for fd in (in_r, out_w, err_w, request_fd):
            os.close(fd)
        state: dict[str, int] = {}
        keep = set(self.keep)
        watched = self.spawner_pid if on_spawner else self.host_pid

        def on_control() -> bool:
            try:
                answer = reply(sock, credentials=on_spawner)
            except TimeoutError:
                state["stalled"] = 1
                return False
            except (OSError, ProtocolError):
                answer = None
            kinds = (b"X", b"Y") if on_spawner else (b"X", b"F")
            if (
                answer is None
                or answer[0] not in kinds
                or answer[2] != self._runs  # an answer to another run: sent twice, or late
                or (on_spawner and answer[3] != watched)
            ):
                state.update(exit=137, lost=1)  # EOF or a lie: sweep everything, start afresh
                self._kill_others(set())
                return True
            kind, value, _, _ = answer
            if kind == b"F":  # it could not fork: the run never started
                state.update(exit=126, lost=1, errno=value)
                return True
            state["exit"] = value
            self._retired = self._retired or kind == b"Y"
            # leftovers of the run die with it, like a PID namespace
            swept = self._kill_others(keep | self._same(spare))
            if not own:  # (the executor's own runs ask for the spare when they are done)
                self._swept = swept
                if not on_spawner:  # the zygote's fork, or its spare, ran it: a new spare
                    self._spare_seen = False
                    self._python_ran = True
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
                if self.state(watched) in ("T", "t", "Z", "X"):  # stopped or dead: no answer
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
            with contextlib.suppress(OSError):
                sock.settimeout(None)
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

    @staticmethod
    def _started(pids: set[int]) -> dict[int, str]:
        """``pid -> start time`` (a pid the kernel reused has another)."""
        found = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                found[pid] = proc_stat(pid)[19]
        return found

    def _same(self, spare: dict[int, str]) -> set[int]:
        """The pids of ``spare`` that are still that very process, the zygote's child."""
        same = set()
        for pid, start in spare.items():
            with contextlib.suppress(OSError):
                fields = proc_stat(pid)
                if fields[19] == start and fields[1] == str(self.host_pid):
                    same.add(pid)
        return same
