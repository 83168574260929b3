"""The warm executor: one long-lived process inside a local sandbox that forks each run.

Why: a fresh bubblewrap per run costs a user, PID, mount and network namespace each time
(~10 ms on an idle 2-core VM, far more under load). A pooled sandbox instead starts, once,
a small Python executor *inside* its namespaces; a run is then one fork+exec there.

Protocol (a SOCK_SEQPACKET socketpair): the host sends ``{"argv", "env", "cwd", "cpu"}`` with
the run's stdin/stdout/stderr pipe ends attached (SCM_RIGHTS); the executor forks, the child
lowers RLIMIT_CPU, restores default signal dispositions, and execs; the executor answers
``{"pid"}`` then ``{"exit": status}`` (128+N for signal N).

Containment does not depend on the executor's good behaviour: runs live in the sandbox's
``run`` cgroup, and after every run (or on timeout) the host SIGKILLs every process there
except the executor. Nothing the sandboxed code can reach outlives a run:

- the executor is **PID 1** of the sandbox's PID namespace (``bwrap --as-pid-1``, or exec'd in
  place of the ``unshare`` script), so there is no bubblewrap init for the code to attach to,
  and signals it has no handler for (SIGKILL, SIGSTOP, SIGTERM...) sent from inside are
  ignored by the kernel; it reaps the run's orphans;
- it is **non-dumpable** (``PR_SET_DUMPABLE=0``): the sandboxed code, same uid, can neither
  ptrace it nor open its ``/proc/PID/mem``; the seccomp filter (``_seccomp.py``) denies
  ``ptrace`` and ``process_vm_*`` outright;
- the OOM killer never picks it.

On ``reset()``, ``clean()`` sweeps the cgroup, empties every writable place and SysV IPC from
inside, and checks that ``/dev`` is as it was; ``verify()`` checks what it spares (nothing but
the executor and its launcher left in the cgroup, neither traced nor stopped, the executor still
under its seccomp filter, and what its runs inherit from it — rlimits, nice, CPU affinity,
scheduling policy, which a run of the same uid can change through ``prlimit``/``setpriority``/
``sched_*`` — as it was at start); the sandbox starts a fresh executor, in fresh namespaces,
when either fails. If the executor dies or is stopped anyway, the host notices (socket EOF, or
its state in ``/proc``), reports the run as killed rather than timed out, and the next run
starts a new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from sandboxes import _seccomp
from sandboxes._host import Cgroup
from sandboxes._proc import Captured, pump
from sandboxes.errors import SandboxError

__all__ = ["DEV_CHECK", "EXECUTOR_SOURCE", "WarmExecutor"]

_POLL_S = 0.05
"""How often a run that closed its pipes checks that the executor can still answer."""
DEV_CHECK = (
    "ls -lAn /dev | sed 1d; stat -c '%n %F %t:%T %a %u' /dev/null /dev/zero /dev/full /dev/urandom"
)
"""What ``/dev`` looks like; ``clean()`` fails (the sandbox starts over) when it changed."""

EXECUTOR_SOURCE = r"""
import ctypes, json, os, resource, signal, socket, sys
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: no ptrace, no /proc/pid/mem
sock = socket.socket(fileno=int(sys.argv[1]))
def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
RESET = [signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
         signal.SIGHUP]
while True:
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
    except OSError:
        break
    if not msg:
        break
    req = json.loads(msg)
    reap()
    pid = os.fork()
    if pid == 0:
        try:
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
            os.closerange(3, 65536)
            for s in RESET:
                signal.signal(s, signal.SIG_DFL)
            cpu = req["cpu"]
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            os.chdir(req["cwd"])
            os.execvpe(req["argv"][0], req["argv"], req["env"])
        except BaseException as e:
            try:
                os.write(2, ("envhub: cannot run %r: %s\n" % (req["argv"][0], e)).encode())
            finally:
                os._exit(127)
    for fd in fds:
        os.close(fd)
    sock.send(json.dumps({"pid": pid}).encode())
    while True:  # as PID 1 we also reap the run's orphans (zombies would count against pids.max)
        done, status = os.waitpid(-1, 0)
        if done == pid:
            break
    code = os.waitstatus_to_exitcode(status)
    sock.send(json.dumps({"exit": 128 - code if code < 0 else code}).encode())
