"""``local``: the embedded default backend — Linux namespaces, rlimits and cgroups, no daemon.

Each ``run`` starts one process in fresh namespaces (bubblewrap, or ``unshare`` where bwrap
is missing; see ``_isolation.py`` for the exact view of the filesystem). Run as root (as CI
and this project's machines do), a sandbox also gets its own uid, cgroups and a tmpfs scratch.
``warm_exec=True`` (what ``SandboxPool`` uses) keeps one executor process inside the
namespaces instead, and a run is a fork+exec there (``_executor.py``): several times faster,
same limits; runs of one sandbox then share its namespaces and ``/tmp`` until ``reset()``.

Protects against (each has an adversarial test in ``tests/sandboxes/test_adversarial.py``):

- **Infinite loops**: wall-clock deadline per run, then SIGKILL of the whole process tree
  (process group + PID namespace + cgroup sweep); RLIMIT_CPU as a second bound.
- **Fork bombs**: cgroup ``pids.max`` and RLIMIT_NPROC on a uid no other sandbox uses.
- **Memory bombs**: cgroup ``memory.limit_in_bytes`` for the sandbox (OOM kills are counted
  and reported as ``oom_killed``); RLIMIT_AS per process where cgroups are not writable.
- **Disk fill**: scratch and ``/tmp`` are size-capped tmpfs; RLIMIT_FSIZE caps each file.
- **Output floods**: output is read up to ``max_output_bytes`` per stream, then the run is killed.
- **Network egress**: a network namespace with only its own loopback; host loopback services
  and outside addresses are unreachable (no route leaves the namespace).
- **Reading host files**: only ``/usr``, public ``/etc`` files and scratch are visible; the
  project checkout, ``/root``, ``/home`` and ``/etc/shadow`` do not exist inside.
- **Writing outside scratch**: everything but scratch and ``/tmp`` is mounted read-only, and
  the program is an unprivileged uid without capabilities.
- **Orphans**: a run's PID namespace dies with it, so background processes never outlive it
  (with ``warm_exec``, every process of the run's cgroup but the executor is SIGKILLed instead).
- **Signals**: a PID namespace shows only the sandbox's processes; host PIDs cannot be signalled.
- **Env-var leakage**: the program gets ``BASE_ENV`` plus what the caller passes, never the
  host environment.
- **Host file tricks**: ``read_file``/``write_file`` refuse symlinks planted by the program.

Does NOT protect against: kernel exploits (no seccomp filter; namespaces widen the kernel
surface a little), CPU starvation of the host beyond one run's CPU limit (no cpu cgroup
quota), side channels. Without root: no private uid (RLIMIT_NPROC then counts all of your
processes), no cgroups, no tmpfs scratch (``disk_mb`` unenforced; ``max_file_size_mb`` still
holds). Only cgroup v1 controllers are used: on a cgroup-v2-only host the memory cap is
RLIMIT_AS per process, the process cap RLIMIT_NPROC on the private uid, and ``warm_exec``
falls back to a fresh sandbox per run. ``protections`` lists what is active on this host.
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

from sandboxes import _host
from sandboxes._executor import WarmExecutor
from sandboxes._isolation import bwrap_argv, probe, unshare_argv
from sandboxes._proc import communicate, exit_status
from sandboxes.base import ExecResult, Limits, Sandbox, Session, _decode
from sandboxes.errors import SandboxConfigError, SandboxError, SandboxUnavailableError

__all__ = ["LocalSandbox", "local_isolation", "collect_stale"]

_ISOLATIONS = ("auto", "bwrap", "unshare")
_DEV_CHECK = "ls -lAn /dev | sed 1d; stat -c '%n %F %t:%T %a %u' /dev/null /dev/zero /dev/full /dev/urandom"
"""What ``/dev`` looks like; a warm sandbox whose /dev changed is restarted on reset."""


def local_isolation(requested: str = "auto") -> str:
    """The isolation ``requested`` resolves to here; raises with the fix when none works."""
    if requested not in _ISOLATIONS:
        raise SandboxConfigError(f"isolation must be one of {_ISOLATIONS}, got {requested!r}")
    probe_uid = _host.UID_BASE - 1 if _host.is_root() else None
    reasons = {}
    for kind in (("bwrap", "unshare") if requested == "auto" else (requested,)):
        reason = probe(kind, probe_uid if kind == "bwrap" else None)
        if reason is None:
            return kind
        reasons[kind] = reason
    raise SandboxUnavailableError(
        "the local sandbox cannot isolate processes on this host: "
        + "; ".join(f"{k}: {v}" for k, v in reasons.items())
        + ". Install bubblewrap (apt-get install -y bubblewrap) and allow unprivileged user namespaces "
        "(sysctl kernel.unprivileged_userns_clone=1), or run as root; or use make_sandbox('docker')."
    )


class LocalSandbox(Sandbox):
    """Namespaces + rlimits + cgroups on this machine. See the module docstring.

    ``isolation``: ``"auto"`` (bwrap, else unshare), ``"bwrap"`` or ``"unshare"``.
    ``ro_binds``: extra host paths to show read-only at the same path (e.g. a virtualenv
    with the packages tests need). ``base_dir``: where per-sandbox host dirs go.
    """

    backend = "local"

    def __init__(self, *, limits: Limits | None = None, isolation: str = "auto", ro_binds: Sequence[str] = (),
                 base_dir: str | None = None, warm_exec: bool = False) -> None:
        super().__init__(limits=limits)
        if isolation not in _ISOLATIONS:
            raise SandboxConfigError(f"isolation must be one of {_ISOLATIONS}, got {isolation!r}")
        for path in ro_binds:
            if not os.path.isabs(path) or not os.path.exists(path):
                raise SandboxConfigError(f"ro_binds entry {path!r} must be an existing absolute path")
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
                    _host.mount_tmpfs(self.scratch, size_mb=self.limits.disk_mb, uid=self.uid, gid=self.uid)
                    self._scratch_is_tmpfs = True
                except OSError:
                    os.chown(self.scratch, self.uid, self.uid)
            if not self._scratch_is_tmpfs:
                os.chmod(self.scratch, 0o700)
            (self.dir / "root").mkdir()
            self._write_etc()
            if root and _host.cgroups_available():
                self._cgroup = _host.Cgroup(f"envhub-{self.id}", memory_bytes=self.limits.memory_mb << 20,
                                            pids_max=self.limits.max_processes + 4)
                self._run_cgroup = _host.Cgroup("run", parent=self._cgroup, delegate_uid=self._launch_uid)
            (self.dir / "owner.json").write_text(json.dumps({  # lets collect_stale() clean up after a crash
                "pid": os.getpid(), "uid": self.uid, "leased": self._lease is not None,
                "cgroups": [str(p) for p in (self._cgroup.dirs.values() if self._cgroup else [])]}))
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
            raise SandboxError("the warm executor needs cgroups (run as root where cgroup v1 is writable)")

        def spawn(argv: list[str], pass_fd: int) -> subprocess.Popen[bytes]:
            return self._popen(argv, self._env({}), cg, pass_fds=(pass_fd,), cpu_limit=False)

        executor = WarmExecutor(spawn, lambda exclude: cg.kill_all(exclude=exclude))
        executor.start()
        baseline = executor.run(["/bin/sh", "-c", _DEV_CHECK], env=self._env({}), cwd="/", cpu=self._cpu_seconds,
                                stdin=None, timeout=30, max_bytes=65536)
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
        """Reset without restarting the executor: sweep processes, empty scratch, /tmp and IPC.
        False if anything is left (e.g. a directory made unwritable), so the caller restarts."""
        executor, cg = self._executor, self._run_cgroup
        if executor is None or cg is None or not executor.alive:
            return False
        cg.kill_all(exclude=executor.spare)
        script = (f"find {self.workdir} /tmp /dev/shm -mindepth 1 -delete 2>/dev/null; ipcrm -a 2>/dev/null; "
                  f"find {self.workdir} /tmp -mindepth 1 2>/dev/null | head -n 1; {_DEV_CHECK}")
        try:
            cap = executor.run(["/bin/sh", "-c", script], env=self._env({}), cwd="/", cpu=self._cpu_seconds,
                               stdin=None, timeout=30, max_bytes=4096)
        except SandboxError:
            return False
        # /dev is writable inside (bwrap's tmpfs): a tampered /dev/null must not reach the next user
        return (cap.returncode == 0 and not cap.timed_out and cap.stdout == self._dev_baseline
                and executor.alive)

    @property
    def protections(self) -> dict[str, str]:
        """What is enforced on this host, and how (for docs, the CLI and honest reports)."""
        cg = self._cgroup is not None
        return {
            "isolation": self.isolation or "(not started)",
            "uid": f"private uid {self.uid}" if self._lease else f"runs as your uid {self.uid}",
            "memory": "cgroup memory.limit_in_bytes" if cg else "RLIMIT_AS per process",
            "processes": "cgroup pids.max + RLIMIT_NPROC" if cg else "RLIMIT_NPROC (shared with your uid)"
            if not self._lease else "RLIMIT_NPROC on the private uid",
            "disk": "tmpfs scratch capped at disk_mb" if self._scratch_is_tmpfs
            else "unbounded scratch (only RLIMIT_FSIZE)",
            "network": "shared with host" if self.limits.network else "own network namespace, loopback only",
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
        (etc / "passwd").write_text(f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}:sandbox:/sandbox:"
                                    "/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (etc / "group").write_text(f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
        for f in ("passwd", "group"):
            os.chmod(etc / f, 0o644)
        os.chmod(etc, 0o755)

    def _launcher(self, command: list[str], cgroup: _host.Cgroup | None, *, cpu_limit: bool = True) -> list[str]:
        """``sh -c 'join cgroups; set rlimits; exec ISOLATION COMMAND'``: no Python runs in the child.

        ``cpu_limit=False`` is for the warm executor, which sets RLIMIT_CPU in each run's child.
        """
        lim = self.limits
        steps = [f"echo $$ > {shlex.quote(f)} || exit 125" for f in (cgroup.procs_files if cgroup else [])]
        if cpu_limit:
            cpu = self._cpu_seconds
            steps.append(f"ulimit -S -t {cpu} && ulimit -H -t {cpu + 1} || exit 125")
        steps.append(f"ulimit -f {lim.max_file_size_mb * 2048} && ulimit -c 0 && ulimit -n 1024 || exit 125")
        if self._cgroup is None:
            steps.append(f"ulimit -v {lim.memory_mb * 1024} || exit 125")
        if self.isolation == "bwrap":  # bwrap's monitor and init (and the warm executor) count too
            steps.append(f"ulimit -p {lim.max_processes + (3 if self.warm_exec else 2)} || exit 125")
            isolation = bwrap_argv(scratch=self.scratch, etc_dir=self.dir / "etc", tmp_mb=lim.disk_mb,
                                   network=lim.network, userns=True, ro_binds=self.ro_binds)
        else:  # unshare: RLIMIT_NPROC is set for the sandbox uid only, after the root setup
            isolation = unshare_argv(root=self.dir / "root", scratch=self.scratch, etc_dir=self.dir / "etc",
                                     tmp_mb=lim.disk_mb, network=lim.network, uid=self.uid, ro_binds=self.ro_binds)
            command = ["/bin/sh", "-c", f'ulimit -p {lim.max_processes} && exec "$@"', "sh", *command]
        return ["/bin/sh", "-c", "; ".join(steps) + '; exec "$@"', "envhub-launch", *isolation, *command]

    @property
    def _cpu_seconds(self) -> int:
        return max(1, math.ceil(self.limits.cpu_time_s))

    def _popen(self, command: list[str], env: dict[str, str], cgroup: _host.Cgroup | None, *,
               pass_fds: tuple[int, ...] = (), cpu_limit: bool = True) -> subprocess.Popen[bytes]:
        argv = self._launcher(command, cgroup, cpu_limit=cpu_limit)
        drop = self._lease is not None and self.isolation == "bwrap"
        try:
            return subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                cwd="/", close_fds=True, pass_fds=pass_fds, process_group=0,
                user=self.uid if drop else None, group=self.uid if drop else None, extra_groups=[] if drop else None)
        except OSError as e:
            raise SandboxError(f"could not launch {argv[0]} for {self!r}: {e}") from e

    def _kill_tree(self, proc: subprocess.Popen[bytes], cgroup: _host.Cgroup | None) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if cgroup is not None:
            cgroup.kill_all()

    def _exec(self, argv: list[str], *, timeout: float, stdin: bytes | None, env: dict[str, str]) -> ExecResult:
        cg = self._run_cgroup
        ooms_before = (cg.oom_kills(), self._cgroup.oom_kills()) if cg and self._cgroup else (0, 0)
        if self._executor is not None:
            cap = self._executor.run(argv, env=env, cwd=self.workdir, cpu=self._cpu_seconds, stdin=stdin,
                                     timeout=timeout, max_bytes=self.limits.max_output_bytes)
        else:
            t0 = time.monotonic()
            proc = self._current = self._popen(argv, env, cg)
            try:
                cap = communicate(proc, stdin=stdin, timeout=timeout, max_bytes=self.limits.max_output_bytes,
                                  kill=lambda: self._kill_tree(proc, cg), started=t0)
            finally:
                self._kill_tree(proc, cg)  # orphans never outlive a run (the PID namespace is gone too)
                if proc.poll() is None:
                    proc.wait()
                self._current = None
        code = exit_status(cap.returncode)
        if code == 125 and not cap.stdout and b"cgroup" in cap.stderr:
            raise SandboxError(f"{self!r}: the launcher could not join its cgroup: {_decode(cap.stderr)}")
        oom = bool(cg and self._cgroup) and (cg.oom_kills(), self._cgroup.oom_kills()) != ooms_before  # type: ignore[union-attr]
        return ExecResult(
            exit_code=code, stdout=_decode(cap.stdout), stderr=_decode(cap.stderr), wall_time_s=cap.wall_time_s,
            timed_out=cap.timed_out, oom_killed=oom and not cap.timed_out, output_truncated=cap.truncated,
            cpu_time_exceeded=code == 128 + signal.SIGXCPU and not cap.timed_out)

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
        cgroup = (_host.Cgroup(f"s{self._session_count}", parent=self._cgroup, delegate_uid=self._launch_uid)
                  if self._cgroup is not None else None)

        def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
            return self._popen(argv, self._env({}), cgroup)

        def kill(proc: subprocess.Popen[bytes]) -> None:
            self._kill_tree(proc, cgroup)

        def cleanup() -> None:
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.remove()

        return PipeSession(language, spawn=spawn, kill=kill, cleanup=cleanup, limits=self.limits,
                           workdir=self.workdir)


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
