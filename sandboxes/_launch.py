"""How a local sandbox starts a process: the launcher around ``bwrap`` or ``unshare``.

Every process of a local sandbox (a one-shot run, a session's interpreter, the warm executor)
is started by :meth:`Launcher.popen` as::

    sh -c 'join cgroups; set rlimits; exec "$@"' envhub-launch ISOLATION... COMMAND...

where ``ISOLATION`` is the argv of ``_isolation.bwrap_argv`` or ``_isolation.unshare_argv``.

What it guarantees (``LocalSandbox`` and its tests rely on each):

1. **No Python runs in the child** between the fork and the isolation tool; the shell steps
   are the only code that runs outside the namespaces.
2. **Limits before the command**: the process sets RLIMIT_CPU (unless ``cpu_limit=False``),
   RLIMIT_FSIZE, RLIMIT_CORE, RLIMIT_NOFILE, RLIMIT_AS (when memory is not capped by a cgroup)
   and RLIMIT_NPROC before isolation, or exits with status 125 without running the command.
   Cgroups: under ``unshare`` the launcher joins them first (or exits 125); bwrap's sandbox
   process (its PID 1, a shell) reads a ``go`` line on its stdin before it runs the command,
   which :meth:`Launcher.popen` writes only once it has moved that process into them; it is
   killed if that fails, and end of file (its owner died) makes it exit 125 without running
   the command. Either way there is never a run with fewer limits than asked for. (Its
   cgroup namespace is made at bwrap's clone: ``/proc/self/cgroup`` inside shows ``/`` when the
   monitor was moved before it cloned, as usual, else the path below the owner's cgroup, e.g.
   ``/envhub-ID/run``; neither lets it write anything.)
   (bwrap gets RLIMIT_NPROC plus two, for its monitor and its init or the executor; under
   ``unshare`` it is set for the sandbox uid only, after the root setup.) Why bwrap's move is
   done from outside: a cgroup v1 move waits for an RCU grace period (5-8 ms here when no
   other move happened in the last few ms), which then overlaps bwrap's mount setup instead
   of preceding it.
3. **Environment**: the child gets exactly ``env``, never the host's (plus the sandbox's
   host directory for the ``unshare`` script, which unsets it before the command runs).
4. **File descriptors**: the child inherits its three pipes, ``pass_fds`` and, for bwrap, the
   fds it reads (the scratch and ``/etc`` directories, the seccomp program, the cgroup gate's
   pipes); the parent closes the latter whether or not the spawn succeeds.
5. **Killable as a whole**: the child leads a new process group, so :func:`kill_tree` reaches
   what it forked even where no cgroup sweeps (not root).
6. **Privileges**: with a leased uid (root), bwrap itself runs as the sandbox uid with no
   supplementary groups (the launcher ``exec``s ``setpriv`` to drop to it right before bwrap);
   ``unshare`` starts as root and ``setpriv`` drops to that uid inside.
7. **No fork of the caller**: the child is spawned with ``vfork`` (no ``user=``/``group=`` for
   ``Popen``, which would make it ``fork``): a fork copies the caller's page tables, and a
   trainer or hub process of a few GiB paid 45-135 ms per launch for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import select
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from sandboxes import _host, _seccomp
from sandboxes._etc_view import etc_view
from sandboxes._isolation import (
    GATE_INIT,
    GO,
    UNSHARE_DIR_ENV,
    LaunchFds,
    bwrap_argv,
    etc_mount_points,
    unshare_argv,
)
from sandboxes.base import Limits

__all__ = ["Launcher", "cpu_seconds", "etc_files", "kill_tree", "launch_uid"]


def launch_uid(isolation: str, uid: int) -> int:
    """The uid the launcher runs as (bwrap as the sandbox uid; ``unshare`` as root): the uid
    that must be able to join the sandbox's cgroups."""
    return uid if isolation == "bwrap" else 0


def cpu_seconds(limits: Limits) -> int:
    """RLIMIT_CPU for ``limits``, in whole seconds (at least one)."""
    return max(1, math.ceil(limits.cpu_time_s))


def etc_files(isolation: str, uid: int) -> dict[str, bytes]:
    """The ``/etc/passwd`` and ``/etc/group`` a sandbox sees: root, the sandbox user, nobody.

    bwrap maps the sandbox uid to 1000 inside its user namespace; ``unshare`` keeps ``uid``.
    """
    inside = 1000 if isolation == "bwrap" else uid
    return {
        "passwd": (
            "root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"sandbox:x:{inside}:{inside}:sandbox:/sandbox:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ).encode(),
        "group": f"root:x:0:\nsandbox:x:{inside}:\nnogroup:x:65534:\n".encode(),
    }


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` (None where it is missing: then ``Popen`` drops the uid)."""
    return shutil.which("setpriv")


def kill_tree(pid: int, cgroup: _host.Cgroup | None) -> None:
    """SIGKILL the process group that launched process ``pid`` leads (guarantee 5), then every
    process left in ``cgroup`` (if any)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if cgroup is not None:
        cgroup.kill_all()


@dataclasses.dataclass(frozen=True)
class Launcher:
    """How one started local sandbox launches its processes (``LocalSandbox._start`` builds it).

    ``home`` is the sandbox's host directory: ``unshare``'s script reads ``root/``, ``etc/``
    and ``scratch/`` from it; bwrap reads ``scratch`` and ``etc`` through fds instead.
    """

    isolation: str
    """``"bwrap"`` or ``"unshare"`` (already probed: see ``local.local_isolation``)."""
    uid: int
    """The sandbox uid: a leased private uid as root, else the caller's."""
    leased: bool
    """Whether ``uid`` is a private lease (then bwrap runs as it, see guarantee 6)."""
    limits: Limits
    ro_binds: tuple[str, ...]
    memory_cgroup: bool
    """Memory is capped by the sandbox's cgroup; else each process gets RLIMIT_AS."""
    home: Path
    scratch: Path
    etc: Mapping[str, bytes]
    """``etc_files(isolation, uid)``."""

    def popen(
        self,
        command: list[str],
        env: dict[str, str],
        cgroup: _host.Cgroup | None,
        *,
        pass_fds: tuple[int, ...] = (),
        cpu_limit: bool = True,
        as_pid_1: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` in the sandbox, in ``cgroup``, with piped stdin/stdout/stderr.

        ``cpu_limit=False`` and ``as_pid_1=True`` are for the warm executor, which sets
        RLIMIT_CPU in each run's child and is PID 1 of its namespaces (see ``_executor.py``).
        Raises ``OSError`` when the launcher cannot be started.
        """
        fds = self._open_fds()
        # without setpriv (guarantee 7 lost, not 6): Popen drops the uid, in a fork
        drop = self._drops_uid and _setpriv() is None
        gate: _CgroupGate | None = None
        try:
            if cgroup is not None and fds is not None:
                gate = _CgroupGate()
            argv = self.argv(
                command, cgroup, fds, cpu_limit=cpu_limit, as_pid_1=as_pid_1, gate=gate
            )
            if fds is None:
                env = {**env, UNSHARE_DIR_ENV: str(self.home)}
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd="/",
                close_fds=True,
                pass_fds=pass_fds + (fds.all() if fds else ()) + (gate.child_fds if gate else ()),
                process_group=0,
                user=self.uid if drop else None,
                group=self.uid if drop else None,
                extra_groups=[] if drop else None,
            )
        except BaseException:
            if gate is not None:
                gate.close()
            raise
        finally:
            for fd in (fds.all() if fds else ()) + (gate.child_fds if gate else ()):
                os.close(fd)
        if gate is not None and cgroup is not None:
            gate.admit(proc, cgroup)
        return proc

    def argv(
        self,
        command: list[str],
        cgroup: _host.Cgroup | None,
        fds: LaunchFds | None,
        *,
        cpu_limit: bool = True,
        as_pid_1: bool = False,
        gate: _CgroupGate | None = None,
    ) -> list[str]:
        """``sh -c 'join cgroups; set rlimits; exec ISOLATION COMMAND'`` (guarantees 1 and 2);
        with a ``gate``, bwrap's process is moved into ``cgroup`` from outside instead."""
        lim = self.limits
        steps = [
            f"echo $$ > {shlex.quote(f)} || exit 125"
            for f in (cgroup.procs_files if cgroup and gate is None else [])
        ]
        if cpu_limit:
            cpu = cpu_seconds(lim)
            steps.append(f"ulimit -S -t {cpu} && ulimit -H -t {cpu + 1} || exit 125")
        steps.append(
            f"ulimit -f {lim.max_file_size_mb * 2048} && ulimit -c 0 && ulimit -n 1024 || exit 125"
        )
        if not self.memory_cgroup:
            steps.append(f"ulimit -v {lim.memory_mb * 1024} || exit 125")
        if self.isolation == "bwrap" and fds is not None:
            # bwrap's monitor and init/executor count too
            steps.append(f"ulimit -p {lim.max_processes + 2} || exit 125")
            isolation = bwrap_argv(
                fds=fds,
                tmp_mb=lim.place_mb,
                network=lim.network,
                userns=True,
                ro_binds=self.ro_binds,
                as_pid_1=as_pid_1,
                gated=gate is not None,
            )
            if gate is not None:
                isolation[1:1] = gate.bwrap_options
                command = [*GATE_INIT, *command] if as_pid_1 else command
        else:  # unshare: RLIMIT_NPROC is set for the sandbox uid only, after the root setup
            isolation = unshare_argv(
                tmp_mb=lim.place_mb,
                network=lim.network,
                uid=self.uid,
                ro_binds=self.ro_binds,
                seccomp=_seccomp.program(),
                as_pid_1=as_pid_1,
            )
            command = [
                "/bin/sh",
                "-c",
                f'ulimit -p {lim.max_processes} && exec "$@"',
                "sh",
                *command,
            ]
        setpriv = _setpriv() if self._drops_uid else None
        if setpriv is not None:  # guarantee 6, with no fork of the caller (guarantee 7)
            uid = str(self.uid)
            drop = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
            isolation = [*drop, *isolation]
        return [
            "/bin/sh",
            "-c",
            "; ".join(steps) + '; exec "$@"',
            "envhub-launch",
            *isolation,
            *command,
        ]

    @property
    def _drops_uid(self) -> bool:
        """bwrap runs as the leased uid (guarantee 6); the launcher starts as the caller (root)."""
        return self.leased and self.isolation == "bwrap"

    def _open_fds(self) -> LaunchFds | None:
        """The fds a bwrap launch reads (scratch, passwd, group, seccomp); None for unshare."""
        if self.isolation != "bwrap":
            return None
        opened: list[int] = []
        try:
            for path in (self.scratch, self._etc_view()):
                opened.append(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            program = _seccomp.program()
            if program is not None:
                opened.append(_seccomp.memfd("envhub-seccomp", program))
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        return LaunchFds(
            scratch=opened[0], etc=opened[1], seccomp=opened[2] if len(opened) > 2 else None
        )

    def _etc_view(self) -> Path:
        return etc_view(
            generated=self.etc,
            base_dir=str(self.home.parent),
            mount_points=etc_mount_points(self.limits.network, self.ro_binds),
        )


class _CgroupGate:
    """Moves bwrap's sandbox process into its cgroups while bwrap sets up its mounts.

    bwrap writes its child's pid to ``--info-fd`` right after the clone; the child's PID 1
    shell (``_isolation.GATE_INIT``) reads one line on its stdin before the command. :meth:`admit`
    moves the monitor (as soon as it is spawned: a cgroup move's grace period then passes while
    it execs its way to bwrap, and the child is usually born in the cgroups) and the child,
    then writes ``go``. On any failure it kills the launch; if its process dies instead, the
    shell reads end of file and exits 125 without running the command.
    """

    TIMEOUT_S = 30.0
    """How long bwrap may take to report its child (a few ms normally)."""

    def __init__(self) -> None:
        self._info_r, info_w = os.pipe2(os.O_CLOEXEC)
        self.child_fds = (info_w,)
        """The child's end: passed to the launch, closed by the caller right after it."""
        self.bwrap_options = ["--info-fd", str(info_w)]

    def admit(self, proc: subprocess.Popen[bytes], cgroup: _host.Cgroup) -> None:
        """Move bwrap's monitor and child into ``cgroup`` and let the child run its command.

        Raises ``OSError`` (the launch killed) when the move fails or bwrap never reports.
        """
        pidfd: int | None = None
        try:
            if not self._move(proc.pid, cgroup):
                return self._let_fail(proc, None)  # the launcher already exited
            child = self._child_pid(proc)
            if child is not None:
                with contextlib.suppress(ProcessLookupError):
                    pidfd = os.pidfd_open(child)
                if pidfd is not None and _parent_pid(child) != proc.pid:  # gone, pid reused
                    os.close(pidfd)
                    pidfd = None
            if child is not None and pidfd is not None and self._move(child, cgroup):
                if proc.stdin is not None:  # (always a pipe: without, it reads end of file)
                    with contextlib.suppress(BrokenPipeError):  # it died in its setup meanwhile
                        os.write(proc.stdin.fileno(), GO)
                return None
            return self._let_fail(proc, pidfd)
        except BaseException:
            _kill_launch(proc, pidfd)
            raise
        finally:
            if pidfd is not None:
                os.close(pidfd)
            self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._info_r)

    @staticmethod
    def _let_fail(proc: subprocess.Popen[bytes], pidfd: int | None) -> None:
        """No child to let go (bwrap failed before or during its setup): bwrap exits on its own
        with its message; kill it if it does not."""
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            _kill_launch(proc, pidfd)

    @staticmethod
    def _move(pid: int, cgroup: _host.Cgroup) -> bool:
        """Move ``pid`` into ``cgroup``; False when it died meanwhile (bwrap's child in its
        setup: bwrap reports why and exits)."""
        for path in cgroup.procs_files:
            try:
                with open(path, "w") as f:
                    f.write(str(pid))
            except ProcessLookupError:
                return False
            except OSError as e:
                raise OSError(
                    e.errno, f"could not move the sandbox into its cgroup {path}: {e}"
                ) from e
        return True

    def _child_pid(self, proc: subprocess.Popen[bytes]) -> int | None:
        """The pid bwrap reports on ``--info-fd``; None when it exits without one. Read up to
        the end of the report, not of the pipe: a process forked meanwhile (in another
        thread) may hold the pipe's other end open."""
        data = b""
        deadline = time.monotonic() + self.TIMEOUT_S
        poller = select.poll()  # not select(): fds past 1024 in a hub or trainer process
        poller.register(self._info_r, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(min(left, 0.5) * 1000):
                if left > 0 and proc.poll() is None:
                    continue
                if proc.poll() is not None and not data:
                    return None  # exited without a report
                raise OSError(f"bwrap did not start its sandbox within {self.TIMEOUT_S:.0f} s")
            chunk = os.read(self._info_r, 4096)
            if not chunk:
                break
            data += chunk
            if data.rstrip().endswith(b"}"):
                break
        if not data:
            return None
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError, TypeError) as e:
            raise OSError(f"bwrap reported {data[:200]!r} on --info-fd: {e}") from e


def _parent_pid(pid: int) -> int | None:
    """``pid``'s parent, None when it is gone (read before moving a pid into a cgroup: a pid
    that died and was reused must not be moved)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[1])


def _kill_launch(proc: subprocess.Popen[bytes], pidfd: int | None) -> None:
    """SIGKILL a launch that was not let go, and wait for it: the launcher's process group
    (bwrap's monitor) and bwrap's child (``pidfd``; it leaves the group with
    ``--new-session``); closing its stdin first, so a child the signal misses reads end of
    file instead of ``go``."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if pidfd is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    proc.wait()
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.poll(5000)
