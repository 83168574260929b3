"""``docker``: one container per sandbox, through the ``docker`` SDK (``pip install docker``).

``start()`` creates a container from ``image`` whose main process (under ``docker-init``, uid
65534) lives as long as our attached stdin: the container dies with its owner, even one that
is SIGKILLed, and the engine removes it (``auto_remove``). Each ``run`` is a ``docker exec`` of
the program itself as uid 1000, with no wrapper process it could kill or stop. When the run
ends (exit, timeout, output cap), a second exec SIGKILLs every process of uid 1000 and returns
once none runs; a kill the run managed to stop (``kill(-1, SIGSTOP)`` in a loop stops it too)
makes the sandbox *compromised*: its processes are SIGKILLed from the host (as root with the
engine on this host), ``SandboxError`` is raised, and ``stop()`` removes the container within
a bounded time (a pool replaces it). ``reset()`` kills both uids' processes and deletes
everything they own; what it cannot delete or verify costs a new container. Every engine call
is bounded: an engine that hangs, restarts or is gone is a ``SandboxError`` that says to start
dockerd or set ``DOCKER_HOST``, never a made-up result. How an exec is streamed, bounded and
killed from outside is ``_docker_exec.py``; the scripts run inside, ``_docker_inside.py``.

Protects against (``DockerSandbox.PROTECTS`` is the same list; ``envhub sandbox info`` prints
it). Tests are in ``tests/sandboxes/`` (docker params, marked ``docker``): ``adv`` =
``test_adversarial.py``, ``reuse`` = ``test_reuse.py``, ``contract`` = ``test_contract.py``,
``docker`` = ``test_docker.py``.

- **Infinite loops**: wall-clock deadline, then SIGKILL of every process of the run's uid;
  RLIMIT_CPU (``ulimits``) as a second bound.
  (adv::test_infinite_loop_is_killed_at_the_wall_time_limit,
  adv::test_cpu_time_limit_kills_a_busy_program)
- **Fork bombs**: ``pids_limit`` (cgroup) = ``max_processes`` + docker-init and the sleep.
  (adv::test_fork_bomb_is_capped_and_returns_in_bounded_time)
- **Memory bombs**: ``mem_limit`` = ``memswap_limit`` (cgroup, no swap); an OOM kill is the
  container's cgroup counter moving during the run (read from the host; elsewhere, engine
  ``oom`` events). (adv::test_memory_bomb_is_oom_killed_and_reported,
  adv::test_an_oom_kill_is_reported_for_its_own_run_only)
- **Disk fill**: root filesystem read-only; every writable place (``/sandbox``, ``/tmp``,
  ``/dev/shm``) is a tmpfs of ``disk_mb`` each, but ``memory_mb / 8`` at most (``Limits.place_mb``:
  tmpfs is memory, so full places never OOM-kill later runs); RLIMIT_FSIZE caps each file. SysV
  shared memory is capped the same in all (``kernel.shmmax``/``shmall`` of the container's own
  IPC namespace) and destroyed once no process holds it (``kernel.shm_rmid_forced``); POSIX
  message queues hold at most ``min(disk_mb, 800 KiB)`` (RLIMIT_MSGQUEUE).
  (adv::test_disk_fill_in_scratch_and_tmp_stops_at_the_cap,
  reuse::test_every_writable_tmpfs_is_capped_at_disk_mb,
  reuse::test_filling_every_writable_place_leaves_memory_for_the_next_run,
  reuse::test_sysv_shared_memory_is_capped_at_disk_mb,
  reuse::test_posix_message_queues_hold_at_most_disk_mb)
- **Output floods**: ``max_output_bytes`` per stream, then the run is killed.
  (adv::test_output_flood_is_truncated_and_the_run_stopped)
- **Network egress**: ``network_mode="none"`` (only a loopback of its own).
  (adv::test_network_egress_to_loopback_and_outside_fails)
- **Reading host files**: only the image's files (and ``volumes=`` you pass) are visible.
  (adv::test_host_files_are_not_readable)
- **Writing outside scratch**: read-only root, unprivileged uid 1000, all capabilities
  dropped, ``no-new-privileges``. (adv::test_writes_outside_scratch_fail_and_tmp_is_private)
- **Orphans**: nothing of a run outlives it, even a daemon that killed its parent first: the
  cleanup is an exec of its own, from outside the run.
  (adv::test_background_processes_do_not_survive_a_timeout,
  reuse::test_a_process_left_behind_is_dead_when_the_run_returns)
- **Signals and tampering**: the container's PID namespace; the run's uid owns no process but
  the run's own, so stopping, killing or ptrace-ing everything it sees touches only itself, and
  the run is reported as what it was, not as a timeout. Stopping its own clean-up exec is
  caught (bounded wait) and answered from outside the container, as above.
  (adv::test_signals_cannot_reach_the_host_and_cannot_stop_the_kill,
  adv::test_a_run_that_stops_every_process_of_its_uid_cannot_outlive_its_timeout,
  adv::test_processes_that_outlive_a_run_cannot_be_attached_or_rewritten,
  adv::test_a_run_that_stops_or_kills_everything_it_sees_does_not_break_the_next,
  adv::test_a_run_cannot_lower_the_limits_or_cpu_share_of_the_next_user)
- **Kernel objects across ``reset()``**: an IPC namespace per container (``ipc_mode="private"``);
  ``reset()`` removes SysV message queues, semaphores and shared memory (``ipcrm``), POSIX
  message queues and the files in every writable place (``find -delete``), then checks.
  Scratch itself is root's (group 1000, mode 3770, checked by ``reset()``), so its mode, ACLs
  and xattrs are out of a run's reach. (reuse::test_ipc_objects_do_not_reach_the_next_user,
  reuse::test_files_in_dev_shm_and_tmp_do_not_reach_the_next_user,
  reuse::test_what_a_run_sets_on_scratch_itself_does_not_reach_the_next_user,
  contract::test_reset_empties_scratch)
- **Leaks and engine failures**: the container dies with its owner process (SIGKILL and SIGTERM
  included) and is removed; an engine that hangs ends a run by its deadline plus a grace, with
  ``SandboxError``; a run the engine restarts under is a ``SandboxError``; ``stop()`` while the
  engine is down returns, and the container is gone once it is back.
  (docker::test_container_is_removed_when_its_owner_is_killed,
  docker::test_a_run_ends_by_its_deadline_when_the_engine_hangs,
  docker::test_an_engine_restart_is_an_error_and_stop_while_down_still_removes)
- **Keyrings** (not namespaced: uid 1000's user keyring is shared by every container and the
  host's uid 1000): the engine's default seccomp profile denies ``add_key``/``keyctl``/
  ``request_key``; ``start()`` refuses a container that has no seccomp filter, no
  no-new-privileges or any capability in its bounding set (``SandboxUnavailableError``).
  (adv::test_the_host_session_keyring_is_out_of_reach, reuse::test_keyring_syscalls_are_denied,
  reuse::test_keys_do_not_reach_the_next_user_or_a_later_sandbox)
- **Env leakage**: exec gets ``BASE_ENV`` + ``env=`` only.
  (adv::test_host_environment_does_not_leak)
- **Host file tricks**: planted symlinks resolve inside the container only; bad paths raise
  ``SandboxFileError``. (adv::test_planted_symlinks_do_not_expose_host_files,
  reuse::test_an_over_long_path_raises_sandbox_file_error)

Does NOT protect against: kernel exploits through what the engine's default seccomp profile
allows (``start()`` sees only that *a* filter is on, so a permissive default profile passes), a
compromised or remote engine, images that ship secrets. Every sandbox of an engine runs as the
same uids, so per-uid kernel counters are shared between containers: inotify instances (while
a run holds them) and POSIX message queue bytes (until ``reset()``) of one sandbox count
against the others. A container's network namespace lasts across ``reset()`` (nothing a
killed process bound there survives it); a writable ``volumes=`` mount is not emptied by it.
Persistent sessions run as uid 1001 (group 1000) so a ``run``'s cleanup does not kill them.
``exit_code`` follows the 128+N convention like every backend. Interrupting one session
command (instead of restarting the session) needs the engine on this host (it finds the
process via ``/proc``). A run costs two execs (the program, then its cleanup), ``reset()`` two.
Killing from the host (a stopped clean-up) and exact OOM attribution need root and the engine
on this host; elsewhere a stopped clean-up still raises ``SandboxError``, but the container's
removal waits for the engine. The sticky bit on scratch means a run cannot delete a file a
session made in scratch's top level (nor the reverse); with ``fs.protected_regular=2`` neither
can reopen the other's file there with ``O_CREAT``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

from sandboxes._docker_exec import (
    ENGINE_GRACE_S,
    ENGINE_HINT,
    ContainerExecs,
    ExecProcess,
    engine_call,
)
from sandboxes._docker_host import HostCgroup
from sandboxes._docker_inside import (
    CLEAN,
    NO_IPC_LEFT,
    RUN_USER,
    SCRATCH_OK,
    SCRATCH_OWNER,
    SESSION_USER,
    SETUP,
    WRAP,
    container_spec,
)
from sandboxes.base import ExecResult, Limits, Protection, Sandbox, Session, _decode
from sandboxes.errors import (
    SandboxConfigError,
    SandboxError,
    SandboxFileError,
    SandboxStateError,
    SandboxUnavailableError,
    ScratchFullError,
)

__all__ = ["DockerSandbox"]


def _import_docker() -> Any:
    try:
        import docker
    except ImportError:
        raise SandboxUnavailableError(
            "the docker backend needs the docker SDK: "
            "pip install 'envhub[docker]' (or pip install docker)"
        ) from None
    return docker


class DockerSandbox(Sandbox):
    """A container per sandbox. See the module docstring for what it protects against.

    ``image``: an image present on the engine (it is never pulled unless ``pull=True``).
    ``client``: a ``docker.DockerClient`` (default: ``docker.from_env()``, i.e. ``DOCKER_HOST``).
    ``volumes``: extra mounts in the SDK's form, e.g. ``{"/usr": {"bind": "/usr", "mode": "ro"}}``.
    ``cpus``: CPU quota of the container (``nano_cpus``).
    """

    backend = "docker"
    PROTECTS = tuple(
        Protection(name, how, tuple(f"tests/sandboxes/{t}" for t in tests))
        for name, how, tests in (
            (
                "infinite loops",
                "wall-clock deadline, then SIGKILL of the run's uid; RLIMIT_CPU",
                (
                    "test_adversarial.py::test_infinite_loop_is_killed_at_the_wall_time_limit",
                    "test_adversarial.py::test_cpu_time_limit_kills_a_busy_program",
                ),
            ),
            (
                "fork bombs",
                "pids cgroup of the container",
                ("test_adversarial.py::test_fork_bomb_is_capped_and_returns_in_bounded_time",),
            ),
            (
                "memory bombs",
                "memory cgroup, no swap; OOM from the cgroup's counter (else engine events)",
                (
                    "test_adversarial.py::test_memory_bomb_is_oom_killed_and_reported",
                    "test_adversarial.py::test_an_oom_kill_is_reported_for_its_own_run_only",
                ),
            ),
            (
                "disk fill",
                (
                    "read-only root; /sandbox, /tmp, /dev/shm: tmpfs of disk_mb (at most "
                    "memory_mb/8); SysV shm the same; RLIMIT_MSGQUEUE; RLIMIT_FSIZE"
                ),
                (
                    "test_adversarial.py::test_disk_fill_in_scratch_and_tmp_stops_at_the_cap",
                    "test_reuse.py::test_every_writable_tmpfs_is_capped_at_disk_mb",
                    "test_reuse.py::test_filling_every_writable_place_leaves_memory_for_the_next_run",
                    "test_reuse.py::test_sysv_shared_memory_is_capped_at_disk_mb",
                    "test_reuse.py::test_posix_message_queues_hold_at_most_disk_mb",
                ),
            ),
            (
                "output floods",
                "max_output_bytes per stream, then the run is killed",
                ("test_adversarial.py::test_output_flood_is_truncated_and_the_run_stopped",),
            ),
            (
                "network egress",
                "network_mode=none: only a loopback of its own",
                ("test_adversarial.py::test_network_egress_to_loopback_and_outside_fails",),
            ),
            (
                "reading host files",
                "only the image's files and the volumes you pass",
                ("test_adversarial.py::test_host_files_are_not_readable",),
            ),
            (
                "writing outside scratch",
                "read-only root, uid 1000, no capabilities, no-new-privileges",
                ("test_adversarial.py::test_writes_outside_scratch_fail_and_tmp_is_private",),
            ),
            (
                "orphans",
                "an exec of its own SIGKILLs the run's uid after every run",
                (
                    "test_adversarial.py::test_background_processes_do_not_survive_a_timeout",
                    "test_reuse.py::test_a_process_left_behind_is_dead_when_the_run_returns",
                ),
            ),
            (
                "signals and tampering",
                (
                    "PID namespace; the run's uid owns no process but the run's own; "
                    "a stopped clean-up is answered from the host, SandboxError"
                ),
                (
                    "test_adversarial.py::test_signals_cannot_reach_the_host_and_cannot_stop_the_kill",
                    "test_adversarial.py::test_a_run_that_stops_every_process_of_its_uid_cannot_outlive_its_timeout",
                    "test_adversarial.py::test_processes_that_outlive_a_run_cannot_be_attached_or_rewritten",
                    "test_adversarial.py::test_a_run_that_stops_or_kills_everything_it_sees_does_not_break_the_next",
                    "test_adversarial.py::test_a_run_cannot_lower_the_limits_or_cpu_share_of_the_next_user",
                ),
            ),
            (
                "kernel objects across reset",
                (
                    "IPC namespace per container; reset() removes SysV IPC, POSIX "
                    "queues and files, then checks; scratch itself is root's (mode 3770)"
                ),
                (
                    "test_reuse.py::test_ipc_objects_do_not_reach_the_next_user",
                    "test_reuse.py::test_files_in_dev_shm_and_tmp_do_not_reach_the_next_user",
                    "test_reuse.py::test_what_a_run_sets_on_scratch_itself_does_not_reach_the_next_user",
                    "test_contract.py::test_reset_empties_scratch",
                ),
            ),
            (
                "keyrings",
                (
                    "default seccomp profile denies the keyring syscalls; "
                    "start() checks the filter is on"
                ),
                (
                    "test_adversarial.py::test_the_host_session_keyring_is_out_of_reach",
                    "test_reuse.py::test_keyring_syscalls_are_denied",
                    "test_reuse.py::test_keys_do_not_reach_the_next_user_or_a_later_sandbox",
                ),
            ),
            (
                "leaks and engine failures",
                (
                    "the container dies with its owner (auto-removed); engine calls bounded "
                    "by the run's deadline; a hung or restarted engine raises SandboxError"
                ),
                (
                    "test_docker.py::test_container_is_removed_when_its_owner_is_killed",
                    "test_docker.py::test_a_run_ends_by_its_deadline_when_the_engine_hangs",
                    "test_docker.py::test_an_engine_restart_is_an_error_and_stop_while_down_still_removes",
                ),
            ),
            (
                "env-var leakage",
                "BASE_ENV plus what the caller passes",
                ("test_adversarial.py::test_host_environment_does_not_leak",),
            ),
            (
                "host file tricks",
                "symlinks resolve inside the container; bad paths raise SandboxFileError",
                (
                    "test_adversarial.py::test_planted_symlinks_do_not_expose_host_files",
                    "test_reuse.py::test_an_over_long_path_raises_sandbox_file_error",
                ),
            ),
        )
    )
    NOT_PROTECTED = (
        (
            "kernel exploits through what the engine's default seccomp profile allows "
            "(a permissive one passes start())"
        ),
        "a compromised or remote engine; images that ship secrets",
        (
            "per-uid kernel counters (inotify instances, POSIX message queue bytes) "
            "are shared by all containers"
        ),
        "a container's network namespace and writable volumes= mounts last across reset()",
    )

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        image: str = "python:3.11-slim",
        client: Any = None,
        base_url: str | None = None,
        volumes: Mapping[str, Any] | None = None,
        cpus: float = 1.0,
        pull: bool = False,
    ) -> None:
        super().__init__(limits=limits)
        if not isinstance(image, str) or not image:
            raise SandboxConfigError(
                f"image must be an image name like 'python:3.11-slim', got {image!r}"
            )
        if not (isinstance(cpus, (int, float)) and cpus > 0):
            raise SandboxConfigError(f"cpus must be a positive number, got {cpus!r}")
        self.image, self.cpus, self.pull = image, float(cpus), pull
        self.volumes = dict(volumes or {})
        self._client, self._base_url = client, base_url
        self.container: Any = None
        self._container_execs: ContainerExecs | None = None
        self._lifeline: Any = None

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        docker = _import_docker()
        try:
            if self._client is None:
                self._client = (
                    docker.DockerClient(base_url=self._base_url)
                    if self._base_url
                    else docker.from_env()
                )
            self._client.ping()
        except Exception as e:  # noqa: BLE001 - any failure to reach the engine
            where = self._base_url or os.environ.get("DOCKER_HOST", "default socket")
            raise SandboxUnavailableError(
                f"no Docker engine reachable ({where}): {e}. {ENGINE_HINT}"
            ) from None
        self.api = self._client.api
        try:
            self._client.images.get(self.image)
        except docker.errors.ImageNotFound:
            if not self.pull:
                raise SandboxUnavailableError(
                    f"image {self.image!r} is not on the engine; "
                    f"`docker pull {self.image}` (or build/import it), "
                    "or pass pull=True"
                ) from None
            self._client.images.pull(self.image)
        try:
            self.container = self._client.containers.create(
                self.image,
                **container_spec(
                    docker, self.limits, cpus=self.cpus, volumes=self.volumes, label=self.id
                ),
            )
            self._lifeline = self.api.attach_socket(
                self.container.id, params={"stdin": 1, "stream": 1}
            )
            self.container.start()
        except Exception as e:
            for leftover in self._client.containers.list(
                all=True, filters={"label": f"envhub.sandbox={self.id}"}
            ):
                with contextlib.suppress(Exception):
                    leftover.remove(force=True)
            self._cut_lifeline()
            raise SandboxError(f"could not start a container from {self.image!r}: {e}") from e
        self.container.reload()
        host = HostCgroup.find(self.container.id, int(self.container.attrs["State"]["Pid"] or 0))
        self._container_execs = ContainerExecs(
            self.api,
            self.container.id,
            workdir=self.workdir,
            name=f"docker sandbox {self.id}",
            host=host,
        )
        setup = self._quick(["/bin/sh", "-c", SETUP], user=SCRATCH_OWNER)
        if setup.exit_code == 3:
            self._stop()
            raise SandboxUnavailableError(
                "the engine did not confine the container as this backend requires "
                f"({setup.stdout.strip()}; wanted Seccomp: 2, NoNewPrivs: 1, "
                "CapBnd: 0000000000000000). Without a seccomp filter, keyring syscalls reach "
                "the per-uid keyrings that every container and the host share: use an engine "
                "with seccomp support (`docker info` lists name=seccomp) "
                "and no seccomp=unconfined default."
            )
        if setup.exit_code != 0:
            self._stop()
            raise SandboxError(
                f"could not prepare {self.workdir} in image {self.image!r}: "
                f"{(setup.stderr or setup.stdout).strip()}"
            )

    def _kill_running(self) -> None:
        """Kill every process of the container, from the host where we can (nothing inside can
        stop that), else through the engine (SIGKILL to its init), never waiting past
        ``ENGINE_GRACE_S`` for it."""
        container, execs = self.container, self._container_execs
        if execs is not None:
            execs.stopping = True
            if execs.host is not None:
                execs.host.kill()
        if container is not None:
            with contextlib.suppress(Exception):
                engine_call("container kill", ENGINE_GRACE_S, container.kill)

    def _stop(self) -> None:
        """Remove the container (forced) and wait until it is gone, waiting ``ENGINE_GRACE_S``
        at most for each engine call; one the engine misses is done once it sees our end of
        the container's stdin closed (``LIVE_WHILE_STDIN``)."""
        self._kill_running()
        self._container_execs = None
        if self.container is not None:
            with contextlib.suppress(Exception):
                engine_call("container remove", ENGINE_GRACE_S, self.container.remove, force=True)
            with contextlib.suppress(Exception):  # "already being removed" (auto_remove): wait
                engine_call(
                    "container wait",
                    ENGINE_GRACE_S,
                    self.api.wait,
                    self.container.id,
                    condition="removed",
                )
            self.container = None
        self._cut_lifeline()

    def _cut_lifeline(self) -> None:
        """Close our end of the container's stdin: its keep-alive ends, the engine removes it."""
        lifeline, self._lifeline = self._lifeline, None
        if lifeline is not None:
            with contextlib.suppress(Exception):
                getattr(lifeline, "_sock", lifeline).close()
            with contextlib.suppress(Exception):
                lifeline.close()

    def _reset(self) -> None:
        """Kill both users' processes and delete what each owns (files, SysV IPC, POSIX queues);
        if anything is left (a file it cannot delete, no ``ipcrm`` in the image), start a new
        container."""
        self._quick(["/bin/sh", "-c", CLEAN], user=SESSION_USER)
        r = self._quick(
            ["/bin/sh", "-c", f"{CLEAN} && {NO_IPC_LEFT} && {SCRATCH_OK}"], user=RUN_USER
        )
        if r.exit_code != 0:
            self._stop()
            self._start()

    # ---- exec (see _docker_exec.py) --------------------------------------------------------
    @property
    def _execs(self) -> ContainerExecs:
        if self._container_execs is None:
            raise SandboxStateError(f"{self!r} has no container; call start() first")
        return self._container_execs

    def _quick(
        self,
        argv: list[str],
        *,
        user: str,
        stdin: bytes | None = None,
        timeout: float = 30.0,
        max_bytes: int = 1 << 20,
    ) -> ExecResult:
        """An internal exec (cleanup, file transfer) with the engine's view of the exit code."""
        return self._execs.run(
            argv,
            user=user,
            env=self._env({}),
            stdin=stdin,
            timeout=timeout,
            max_bytes=max_bytes,
            kill_user=user,
        )

    def _exec(
        self, argv: list[str], *, timeout: float, stdin: bytes | None, env: dict[str, str]
    ) -> ExecResult:
        execs = self._execs  # stop() from another thread may drop it meanwhile
        result = execs.run(
            ["/bin/sh", "-c", WRAP, "envhub", *argv],
            user=RUN_USER,
            env=env,
            stdin=stdin,
            timeout=timeout,
            max_bytes=self.limits.max_output_bytes,
            kill_user=RUN_USER,
        )
        # from outside the run: nothing it did can skip this; a run that raised (the engine
        # failed, or the kill was stopped) leaves a sandbox that must be stopped anyway
        if not execs.stopping:
            execs.kill_user(RUN_USER)
        return result

    # ---- files -----------------------------------------------------------------------------
    def _write_bytes(self, parts: tuple[str, ...], data: bytes) -> None:
        path = "/".join((self.workdir, *parts))
        r = self._quick(
            ["sh", "-c", 'umask 002; mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", path],
            user=RUN_USER,
            stdin=data,
        )
        if r.exit_code != 0:  # a full scratch (the program's doing?) or anything else (ours)
            full = "No space left on device" in r.stderr
            raise (ScratchFullError if full else SandboxFileError)(
                f"could not write {path!r} in {self!r}: {r.stderr.strip() or r.describe()}"
            )

    def _read_bytes(self, parts: tuple[str, ...]) -> bytes:
        path = "/".join((self.workdir, *parts))
        stream = self._execs.open(
            ["sh", "-c", 'test -f "$1" && exec cat -- "$1"', "sh", path],
            env=self._env({}),
            user=RUN_USER,
        )
        stream.close_stdin()
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + 60
        while not stream.eof and time.monotonic() < deadline:
            for kind, data in stream.frames(0.5):
                (out if kind == 1 else err).extend(data)
        stream.close()
        if self._execs.exit_code(stream.exec_id) != 0:
            raise SandboxFileError(
                f"{path!r} is not a readable regular file in {self!r} {_decode(bytes(err)).strip()}"
            )
        return bytes(out)

    # ---- sessions --------------------------------------------------------------------------
    def _open_session(self, language: str) -> Session:
        from sandboxes.session import PipeSession, SessionProcess

        def spawn(argv: list[str]) -> SessionProcess:
            stream = self._execs.open(
                ["/bin/sh", "-c", 'umask 002; exec "$@"', "envhub", *argv],
                env=self._env({}),
                user=SESSION_USER,
            )
            return ExecProcess(self.api, stream)

        def kill(proc: SessionProcess) -> None:
            with contextlib.suppress(SandboxError):  # the session restarts either way
                self._execs.kill_user(SESSION_USER)
            proc.kill()

        return PipeSession(
            language,
            spawn=spawn,
            kill=kill,
            cleanup=lambda: None,
            limits=self.limits,
            workdir=self.workdir,
        )
