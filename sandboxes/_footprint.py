"""What a local sandbox holds on the host, and how all of it is given back, even after a crash.

A started ``LocalSandbox`` holds one :class:`Footprint`:

- a directory ``envhub-sbx-ID-*`` in ``base_dir`` (by default, as root, the host's ``/dev/shm``:
  creating and deleting directory entries on a disk file system can cost milliseconds each,
  and the scratch inside is a tmpfs of its own anyway; else the temp dir), mode 0711 so that
  the sandbox uid can traverse it to its scratch, with

  - ``scratch/``: what the program sees as ``/sandbox``. As root a tmpfs of ``Limits.place_mb``
    owned by the sandbox uid; otherwise (or where mounting fails) a plain directory, mode 0700;
  - ``root/``: the mount point of ``unshare``'s root; ``etc/`` (``unshare`` only): the
    ``passwd`` and ``group`` it copies in (``_launch.etc_files``; bwrap binds ``_etc_view``'s
    copy instead);
  - ``owner.json``: the owner pid, the uid, whether it is leased, the cgroup directories;

- as root, a private uid (``_host.UidLease``), so RLIMIT_NPROC, signals and keys are per sandbox;
- as root where cgroup v1 memory and pids are writable, a cgroup ``envhub-ID`` (memory
  ``memory_mb``, pids ``max_processes`` + 4) and its child ``run``, which the launcher's uid
  may join.

What it guarantees:

1. ``Footprint(...)`` returns with all of the above in place, or gives back what it made and
   raises.
2. ``release()`` kills what is left in the cgroups and removes them, unmounts and deletes the
   directory and gives the uid back; a second call does nothing.
3. ``empty_scratch()`` leaves scratch empty and as capped as it was at the start.
4. ``collect_stale()`` gives back the footprints whose owner died without ``release()`` (a
   process killed with SIGKILL, or SIGTERM without handler, cannot clean up): those whose uid
   lease no process holds (root) or whose owner pid is gone, first killing what their
   sandboxes left running under their leased uid (a sandbox may outlive a killed owner); and
   the copies of ``/etc`` no live process holds (``_etc_view.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sandboxes import _etc_view, _host
from sandboxes._launch import etc_files, launch_uid
from sandboxes.base import Limits

__all__ = ["Footprint", "collect_stale"]

_PREFIX = "envhub-sbx-"
_SHM = Path("/dev/shm")


def default_base_dir() -> str:
    """Where sandbox directories go unless ``base_dir`` says otherwise (see the docstring)."""
    if _host.is_root() and _SHM.is_dir() and os.access(_SHM, os.W_OK | os.X_OK):
        return str(_SHM)
    return tempfile.gettempdir()


class Footprint:
    """The host resources of one local sandbox (see the module docstring)."""

    def __init__(
        self, sandbox_id: str, limits: Limits, *, isolation: str, base_dir: str | None
    ) -> None:
        self.limits = limits
        self.uid = os.getuid()
        self.lease: _host.UidLease | None = None
        self.cgroup: _host.Cgroup | None = None
        self.run_cgroup: _host.Cgroup | None = None
        self.scratch_is_tmpfs = False
        self.etc: dict[str, bytes] = {}
        self._released = False
        self.dir = Path(
            tempfile.mkdtemp(prefix=f"{_PREFIX}{sandbox_id}-", dir=base_dir or default_base_dir())
        )
        self.scratch = self.dir / "scratch"
        try:
            self._create(sandbox_id, isolation)
        except BaseException:
            self.release()
            raise

    def _create(self, sandbox_id: str, isolation: str) -> None:
        root = _host.is_root()
        if root:
            self.lease = _host.UidLease()
            self.uid = self.lease.uid
        os.chmod(self.dir, 0o711)  # the sandbox uid must traverse it to reach scratch
        self.scratch.mkdir()
        if root:
            try:
                _host.mount_tmpfs(
                    self.scratch, size_mb=self.limits.place_mb, uid=self.uid, gid=self.uid
                )
                self.scratch_is_tmpfs = True
            except OSError:
                os.chown(self.scratch, self.uid, self.uid)
        if not self.scratch_is_tmpfs:
            os.chmod(self.scratch, 0o700)
        (self.dir / "root").mkdir()
        self.etc = etc_files(isolation, self.uid)
        if isolation == "unshare":
            etc_dir = self.dir / "etc"
            etc_dir.mkdir()
            for name, data in self.etc.items():
                (etc_dir / name).write_bytes(data)
                os.chmod(etc_dir / name, 0o644)
            os.chmod(etc_dir, 0o755)
        if root and _host.cgroups_available():
            self.cgroup = _host.Cgroup(
                f"envhub-{sandbox_id}",
                memory_bytes=self.limits.memory_mb << 20,
                pids_max=self.limits.max_processes + 4,
            )
            self.run_cgroup = _host.Cgroup(
                "run", parent=self.cgroup, delegate_uid=launch_uid(isolation, self.uid)
            )
        owner = {
            "pid": os.getpid(),
            "uid": self.uid,
            "leased": self.lease is not None,
            "cgroups": [str(p) for p in (self.cgroup.dirs.values() if self.cgroup else [])],
        }
        (self.dir / "owner.json").write_text(json.dumps(owner))

    def empty_scratch(self) -> None:
        """Delete everything in scratch (a tmpfs is mounted afresh, so its cap holds again)."""
        if self.scratch_is_tmpfs:
            _host.unmount(self.scratch)
            size = self.limits.place_mb
            _host.mount_tmpfs(self.scratch, size_mb=size, uid=self.uid, gid=self.uid)
            return
        for child in self.scratch.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        os.chmod(self.scratch, 0o700)  # as _create left it: a run of the same uid may chmod it
        for name in os.listxattr(self.scratch):
            with contextlib.suppress(OSError):
                os.removexattr(self.scratch, name)

    def release(self) -> None:
        """Give everything back (guarantee 2); safe to call twice."""
        if self._released:
            return
        self._released = True
        for cg in (self.run_cgroup, self.cgroup):
            if cg is not None:
                with contextlib.suppress(OSError):
                    cg.remove()
        self.run_cgroup = self.cgroup = None
        if self.scratch_is_tmpfs:
            with contextlib.suppress(OSError):
                _host.unmount(self.scratch)
            self.scratch_is_tmpfs = False
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def _release_stale(path: Path, owner: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        _host.unmount(path / "scratch")
    for cg in sorted(owner["cgroups"], key=len, reverse=True):
        for child in Path(cg).glob("*/"):
            with contextlib.suppress(OSError):
                child.rmdir()
        with contextlib.suppress(OSError):
            Path(cg).rmdir()
    shutil.rmtree(path, ignore_errors=True)


def collect_stale(base_dir: str | None = None, *, leased_only: bool = False) -> list[str]:
    """Give back what local sandboxes of dead processes left behind (guarantee 4): their scratch
    mounts, cgroups and directories. Returns the directories removed. ``envhub sandbox gc``
    runs this. ``leased_only``: only footprints with a leased uid (root), whose owner is known
    dead by its lease, not by a pid another PID namespace could reuse.
    """
    removed = []
    places = [base_dir] if base_dir else sorted({default_base_dir(), tempfile.gettempdir()})
    for path in (p for place in places for p in Path(place).glob(f"{_PREFIX}*")):
        try:
            owner = json.loads((path / "owner.json").read_text())
        except (OSError, ValueError):
            continue  # still starting, or not ours
        with contextlib.ExitStack() as held:
            if owner["leased"]:  # held while cleaning: nobody leases the uid meanwhile
                if not held.enter_context(_host.stale_uid_lease(owner["uid"])):
                    continue
                _host.kill_uid(owner["uid"])  # what its sandboxes left, in their cgroups or not
            elif leased_only or Path(f"/proc/{owner['pid']}").exists():
                continue
            _release_stale(path, owner)
        removed.append(str(path))
    return removed + _etc_view.collect_stale(places)