"""


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


class WarmExecutor:
    """Host side of one executor, in ``cgroup`` (the sandbox's run cgroup, which it sweeps).

    ``spawn(argv, pass_fd)`` must start ``argv`` in the sandbox, inheriting ``pass_fd``, inside
    ``cgroup``. ``env`` and ``cpu`` (RLIMIT_CPU) are what the executor's own checks run with.
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
        self._env, self._cpu = env, cpu
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.host_pid = 0
        self.spare: set[int] = set()
        self._baseline: dict[str, str] = {}
        self._dev = b""

    def _kill_others(self, exclude: set[int]) -> None:
        """SIGKILL every process of the cgroup but ``exclude``. Whatever it could not kill stays
        there, where ``verify()`` finds it: ``clean()`` then fails and the sandbox starts over."""
        self._cgroup.kill_all(exclude=exclude)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.sock is not None

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = self._spawn(
                ["python3", "-I", "-S", "-c", EXECUTOR_SOURCE, str(theirs.fileno())],
                theirs.fileno(),
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
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.host_pid}/oom_score_adj").write_text("-1000")
        self._baseline = self._inherited()
        self.spare = {self.host_pid}  # and its ancestors up to the launcher (bwrap, its init...)
        pid = self.host_pid
        while pid != self.proc.pid and pid > 1:
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
            self.spare.add(pid)
        try:  # the first look at /dev, in fresh namespaces, is what clean() compares with
            self._dev = self._check(DEV_CHECK, max_bytes=65536, restart=False).stdout
        except BaseException:
            self.stop()
            raise

    def clean(self, writable: Sequence[str]) -> bool:
        """Make the sandbox fit for its next user without new namespaces: sweep every process but
        the executor, empty ``writable`` (every place a run can write) and SysV IPC, check that
        ``/dev`` looks as it did at the start, and ``verify()`` what was spared. False if anything
        is left or untrustworthy (a directory made undeletable, a traced executor...): the
        caller then starts over in fresh namespaces."""
        if not self.alive:
            return False
        if not self._cgroup.kill_all(exclude=self.spare, timeout=1.0) or self.verify():
            return False
        dirs = shlex.join(writable)  # ipcrm: SysV IPC, where seccomp is off
        script = (
            f"find {dirs} -mindepth 1 -delete 2>/dev/null; ipcrm -a 2>/dev/null; "
            f"find {dirs} -mindepth 1 2>/dev/null | head -n 1; {DEV_CHECK}"
        )
        try:
            cap = self._check(script, max_bytes=4096)
        except SandboxError:
            return False
        # /dev is read-only inside, but a tampered /dev/null must never reach the next user
        if cap.returncode != 0 or cap.timed_out or cap.stdout != self._dev:
            return False
        return self.verify() is None

    def _check(self, script: str, *, max_bytes: int, restart: bool = True) -> Captured:
        """Run the executor's own ``sh -c script`` (30 s at most)."""
        if not restart and not self.alive:
            raise SandboxError("the warm executor died as it started")
        return self.run(
            ["/bin/sh", "-c", script],
            env=self._env,
            cwd="/",
            cpu=self._cpu,
            stdin=None,
            timeout=30,
            max_bytes=max_bytes,
        )

    def state(self) -> str:
        """The executor's state letter from ``/proc`` (``R``, ``S``, ``T``...; ``X`` when gone)."""
        try:
            return Path(f"/proc/{self.host_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "X"

    def _inherited(self) -> dict[str, str]:
        """What every run forked by the executor inherits from it and a run of the same uid could
        change through its pid (``prlimit``, ``setpriority``, ``sched_setaffinity``,
        ``sched_setscheduler``): rlimits, nice, CPU affinity, scheduling policy."""
        try:
            stat = Path(f"/proc/{self.host_pid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{self.host_pid}/status").read_text()
            limits = Path(f"/proc/{self.host_pid}/limits").read_text()
        except (OSError, IndexError):
            return {}
        cpus = next(
            (line for line in status.splitlines() if line.startswith("Cpus_allowed_list:")), ""
        )
        return {"limits": limits, "nice": stat[16], "policy": stat[38], "cpus": cpus}

    def verify(self) -> str | None:
        """Why the processes a reset spares cannot be trusted with the next user (None if they
        can). The executor must be under a seccomp filter where this host has one."""
        if not self.alive or not self.host_pid:
            return "the executor is not running"
        present = self._cgroup.pids()
        seccomp = _seccomp.program() is not None
        if present != self.spare:
            survivors = sorted(present - self.spare)
            return f"processes other than the executor survived the sweep: {survivors}"
        for pid in self.spare:
            try:
                status = dict(
                    line.split(":\t", 1)
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if ":\t" in line
                )
            except OSError:
                return f"spared process {pid} is gone"
            if status.get("TracerPid", "0").strip() != "0":
                return f"spared process {pid} is being traced by {status['TracerPid'].strip()}"
            if status.get("State", "").strip()[:1] in ("T", "t", "Z"):
                return f"spared process {pid} is {status['State'].strip()}"
            if pid == self.host_pid and seccomp and status.get("Seccomp", "0").strip() != "2":
                return "the executor runs without its seccomp filter"
        changed = [k for k, v in self._inherited().items() if self._baseline.get(k) != v]
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
        self.host_pid = 0
        self.spare = set()

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
    ) -> Captured:
        if not self.alive:
            self.stop()
            self.start()
        sock = self.sock
        if sock is None:
            raise SandboxError("the warm executor has no control socket; it failed to start")
        started = time.monotonic()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            socket.send_fds(
                sock,
                [json.dumps({"argv": argv, "env": env, "cwd": cwd, "cpu": cpu}).encode()],
                [in_r, out_w, err_w],
            )
        except OSError as e:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            self.stop()
            raise SandboxError(
                f"the warm executor is gone ({e}); the next run starts a new one"
            ) from e
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        state: dict[str, int] = {}
        spare = set(self.spare)

        def on_control() -> bool:
            try:
                msg = sock.recv(4096)
            except TimeoutError:
                state["stalled"] = 1
                return False
            except OSError:
                msg = b""
            if not msg:  # the executor died (killed from inside?): sweep and replace it later
                state.setdefault("exit", 137)
                self._kill_others(set())
                return True
            state.update(json.loads(msg))
            if "exit" in state:
                self._kill_others(spare)  # leftovers of the run die with it, like a PID namespace
                return True
            return False

        try:
            cap = pump(
                in_w,
                out_r,
                err_r,
                stdin=stdin,
                timeout=timeout,
                max_bytes=max_bytes,
                kill=lambda: self._kill_others(spare),
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
                    self._kill_others(spare)
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
                    if waited_after_kill >= 5.0:  # killed, yet no exit status: assume it is gone
                        state["exit"] = 137
                        self._kill_others(set())
        except (OSError, ValueError) as e:
            self.stop()
            raise SandboxError(f"the warm executor failed mid-run: {e}") from e
        finally:
            sock.settimeout(None)
            for fd in (out_r, err_r):
                os.close(fd)
        if state.get("lost") or not self.alive or state.get("exit") is None:
            self.stop()
        cap.returncode = state.get("exit", 137)
        cap.wall_time_s = time.monotonic() - started
        return cap
