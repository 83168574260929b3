"""A container's cgroup, seen from the host: kills no program inside can stop, and OOM counts.

Why: every clean-up *inside* a container is a process of some uid, and a run of uid 1000 can
``kill(-1, SIGSTOP)`` in a loop; an exec of uid 1000 is then stopped while still in ``runc
init``, and the engine, waiting for that exec to start, blocks every later call on the
container (exec, kill, remove) until the exec goes away. A ``SIGKILL`` sent by root on the host
to each process of the container's cgroup cannot be stopped, and unblocks the engine.

:meth:`HostCgroup.find` returns one only where that is possible: we are root and the engine
runs on this host (the container's init pid, as the engine reports it, is in a cgroup named
after the container, here). Otherwise it returns ``None``, and the docker backend falls back to
what the engine alone can do (see ``docker.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

__all__ = ["HostCgroup"]


def _mounts() -> dict[str, str]:
    """cgroup controller (``""`` for cgroup v2) -> where its hierarchy is mounted."""
    found: dict[str, str] = {}
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fstype, options, *_ = line.split()
            if fstype == "cgroup2":
                found.setdefault("", point)
            elif fstype == "cgroup":
                for option in options.split(","):
                    found.setdefault(option, point)
    return found


def _status(pid: str) -> tuple[str, str]:
    """(state letter, real uid) of ``pid``; ``("", "")`` once it is gone."""
    state = uid = ""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("Uid:"):
                uid = line.split()[1]
                break
    return state, uid


class HostCgroup:
    """The cgroup directories (one per hierarchy) of one container on this host."""

    def __init__(self, dirs: dict[str, str]) -> None:
        self.dirs = dirs
        """controller (``""`` for cgroup v2) -> the container's directory in that hierarchy."""

    @classmethod
    def find(cls, container_id: str, init_pid: int) -> HostCgroup | None:
        """The cgroup of the container whose init is ``init_pid`` on this host, or ``None``."""
        if os.geteuid() != 0 or init_pid <= 0:
            return None
        try:
            with open(f"/proc/{init_pid}/cgroup") as f:
                lines = f.read().splitlines()
            mounts = _mounts()
        except OSError:
            return None
        dirs: dict[str, str] = {}
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if container_id not in path:
                continue
            for controller in controllers.split(",") if controllers else [""]:
                point = mounts.get(controller.removeprefix("name="))
                if point is not None and os.path.isdir(point + path):
                    dirs[controller] = point + path
        group = cls(dirs)
        return group if str(init_pid) in group.pids() else None

    def pids(self) -> list[str]:
        """Every process in the container (``cgroup.procs`` of one of its hierarchies)."""
        for directory in self.dirs.values():
            with contextlib.suppress(OSError), open(f"{directory}/cgroup.procs") as f:
                return f.read().split()
        return []

    def kill(self, uid: int | None = None, within: float = 5.0) -> bool:
        """SIGKILL every process of ``uid`` (every process if ``None``) in the container, until
        none runs (zombies aside); ``False`` if some still ran after ``within`` seconds.

        Each signal goes through a pidfd opened before the uid is checked, so a pid reused
        meanwhile is never signalled on the strength of another process's uid."""
        deadline = time.monotonic() + within
        while True:
            left = False
            for pid in self.pids():
                try:
                    fd = os.pidfd_open(int(pid))
                except OSError:  # gone
                    continue
                try:
                    state, owner = _status(pid)
                    if state and state != "Z" and (uid is None or owner == str(uid)):
                        left = True
                        with contextlib.suppress(OSError):
                            signal.pidfd_send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)
            if not left:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)  # a SIGKILLed process needs a moment to exit

    def oom_kills(self) -> int | None:
        """How many processes the kernel's OOM killer killed in the container so far (``None``
        where the kernel does not count them)."""
        for controller, name in (("memory", "memory.oom_control"), ("", "memory.events")):
            directory = self.dirs.get(controller)
            if directory is None:
                continue
            with contextlib.suppress(OSError), open(f"{directory}/{name}") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return None
