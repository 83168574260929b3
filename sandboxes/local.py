"""``local``: the embedded default backend — Linux namespaces, rlimits and cgroups, no daemon.

Each ``run`` starts one process in fresh namespaces (bubblewrap, or ``unshare`` where bwrap
is missing; see ``_isolation.py`` for the exact view of the filesystem). Run as root (as CI
and this project's machines do), a sandbox also gets its own uid, cgroups and a tmpfs scratch.
``warm_exec=True`` (what ``SandboxPool`` and the code envs use) keeps a fork server (the
*zygote*, ``_zygote.py``; host side ``_executor.py``) inside the namespaces instead: a command
is one ``posix_spawn`` by its small spawner process, and ``python3 -I FILE|-c CODE``
(``run_code``, the code envs' test runner) runs in a fork of the pre-imported zygote, with no
interpreter start-up. Same limits; runs of one sandbox then share its namespaces and ``/tmp``
until ``reset()``, but nothing else: each is a fresh process, and neither the zygote nor the
spawner ever runs code of a run.
How each process is launched, with which limits, is ``_launch.py``; what a sandbox holds on
the host and how it is given back (``envhub sandbox gc`` after a crash) is ``_footprint.py``.
The first sandbox a process starts first gives back what sandboxes of dead processes left
(``collect_stale`` for leased uids, whose owners are known dead by their leases: their
processes, mounts, cgroups, uids, directories), so a crashed trainer or hub heals at its next
start without anyone running ``gc``.

Protects against (``LocalSandbox.PROTECTS`` is the same list with the tests that attack each
property; ``envhub sandbox info`` prints it with what is active on this host). Tests are in
``tests/sandboxes/``: ``adv`` = ``test_adversarial.py``, ``reuse`` = ``test_reuse.py``,
``zyg`` = ``test_zygote.py``; ``adv`` and ``reuse`` run on the warm path too, and again with
Python taking the zygote's in-process path (``local-fork``).

- **Infinite loops**: wall-clock deadline per run, then SIGKILL of the whole process tree
  (process group + PID namespace + cgroup sweep); RLIMIT_CPU as a second bound.
  (adv::test_infinite_loop_is_killed_at_the_wall_time_limit,
  adv::test_cpu_time_limit_kills_a_busy_program)
- **Fork bombs**: cgroup ``pids.max`` and RLIMIT_NPROC on a uid no other sandbox uses.
  (adv::test_fork_bomb_is_capped_and_returns_in_bounded_time)
- **Memory bombs**: cgroup ``memory.limit_in_bytes`` for the sandbox (OOM kills are counted
  and reported as ``oom_killed``); RLIMIT_AS per process where cgroups are not writable.
  (adv::test_memory_bomb_is_oom_killed_and_reported)
- **Disk fill**: scratch, ``/tmp`` and ``/dev/shm`` are tmpfs capped at ``disk_mb``, but
  ``memory_mb / 8`` at most (``Limits.place_mb``: tmpfs is memory, so full places never
  OOM-kill later runs); ``/dev`` itself is read-only; RLIMIT_FSIZE caps each file; POSIX
  message queues are bounded by RLIMIT_MSGQUEUE and SysV IPC is denied (seccomp).
  (adv::test_disk_fill_in_scratch_and_tmp_stops_at_the_cap,
  reuse::test_every_writable_tmpfs_is_capped_at_disk_mb,
  reuse::test_filling_every_writable_place_leaves_memory_for_the_next_run,
  reuse::test_posix_message_queues_hold_at_most_disk_mb,
  reuse::test_sysv_shared_memory_is_capped_at_disk_mb)
- **Output floods**: output is read up to ``max_output_bytes`` per stream, then the run is killed.
  (adv::test_output_flood_is_truncated_and_the_run_stopped)
- **Network egress**: a network namespace with only its own loopback; host loopback services
  and outside addresses are unreachable. (adv::test_network_egress_to_loopback_and_outside_fails)
- **Reading host files**: only ``/usr``, public ``/etc`` files and scratch are visible; the
  project checkout, ``/root``, ``/home`` and ``/etc/shadow`` do not exist inside.
  (adv::test_host_files_are_not_readable)
- **Host paths**: scratch and ``/etc`` (a shared read-only copy, ``_etc_view.py``) are bound
  from fds, so ``/proc/*/cmdline`` names no host path and ``/proc/self/mountinfo`` no
  sandbox's directory (it names the ``/etc`` copy's, a digest of its content).
  (adv::test_no_host_path_shows_in_mounts_or_process_lines)
- **Writing outside scratch**: everything but scratch, ``/tmp`` and ``/dev/shm`` is read-only,
  and the program is an unprivileged uid without capabilities.
  (adv::test_writes_outside_scratch_fail_and_tmp_is_private)
- **Orphans**: a run's PID namespace dies with it (with ``warm_exec``, every process of the
  run's cgroup but the zygote is SIGKILLed when the run returns).
  (adv::test_background_processes_do_not_survive_a_timeout,
  reuse::test_a_process_left_behind_is_dead_when_the_run_returns,
  zyg::test_a_background_process_of_a_run_is_gone_before_the_next)
- **State from one run in the next** (``warm_exec``): every run is a fresh fork of the zygote,
  so modules, globals, handlers, threads, cwd or random state a run changes die with it; what
  a run asks for reaches its child through a memfd, never the zygote's memory; files in scratch,
  ``/tmp`` and ``/dev/shm`` last until ``reset()`` (as the contract says), which empties them
  from the host. (zyg::test_modules_globals_handlers_and_threads_of_a_run_are_not_in_the_next,
  zyg::test_unseeded_random_numbers_differ_between_runs,
  zyg::test_files_a_run_leaves_do_not_reach_the_next_user)
- **A broken or lying zygote** (``warm_exec``): the host parses its (and its spawner's)
  fixed-size replies strictly, learns the spawner's pid from the kernel, takes no fd from
  either, enforces deadlines and output caps itself; a zygote or spawner killed
  (from outside, or by the OOM killer when a run exhausts the memory) or caught lying costs the
  run a clear result (exit 137, a note on stderr) and the next run a fresh zygote in fresh
  namespaces; a run cannot stop it with a signal (PID 1 with no handlers).
  (zyg::test_signals_a_run_sends_the_zygote_do_not_stop_it,
  zyg::test_a_run_that_stops_or_kills_the_spawner_costs_a_restart,
  zyg::test_a_zygote_killed_mid_run_costs_a_restart,
  zyg::test_a_run_that_exhausts_the_sandbox_memory_costs_a_restart,
  zyg::test_a_zygote_that_lies_costs_a_restart_and_never_hangs_the_host)
- **Signals**: a PID namespace shows only the sandbox's processes; host PIDs cannot be signalled.
  (adv::test_signals_cannot_reach_the_host_and_cannot_stop_the_kill)
- **Tampering with what outlives a run** (the zygote and its spawner): both are non-dumpable,
  the zygote is PID 1 of its namespace, ``ptrace``/``process_vm_*`` are denied by seccomp, and
  ``reset()`` verifies them (not traced, not stopped, still filtered, alone in the cgroup but
  for a spare child the zygote forked for itself that no run saw, and the rlimits, nice, CPU
  affinity and scheduling policy runs inherit unchanged) or starts afresh; a spawner a run
  stopped or killed is replaced before the next command.
  (adv::test_processes_that_outlive_a_run_cannot_be_attached_or_rewritten,
  adv::test_a_run_that_stops_or_kills_everything_it_sees_does_not_break_the_next,
  adv::test_reset_replaces_an_executor_it_cannot_verify,
  adv::test_a_run_cannot_lower_the_limits_or_cpu_share_of_the_next_user,
  zyg::test_reset_replaces_a_spawner_it_cannot_verify)
- **Kernel objects across ``reset()``**: POSIX message queues (a private ``/dev/mqueue``),
  ``/dev/shm`` and ``/tmp`` are emptied, or the namespaces are new; SysV IPC is denied. A
  socket left in the network namespace (a TCP connection in TIME_WAIT, a UNIX socket that only
  the kernel holds, its name bound, in an SCM_RIGHTS cycle) means new namespaces, where the next
  user sees none of it. (reuse::test_ipc_objects_do_not_reach_the_next_user,
  reuse::test_files_in_dev_shm_and_tmp_do_not_reach_the_next_user,
  ``test_reuse_unix_sockets.py``::test_unix_sockets_held_only_by_the_kernel_do_not_reach_the_next_user)
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
abstract UNIX sockets are reachable then. A one-shot (not warm) run has a shell as its PID 1
(``_isolation.ONE_SHOT_INIT``), which the run can write through ``/proc/1/mem``; it lives only
as long as that run and is swept with its cgroup. Without root: no private uid (RLIMIT_NPROC
then counts all of your processes), no cgroups (so no sweep: that init is only bound by
``--die-with-parent``), no tmpfs scratch (``disk_mb`` unenforced there; ``max_file_size_mb``
still holds), no ``warm_exec``. Only cgroup v1 controllers are used: on a cgroup-v2-only host
the memory cap is RLIMIT_AS per process, the process cap RLIMIT_NPROC on the private uid, and
``warm_exec`` falls back to a fresh sandbox per run. Without libseccomp there is no syscall filter
(``protections`` says so). With ``warm_exec``, Python runs forked from one zygote share its
``str`` hash seed and address-space layout (a run can learn both; they say nothing about
another run's data), see the pre-imported modules in ``sys.modules``, and differ from a fresh
``python3 -I`` in interpreter teardown past what ``_zygote._run_python`` reproduces. Memory a
run leaves in flight in a UNIX socket cycle (a memfd sent over a socket that holds itself) is
charged to the sandbox until the kernel's unix garbage collector frees it: the reset that finds
the cycle starts fresh namespaces, and the old ones' closing sockets schedule the collector,
which in practice runs before the new zygote is up, but nothing waits for it (the kernel offers
no way to await it short of polling).
``protections`` lists what is active on this host.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from sandboxes import _host, _seccomp
from sandboxes._executor import WarmExecutor
from sandboxes._footprint import Footprint, collect_stale
from sandboxes._isolation import probe
from sandboxes._launch import Launcher, cpu_seconds, kill_tree, launch_uid
from sandboxes._proc import communicate, exit_status
from sandboxes._protects import LOCAL_NOT_PROTECTED, LOCAL_PROTECTS
from sandboxes.base import ExecResult, Limits, Sandbox, Session, _decode
from sandboxes.errors import (
    SandboxConfigError,
    SandboxError,
    SandboxStateError,
    SandboxUnavailableError,
)

__all__ = ["LocalSandbox", "local_isolation"]

_ISOLATIONS = ("auto", "bwrap", "unshare")
_log = logging.getLogger(__name__)


@functools.cache
def _collect_stale_once(base_dir: str | None) -> None:
    """``collect_stale`` at the first start of this process in ``base_dir`` (see the module
    docstring); a failure is logged, never the start's."""
    try:
        removed = collect_stale(base_dir, leased_only=True)
    except OSError as e:  # a host that refuses the cleanup still starts sandboxes
        _log.warning("could not give back what dead processes' sandboxes left: %s", e)
        return
    if removed:
        _log.info("gave back %d leftovers of dead processes' sandboxes", len(removed))


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
    PROTECTS = LOCAL_PROTECTS
    NOT_PROTECTED = LOCAL_NOT_PROTECTED

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
        self._footprint: Footprint | None = None
        self._session_count = 0
        self.warm_exec = warm_exec
        self._executor: WarmExecutor | None = None
        self._current: subprocess.Popen[bytes] | None = None
        self._stopping = False  # set by stop() before it sweeps (see _kill_running)
        self._launcher: Launcher | None = None

    # ---- host resources (see _footprint.py) ------------------------------------------------
    @property
    def _fp(self) -> Footprint:
        if self._footprint is None:
            raise SandboxStateError(f"{self!r} is not started; call start() first")
        return self._footprint

    @property
    def dir(self) -> Path:
        """The sandbox's directory on the host (scratch, owner record...); only while started."""
        return self._fp.dir

    @property
    def uid(self) -> int:
        """The uid the program runs as: a private leased uid as root, else yours."""
        return self._footprint.uid if self._footprint else os.getuid()

    @property
    def _cgroup(self) -> _host.Cgroup | None:
        return self._footprint.cgroup if self._footprint else None

    @property
    def _run_cgroup(self) -> _host.Cgroup | None:
        return self._footprint.run_cgroup if self._footprint else None

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        self.isolation = local_isolation(self.requested_isolation)
        _collect_stale_once(self._base_dir)
        fp = self._footprint = Footprint(
            self.id, self.limits, isolation=self.isolation, base_dir=self._base_dir
        )
        try:
            self._launcher = Launcher(
                isolation=self.isolation,
                uid=fp.uid,
                leased=fp.lease is not None,
                limits=self.limits,
                ro_binds=self.ro_binds,
                memory_cgroup=fp.cgroup is not None,
                home=fp.dir,
                scratch=fp.scratch,
                etc=fp.etc,
            )
            if self.warm_exec and fp.run_cgroup is not None:
                self._executor = self._new_executor()
        except BaseException:
            self._stop()
            raise

    def _kill_running(self) -> None:
        # first: a run still launching its command (not in the cgroup, not recorded yet) sees
        # this once its process is recorded, and kills it (_exec); one of the two always does
        self._stopping = True
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

        def spawn(argv: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
            return self._popen(
                argv, self._env({}), cg, pass_fds=pass_fds, cpu_limit=False, as_pid_1=True
            )

        executor = WarmExecutor(
            spawn, cg, env=self._env({}), cpu=self._cpu_seconds, writable=self._writable
        )
        executor.start()
        return executor

    def _stop(self) -> None:
        if self._executor is not None:
            self._executor.stop()
            self._executor = None
        self._launcher = None
        if self._footprint is not None:
            self._footprint.release()
            self._footprint = None

    def _reset(self) -> None:
        if self._executor is not None and self._executor.clean():
            return
        if self._executor is not None:  # could not clean in place: start over with a fresh executor
            self._executor.stop()
            self._executor = None
        if self._run_cgroup is not None:
            self._run_cgroup.kill_all()
        self._fp.empty_scratch()
        if self.warm_exec and self._run_cgroup is not None:
            self._executor = self._new_executor()

    @property
    def protections(self) -> dict[str, str]:
        """What is enforced on this host, and how (for docs, the CLI and honest reports)."""
        cg = self._cgroup is not None
        fp = self._footprint
        leased = fp is not None and fp.lease is not None
        return {
            "isolation": self.isolation or "(not started)",
            "uid": f"private uid {self.uid}" if leased else f"runs as your uid {self.uid}",
            "memory": "cgroup memory.limit_in_bytes" if cg else "RLIMIT_AS per process",
            "processes": (
                "cgroup pids.max + RLIMIT_NPROC"
                if cg
                else "RLIMIT_NPROC (shared with your uid)"
                if not leased
                else "RLIMIT_NPROC on the private uid"
            ),
            "disk": (
                "tmpfs scratch capped at disk_mb"
                if fp is not None and fp.scratch_is_tmpfs
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
                "the zygote, a fork server (non-dumpable, verified on reset)"
                if self.warm_exec and self._cgroup
                else "a shell that waits for the command, one per run"
                if self.isolation == "bwrap"
                else "root setup shell, one per run"
            ),
        }

    # ---- launching (see _launch.py) ---------------------------------------------------------
    @property
    def _launch_uid(self) -> int:
        return launch_uid(self.isolation, self.uid)

    @property
    def _writable(self) -> tuple[str, ...]:
        """Every place a run can write: what a reset empties."""
        return (self.workdir, "/tmp", "/dev/shm", "/dev/mqueue")

    @property
    def _cpu_seconds(self) -> int:
        return cpu_seconds(self.limits)

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
        if self._launcher is None:
            raise SandboxStateError(f"{self!r} is not started; call start() first")
        try:
            return self._launcher.popen(
                command, env, cgroup, pass_fds=pass_fds, cpu_limit=cpu_limit, as_pid_1=as_pid_1
            )
        except OSError as e:
            raise SandboxError(f"could not launch the sandbox for {self!r}: {e}") from e

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
            if self._stopping:  # stop() swept while it launched: it would not be killed
                kill_tree(proc.pid, cg)
            try:
                cap = communicate(
                    proc,
                    stdin=stdin,
                    timeout=timeout,
                    max_bytes=self.limits.max_output_bytes,
                    kill=lambda: kill_tree(proc.pid, cg),
                    started=t0,
                )
            finally:
                # orphans never outlive a run (the PID namespace is gone too)
                kill_tree(proc.pid, cg)
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
        if oom and self._executor is not None:
            # memory may still be held where the run wrote (/tmp, /dev/shm) or the zygote be
            # broken: the next run starts a fresh zygote in fresh namespaces
            self._executor.stop()
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
        _host.write_at(self._fp.scratch, parts, data, owner=owner)

    def _read_bytes(self, parts: tuple[str, ...]) -> bytes:
        return _host.read_at(self._fp.scratch, parts)

    # ---- sessions --------------------------------------------------------------------------
    def _open_session(self, language: str) -> Session:
        from sandboxes.session import PipeSession, SessionProcess

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

        def kill(proc: SessionProcess) -> None:
            kill_tree(proc.pid, cgroup)

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
