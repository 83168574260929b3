"""``local``: the embedded default backend — Linux namespaces, rlimits and cgroups, no daemon.

Each ``run`` starts one process in fresh namespaces (bubblewrap, or ``unshare`` where bwrap
is missing; see ``_isolation.py`` for the exact view of the filesystem). Run as root (as CI
and this project's machines do), a sandbox also gets its own uid, cgroups and a tmpfs scratch.
``warm_exec=True`` (what ``SandboxPool`` uses) keeps one executor process inside the
namespaces instead, and a run is a fork+exec there (``_executor.py``): several times faster,
same limits; runs of one sandbox then share its namespaces and ``/tmp`` until ``reset()``.

Protects against (``LocalSandbox.PROTECTS`` is the same list with the tests that attack each
property; ``envhub sandbox info`` prints it with what is active on this host). Tests are in
``tests/sandboxes/``: ``adv`` = ``test_adversarial.py``, ``reuse`` = ``test_reuse.py``.

- **Infinite loops**: wall-clock deadline per run, then SIGKILL of the whole process tree
  (process group + PID namespace + cgroup sweep); RLIMIT_CPU as a second bound.
  (adv::test_infinite_loop_is_killed_at_the_wall_time_limit,
  adv::test_cpu_time_limit_kills_a_busy_program)
- **Fork bombs**: cgroup ``pids.max`` and RLIMIT_NPROC on a uid no other sandbox uses.
  (adv::test_fork_bomb_is_capped_and_returns_in_bounded_time)
- **Memory bombs**: cgroup ``memory.limit_in_bytes`` for the sandbox (OOM kills are counted
  and reported as ``oom_killed``); RLIMIT_AS per process where cgroups are not writable.
  (adv::test_memory_bomb_is_oom_killed_and_reported)
- **Disk fill**: scratch, ``/tmp`` and ``/dev/shm`` are tmpfs capped at ``disk_mb``; ``/dev``
  itself is read-only; RLIMIT_FSIZE caps each file; POSIX message queues are bounded by
  RLIMIT_MSGQUEUE and SysV IPC is denied (seccomp).
  (adv::test_disk_fill_in_scratch_and_tmp_stops_at_the_cap,
  reuse::test_every_writable_tmpfs_is_capped_at_disk_mb,
  reuse::test_posix_message_queues_hold_at_most_disk_mb,
  reuse::test_sysv_shared_memory_is_capped_at_disk_mb)
- **Output floods**: output is read up to ``max_output_bytes`` per stream, then the run is killed.
  (adv::test_output_flood_is_truncated_and_the_run_stopped)
- **Network egress**: a network namespace with only its own loopback; host loopback services
  and outside addresses are unreachable. (adv::test_network_egress_to_loopback_and_outside_fails)
- **Reading host files**: only ``/usr``, public ``/etc`` files and scratch are visible; the
  project checkout, ``/root``, ``/home`` and ``/etc/shadow`` do not exist inside.
  (adv::test_host_files_are_not_readable)
- **Host paths**: scratch is bound from an fd and ``/etc/passwd`` copied from a memfd, so
  ``/proc/self/mountinfo`` and ``/proc/*/cmdline`` name no host directory.
  (adv::test_no_host_path_shows_in_mounts_or_process_lines)
- **Writing outside scratch**: everything but scratch, ``/tmp`` and ``/dev/shm`` is read-only,
  and the program is an unprivileged uid without capabilities.
  (adv::test_writes_outside_scratch_fail_and_tmp_is_private)
- **Orphans**: a run's PID namespace dies with it (with ``warm_exec``, every process of the
  run's cgroup but the executor is SIGKILLed when the run returns).
  (adv::test_background_processes_do_not_survive_a_timeout,
  reuse::test_a_process_left_behind_is_dead_when_the_run_returns)
- **Signals**: a PID namespace shows only the sandbox's processes; host PIDs cannot be signalled.
  (adv::test_signals_cannot_reach_the_host_and_cannot_stop_the_kill)
- **Tampering with what outlives a run** (the warm executor): it is PID 1 of its namespace and
  non-dumpable, ``ptrace``/``process_vm_*`` are denied by seccomp, and ``reset()`` verifies it
  (not traced, not stopped, still filtered, alone in the cgroup, and the rlimits, nice, CPU
  affinity and scheduling policy its runs inherit unchanged) or starts a fresh one.
  (adv::test_processes_that_outlive_a_run_cannot_be_attached_or_rewritten,
  adv::test_a_run_that_stops_or_kills_everything_it_sees_does_not_break_the_next,
  adv::test_reset_replaces_an_executor_it_cannot_verify,
  adv::test_a_run_cannot_lower_the_limits_or_cpu_share_of_the_next_user)
- **Kernel objects across ``reset()``**: POSIX message queues (a private ``/dev/mqueue``),
  ``/dev/shm`` and ``/tmp`` are emptied, or the namespaces are new; SysV IPC is denied.
  (reuse::test_ipc_objects_do_not_reach_the_next_user,
  reuse::test_files_in_dev_shm_and_tmp_do_not_reach_the_next_user)
- **Keyrings**: ``add_key``/``keyctl``/``request_key`` are denied by seccomp, and ``unshare``
  mode joins a fresh session keyring, so neither the host's session keyring nor a key left on
  the leased uid is reachable. (adv::test_the_host_session_keyring_is_out_of_reach,
  reuse::test_keys_do_not_reach_the_next_user_or_a_later_sandbox,
  reuse::test_keyring_syscalls_are_denied)
- **Env-var leakage**: the program gets ``BASE_ENV`` plus what the caller passes, never the
  host environment. (adv::test_host_environment_does_not_leak)
- **Host file tricks**: ``read_file``/``write_file`` refuse symlinks planted by the program and
  paths the kernel would reject, with ``SandboxFileError``.
  (adv::test_planted_symlinks_do_not_expose_host_files,
  reuse::test_an_over_long_path_raises_sandbox_file_error)

Does NOT protect against: kernel exploits through syscalls the filter allows (it denies a
list, as Docker's default profile does; namespaces widen the kernel surface a little); CPU
starvation of the host beyond one run's CPU limit (no cpu cgroup quota); side channels.
``Limits(network=True)`` shares the host's network namespace: host loopback services and
abstract UNIX sockets are reachable then. A one-shot (not warm) run keeps bubblewrap's init as
its PID 1, which the run can write through ``/proc/1/mem``; it lives only as long as that run
and is swept with its cgroup. Without root: no private uid (RLIMIT_NPROC then counts all of
your processes), no cgroups (so no sweep: that init is only bound by ``--die-with-parent``), no
tmpfs scratch (``disk_mb`` unenforced there; ``max_file_size_mb`` still holds), no
``warm_exec``. Only cgroup v1 controllers are used: on a cgroup-v2-only host the memory cap is
RLIMIT_AS per process, the process cap RLIMIT_NPROC on the private uid, and ``warm_exec``
falls back to a fresh sandbox per run. Without libseccomp there is no syscall filter
(``protections`` says so). ``protections`` lists what is active on this host.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sandboxes import _host, _seccomp
from sandboxes._executor import WarmExecutor
from sandboxes._isolation import UNSHARE_DIR_ENV, LaunchFds, bwrap_argv, probe, unshare_argv
from sandboxes._proc import communicate, exit_status
from sandboxes.base import ExecResult, Limits, Protection, Sandbox, Session, _decode
from sandboxes.errors import SandboxConfigError, SandboxError, SandboxUnavailableError

__all__ = ["LocalSandbox", "collect_stale", "local_isolation"]

_ISOLATIONS = ("auto", "bwrap", "unshare")
_DEV_CHECK = (
    "ls -lAn /dev | sed 1d; stat -c '%n %F %t:%T %a %u' /dev/null /dev/zero /dev/full /dev/urandom"
)
"""What ``/dev`` looks like; a warm sandbox whose /dev changed is restarted on reset."""


def local_isolation(requested: str = "auto") -> str:
    """The isolation ``requested`` resolves to here; raises with the fix when none works."""
    if requested not in _ISOLATIONS:
        raise SandboxConfigError(f"isolation must be one of {_ISOLATIONS}, got {requested!r}")
    probe_uid = _host.UID_BASE - 1 if _host.is_root() else None
    reasons = {}
    for kind in ("bwrap", "unshare") if requested == "auto" else (requested,):
        reason = probe(kind, probe_uid if kind == "bwrap" else None)
        if reason is None:
            return kind
        reasons[kind] = reason
    raise SandboxUnavailableError(
        "the local sandbox cannot isolate processes on this host: "
        + "; ".join(f"{k}: {v}" for k, v in reasons.items())
        + ". Install bubblewrap (apt-get install -y bubblewrap) and allow unprivileged user "
        "namespaces (sysctl kernel.unprivileged_userns_clone=1), or run as root; "
        "or use make_sandbox('docker')."
    )


class LocalSandbox(Sandbox):
    """Namespaces + rlimits + cgroups on this machine. See the module docstring.

    ``isolation``: ``"auto"`` (bwrap, else unshare), ``"bwrap"`` or ``"unshare"``.
    ``ro_binds``: extra host paths to show read-only at the same path (e.g. a virtualenv
    with the packages tests need). ``base_dir``: where per-sandbox host dirs go.
    """

    backend = "local"
    PROTECTS = tuple(
        Protection(name, how, tuple(f"tests/sandboxes/{t}" for t in tests))
        for name, how, tests in (
            (
                "infinite loops",
                "wall-clock deadline, then SIGKILL of the process tree; RLIMIT_CPU",
                (
                    "test_adversarial.py::test_infinite_loop_is_killed_at_the_wall_time_limit",
                    "test_adversarial.py::test_cpu_time_limit_kills_a_busy_program",
                ),
            ),
            (
                "fork bombs",
                "cgroup pids.max + RLIMIT_NPROC on a private uid",
                ("test_adversarial.py::test_fork_bomb_is_capped_and_returns_in_bounded_time",),
            ),
            (
                "memory bombs",
                "cgroup memory limit (OOM reported), else RLIMIT_AS",
                ("test_adversarial.py::test_memory_bomb_is_oom_killed_and_reported",),
            ),
            (
                "disk fill",
                "scratch, /tmp, /dev/shm: tmpfs capped at disk_mb; /dev read-only; RLIMIT_FSIZE",
                (
                    "test_adversarial.py::test_disk_fill_in_scratch_and_tmp_stops_at_the_cap",
                    "test_reuse.py::test_every_writable_tmpfs_is_capped_at_disk_mb",
                    "test_reuse.py::test_posix_message_queues_hold_at_most_disk_mb",
                    "test_reuse.py::test_sysv_shared_memory_is_capped_at_disk_mb",
                ),
            ),
            (
                "output floods",
                "max_output_bytes per stream, then the run is killed",
                ("test_adversarial.py::test_output_flood_is_truncated_and_the_run_stopped",),
            ),
            (
                "network egress",
                "own network namespace with only a loopback",
                ("test_adversarial.py::test_network_egress_to_loopback_and_outside_fails",),
            ),
            (
                "reading host files",
                "only /usr, public /etc files and scratch are visible",
                ("test_adversarial.py::test_host_files_are_not_readable",),
            ),
            (
                "host paths",
                "scratch bound from an fd, /etc/passwd from a memfd",
                ("test_adversarial.py::test_no_host_path_shows_in_mounts_or_process_lines",),
            ),
            (
                "writing outside scratch",
                "read-only mounts, unprivileged uid, no capabilities",
                ("test_adversarial.py::test_writes_outside_scratch_fail_and_tmp_is_private",),
            ),
            (
                "orphans",
                "PID namespace per run; warm: cgroup sweep after every run",
                (
                    "test_adversarial.py::test_background_processes_do_not_survive_a_timeout",
                    "test_reuse.py::test_a_process_left_behind_is_dead_when_the_run_returns",
                ),
            ),
            (
                "signals",
                "PID namespace: host processes are invisible",
                (
                    "test_adversarial.py::test_signals_cannot_reach_the_host_and_cannot_stop_the_kill",
                ),
            ),
            (
                "tampering with what outlives a run",
                (
                    "executor is PID 1 and non-dumpable; seccomp denies ptrace; "
                    "reset() verifies it or starts a fresh one"
                ),
                (
                    "test_adversarial.py::test_processes_that_outlive_a_run_cannot_be_attached_or_rewritten",
                    "test_adversarial.py::test_a_run_that_stops_or_kills_everything_it_sees_does_not_break_the_next",
                    "test_adversarial.py::test_reset_replaces_an_executor_it_cannot_verify",
                    "test_adversarial.py::test_a_run_cannot_lower_the_limits_or_cpu_share_of_the_next_user",
                ),
            ),
            (
                "kernel objects across reset",
                "private /dev/mqueue, /dev/shm and /tmp emptied; SysV IPC denied",
                (
                    "test_reuse.py::test_ipc_objects_do_not_reach_the_next_user",
                    "test_reuse.py::test_files_in_dev_shm_and_tmp_do_not_reach_the_next_user",
                ),
            ),
            (
                "keyrings",
                "seccomp denies the keyring syscalls; unshare mode joins a fresh session keyring",
                (
                    "test_adversarial.py::test_the_host_session_keyring_is_out_of_reach",
                    "test_reuse.py::test_keys_do_not_reach_the_next_user_or_a_later_sandbox",
                    "test_reuse.py::test_keyring_syscalls_are_denied",
                ),
            ),
            (
                "env-var leakage",
                "BASE_ENV plus what the caller passes",
                ("test_adversarial.py::test_host_environment_does_not_leak",),
            ),
            (
                "host file tricks",
                "O_NOFOLLOW *at() access; bad paths raise SandboxFileError",
                (
                    "test_adversarial.py::test_planted_symlinks_do_not_expose_host_files",
                    "test_reuse.py::test_an_over_long_path_raises_sandbox_file_error",
                ),
            ),
        )
    )
    NOT_PROTECTED = (
        (
            "kernel exploits through syscalls the seccomp filter allows "
            "(a deny list, like Docker's default)"
        ),
        (
            "CPU starvation of the host beyond one run's CPU limit (no cpu cgroup quota); "
            "side channels"
        ),
        (
            "with Limits(network=True): host loopback services and abstract UNIX sockets "
            "(host network namespace)"
        ),
        (
            "a one-shot run can write its own bubblewrap init (PID 1) via /proc/1/mem; "
            "it dies with the run"
        ),
        (
            "without root: no private uid, cgroups, tmpfs scratch or warm executor "
            "(see the module docstring)"
        ),
    )

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        isolation: str = "auto",
        ro_binds: Sequence[str] = (),
        base_dir: str | None = None,
        warm_exec: bool = False,
    ) -> None:
        super().__init__(limits=limits)
        if isolation not in _ISOLATIONS:
            raise SandboxConfigError(f"isolation must be one of {_ISOLATIONS}, got {isolation!r}")
        for path in ro_binds:
            if not os.path.isabs(path) or not os.path.exists(path):
                raise SandboxConfigError(
                    f"ro_binds entry {path!r} must be an existing absolute path"
                )
        self.requested_isolation = isolation
        self.ro_binds = tuple(ro_binds)
        self._base_dir = base_dir
        self.isolation = ""
        self.uid = os.getuid()
        self._lease: _host.UidLease | None = None
        self._cgroup: _host.Cgroup | None = None
        self._run_cgroup: _host.Cgroup | None = None
        self._scratch_is_tmpfs = False
        self._session_count = 0
        self.warm_exec = warm_exec
        self._executor: WarmExecutor | None = None
        self._dev_baseline = b""
        self._current: subprocess.Popen[bytes] | None = None
        self._etc: dict[str, bytes] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        self.isolation = local_isolation(self.requested_isolation)
        root = _host.is_root()
        self.dir = Path(tempfile.mkdtemp(prefix=f"envhub-sbx-{self.id}-", dir=self._base_dir))
        try:
            if root:
                self._lease = _host.UidLease()
                self.uid = self._lease.uid
            os.chmod(self.dir, 0o711)  # the sandbox uid must traverse it to reach scratch
            self.scratch = self.dir / "scratch"
            self.scratch.mkdir()
            if root:
                try:
                    _host.mount_tmpfs(
                        self.scratch, size_mb=self.limits.disk_mb, uid=self.uid, gid=self.uid
                    )
                    self._scratch_is_tmpfs = True
                except OSError:
                    os.chown(self.scratch, self.uid, self.uid)
            if not self._scratch_is_tmpfs:
                os.chmod(self.scratch, 0o700)
            (self.dir / "root").mkdir()
            self._write_etc()
            if root and _host.cgroups_available():
                self._cgroup = _host.Cgroup(
                    f"envhub-{self.id}",
                    memory_bytes=self.limits.memory_mb << 20,
                    pids_max=self.limits.max_processes + 4,
                )
                self._run_cgroup = _host.Cgroup(
                    "run", parent=self._cgroup, delegate_uid=self._launch_uid
                )
            (self.dir / "owner.json").write_text(
                json.dumps(
                    {  # lets collect_stale() clean up after a crash
                        "pid": os.getpid(),
                        "uid": self.uid,
                        "leased": self._lease is not None,
                        "cgroups": [
                            str(p) for p in (self._cgroup.dirs.values() if self._cgroup else [])
                        ],
                    }
                )
            )
            if self.warm_exec and self._run_cgroup is not None:
                self._executor = self._new_executor()
        except BaseException:
            self._stop()
            raise

    def _kill_running(self) -> None:
        if self._run_cgroup is not None:
            self._run_cgroup.kill_all(timeout=1.0)
        proc = self._current
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def _new_executor(self) -> WarmExecutor:
        cg = self._run_cgroup
        if cg is None:
            raise SandboxError(
                "the warm executor needs cgroups (run as root where cgroup v1 is writable)"
            )

        def spawn(argv: list[str], pass_fd: int) -> subprocess.Popen[bytes]:
            return self._popen(
                argv, self._env({}), cg, pass_fds=(pass_fd,), cpu_limit=False, as_pid_1=True
            )

        executor = WarmExecutor(spawn, lambda exclude: cg.kill_all(exclude=exclude))
        executor.start()
        baseline = executor.run(
            ["/bin/sh", "-c", _DEV_CHECK],
            env=self._env({}),
            cwd="/",
            cpu=self._cpu_seconds,
            stdin=None,
            timeout=30,
            max_bytes=65536,
        )
        self._dev_baseline = baseline.stdout
        return executor

    def _stop(self) -> None:
        if self._executor is not None:
            self._executor.stop()
            self._executor = None
        for cg in (self._run_cgroup, self._cgroup):
            if cg is not None:
                with contextlib.suppress(OSError):
                    cg.remove()
        self._run_cgroup = self._cgroup = None
        if getattr(self, "dir", None) is not None:
            if self._scratch_is_tmpfs:
                with contextlib.suppress(OSError):
                    _host.unmount(self.scratch)
                self._scratch_is_tmpfs = False
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _reset(self) -> None:
        if self._executor is not None and self._warm_clean():
            return
        if self._executor is not None:  # could not clean in place: start over with a fresh executor
            self._executor.stop()
            self._executor = None
        if self._run_cgroup is not None:
            self._run_cgroup.kill_all()
        if self._scratch_is_tmpfs:
            _host.unmount(self.scratch)
            _host.mount_tmpfs(self.scratch, size_mb=self.limits.disk_mb, uid=self.uid, gid=self.uid)
        else:
            for child in self.scratch.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        if self.warm_exec and self._run_cgroup is not None:
            self._executor = self._new_executor()

    def _warm_clean(self) -> bool:
        """Reset without restarting the executor: sweep processes, empty scratch, ``/tmp``,
        ``/dev/shm``, message queues and SysV IPC, then verify what was spared. False if anything
        is left or untrustworthy (a directory made unwritable, a traced executor...), so the
        caller starts over in fresh namespaces."""
        executor, cg = self._executor, self._run_cgroup
        if executor is None or cg is None or not executor.alive:
            return False
        seccomp = _seccomp.program() is not None
        if not cg.kill_all(exclude=executor.spare, timeout=1.0) or executor.verify(
            cg.pids(), seccomp=seccomp
        ):
            return False
        dirs = f"{self.workdir} /tmp /dev/shm /dev/mqueue"  # ipcrm: SysV IPC, where seccomp is off
        script = (
            f"find {dirs} -mindepth 1 -delete 2>/dev/null; ipcrm -a 2>/dev/null; "
            f"find {dirs} -mindepth 1 2>/dev/null | head -n 1; {_DEV_CHECK}"
        )
        try:
            cap = executor.run(
                ["/bin/sh", "-c", script],
                env=self._env({}),
                cwd="/",
                cpu=self._cpu_seconds,
                stdin=None,
                timeout=30,
                max_bytes=4096,
            )
        except SandboxError:
            return False
        # /dev is read-only inside, but a tampered /dev/null must never reach the next user
        if cap.returncode != 0 or cap.timed_out or cap.stdout != self._dev_baseline:
            return False
        return executor.verify(cg.pids(), seccomp=seccomp) is None

    @property
    def protections(self) -> dict[str, str]:
        """What is enforced on this host, and how (for docs, the CLI and honest reports)."""
        cg = self._cgroup is not None
        return {
            "isolation": self.isolation or "(not started)",
            "uid": f"private uid {self.uid}" if self._lease else f"runs as your uid {self.uid}",
            "memory": "cgroup memory.limit_in_bytes" if cg else "RLIMIT_AS per process",
            "processes": (
                "cgroup pids.max + RLIMIT_NPROC"
                if cg
                else "RLIMIT_NPROC (shared with your uid)"
                if not self._lease
                else "RLIMIT_NPROC on the private uid"
            ),
            "disk": (
                "tmpfs scratch capped at disk_mb"
                if self._scratch_is_tmpfs
                else "unbounded scratch (only RLIMIT_FSIZE)"
            ),
            "network": (
                "shared with the host (host loopback services and abstract UNIX sockets reachable)"
                if self.limits.network
                else "own network namespace, loopback only"
            ),
            "seccomp": (
                f"denies {len(_seccomp.DENIED_SYSCALLS)} syscalls (ptrace, keyrings, ...)"
                if _seccomp.program() is not None
                else f"OFF: {_seccomp.unavailable_reason()}"
            ),
            "pid 1": (
                "warm executor (non-dumpable, verified on reset)"
                if self.warm_exec and self._cgroup
                else "bubblewrap's init, one per run"
                if self.isolation == "bwrap"
                else "root setup shell, one per run"
            ),
        }

    # ---- launching -------------------------------------------------------------------------
    @property
    def _launch_uid(self) -> int:
        """The uid of the launcher process (bwrap runs as the sandbox uid; unshare as root)."""
        return self.uid if self.isolation == "bwrap" else 0

    def _write_etc(self) -> None:
        etc = self.dir / "etc"
        etc.mkdir()
        uid = 1000 if self.isolation == "bwrap" else self.uid  # bwrap maps the sandbox uid to 1000
        self._etc = {
            "passwd": (
                "root:x:0:0:root:/root:/usr/sbin/nologin\n"
                f"sandbox:x:{uid}:{uid}:sandbox:/sandbox:/bin/sh\n"
                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
            ).encode(),
            "group": f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n".encode(),
        }
        # unshare copies these in; bwrap reads them from memfds
        for name, data in self._etc.items():
            (etc / name).write_bytes(data)
            os.chmod(etc / name, 0o644)
        os.chmod(etc, 0o755)

    def _launcher(
        self,
        command: list[str],
        cgroup: _host.Cgroup | None,
        fds: LaunchFds | None,
        *,
        cpu_limit: bool = True,
        as_pid_1: bool = False,
    ) -> list[str]:
        """``sh -c 'join cgroups; set rlimits; exec ISOLATION COMMAND'``.

        No Python runs in the child.

        ``cpu_limit=False`` and ``as_pid_1=True`` are for the warm executor, which sets RLIMIT_CPU
        in each run's child and is PID 1 of its namespaces (see ``_executor.py``).
        """
        lim = self.limits
        steps = [
            f"echo $$ > {shlex.quote(f)} || exit 125"
            for f in (cgroup.procs_files if cgroup else [])
        ]
        if cpu_limit:
            cpu = self._cpu_seconds
            steps.append(f"ulimit -S -t {cpu} && ulimit -H -t {cpu + 1} || exit 125")
        steps.append(
            f"ulimit -f {lim.max_file_size_mb * 2048} && ulimit -c 0 && ulimit -n 1024 || exit 125"
        )
        if self._cgroup is None:
            steps.append(f"ulimit -v {lim.memory_mb * 1024} || exit 125")
        # bwrap's monitor and init/executor count too
        if self.isolation == "bwrap" and fds is not None:
            steps.append(f"ulimit -p {lim.max_processes + 2} || exit 125")
            isolation = bwrap_argv(
                fds=fds,
                tmp_mb=lim.disk_mb,
                network=lim.network,
                userns=True,
                ro_binds=self.ro_binds,
                as_pid_1=as_pid_1,
            )
        else:  # unshare: RLIMIT_NPROC is set for the sandbox uid only, after the root setup
            isolation = unshare_argv(
                tmp_mb=lim.disk_mb,
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
        return [
            "/bin/sh",
            "-c",
            "; ".join(steps) + '; exec "$@"',
            "envhub-launch",
            *isolation,
            *command,
        ]

    @property
    def _cpu_seconds(self) -> int:
        return max(1, math.ceil(self.limits.cpu_time_s))

    def _launch_fds(self) -> LaunchFds | None:
        """The fds a bwrap launch reads (scratch, passwd, group, seccomp); None for unshare."""
        if self.isolation != "bwrap":
            return None
        opened: list[int] = []
        try:
            opened.append(os.open(self.scratch, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            opened += [_seccomp.memfd(f"envhub-{name}", data) for name, data in self._etc.items()]
            program = _seccomp.program()
            if program is not None:
                opened.append(_seccomp.memfd("envhub-seccomp", program))
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        return LaunchFds(
            scratch=opened[0],
            passwd=opened[1],
            group=opened[2],
            seccomp=opened[3] if len(opened) > 3 else None,
        )

    def _popen(
        self,
        command: list[str],
        env: dict[str, str],
        cgroup: _host.Cgroup | None,
        *,
        pass_fds: tuple[int, ...] = (),
        cpu_limit: bool = True,
        as_pid_1: bool = False,
    ) -> subprocess.Popen[bytes]:
        fds = self._launch_fds()
        drop = self._lease is not None and self.isolation == "bwrap"
        try:
            argv = self._launcher(command, cgroup, fds, cpu_limit=cpu_limit, as_pid_1=as_pid_1)
            if fds is None:
                env = {**env, UNSHARE_DIR_ENV: str(self.dir)}
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd="/",
                close_fds=True,
                pass_fds=pass_fds + (fds.all() if fds else ()),
                process_group=0,
                user=self.uid if drop else None,
                group=self.uid if drop else None,
                extra_groups=[] if drop else None,
            )
        except OSError as e:
            raise SandboxError(f"could not launch the sandbox for {self!r}: {e}") from e
        finally:
            for fd in fds.all() if fds else ():
                os.close(fd)

    def _kill_tree(self, proc: subprocess.Popen[bytes], cgroup: _host.Cgroup | None) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if cgroup is not None:
            cgroup.kill_all()

    def _exec(
        self, argv: list[str], *, timeout: float, stdin: bytes | None, env: dict[str, str]
    ) -> ExecResult:
        cg = self._run_cgroup
        ooms_before = (cg.oom_kills(), self._cgroup.oom_kills()) if cg and self._cgroup else (0, 0)
        if self._executor is not None:
            cap = self._executor.run(
                argv,
                env=env,
                cwd=self.workdir,
                cpu=self._cpu_seconds,
                stdin=stdin,
                timeout=timeout,
                max_bytes=self.limits.max_output_bytes,
            )
        else:
            t0 = time.monotonic()
            proc = self._current = self._popen(argv, env, cg)
            try:
                cap = communicate(
                    proc,
                    stdin=stdin,
                    timeout=timeout,
                    max_bytes=self.limits.max_output_bytes,
                    kill=lambda: self._kill_tree(proc, cg),
                    started=t0,
                )
            finally:
                # orphans never outlive a run (the PID namespace is gone too)
                self._kill_tree(proc, cg)
                if proc.poll() is None:
                    proc.wait()
                self._current = None
        code = exit_status(cap.returncode)
        if code == 125 and not cap.stdout and b"cgroup" in cap.stderr:
            raise SandboxError(
                f"{self!r}: the launcher could not join its cgroup: {_decode(cap.stderr)}"
            )
        oom = False
        if cg and self._cgroup:
            oom = (cg.oom_kills(), self._cgroup.oom_kills()) != ooms_before
        return ExecResult(
            exit_code=code,
            stdout=_decode(cap.stdout),
            stderr=_decode(cap.stderr),
            wall_time_s=cap.wall_time_s,
            timed_out=cap.timed_out,
            oom_killed=oom and not cap.timed_out,
            output_truncated=cap.truncated,
            cpu_time_exceeded=code == 128 + signal.SIGXCPU and not cap.timed_out,
        )

    # ---- files -----------------------------------------------------------------------------
    def _write_bytes(self, parts: tuple[str, ...], data: bytes) -> None:
        owner = (self.uid, self.uid) if _host.is_root() else None
        _host.write_at(self.scratch, parts, data, owner=owner)

    def _read_bytes(self, parts: tuple[str, ...]) -> bytes:
        return _host.read_at(self.scratch, parts)

    # ---- sessions --------------------------------------------------------------------------
    def _open_session(self, language: str) -> Session:
        from sandboxes.session import PipeSession

        self._session_count += 1
        cgroup = (
            _host.Cgroup(
                f"s{self._session_count}", parent=self._cgroup, delegate_uid=self._launch_uid
            )
            if self._cgroup is not None
            else None
        )

        def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
            return self._popen(argv, self._env({}), cgroup)

        def kill(proc: subprocess.Popen[bytes]) -> None:
            self._kill_tree(proc, cgroup)

        def cleanup() -> None:
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.remove()

        return PipeSession(
            language,
            spawn=spawn,
            kill=kill,
            cleanup=cleanup,
            limits=self.limits,
            workdir=self.workdir,
        )


def collect_stale(base_dir: str | None = None) -> list[str]:
    """Remove what local sandboxes of dead processes left behind (a process killed with SIGKILL
    or SIGTERM cannot clean up): their scratch mounts, cgroups and directories. A sandbox is
    stale when its uid lease is no longer held (root) or its owner pid is gone. Returns the
    directories removed. ``envhub sandbox gc`` runs this.
    """
    removed = []
    for path in Path(base_dir or tempfile.gettempdir()).glob("envhub-sbx-*"):
        try:
            owner = json.loads((path / "owner.json").read_text())
        except (OSError, ValueError):
            continue  # still starting, or not ours
        if owner["leased"]:
            alive = _host.uid_lease_held(owner["uid"])
        else:
            alive = Path(f"/proc/{owner['pid']}").exists()
        if alive:
            continue
        with contextlib.suppress(OSError):
            _host.unmount(path / "scratch")
        for cg in sorted(owner["cgroups"], key=len, reverse=True):
            for child in Path(cg).glob("*/"):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                Path(cg).rmdir()
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed
