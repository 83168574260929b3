"""The ``/etc`` a bwrap sandbox sees: one prepared directory, bound read-only with one mount.

Why: bwrap mounts every entry it binds twice (a bind, then a read-only remount). The public
``/etc`` entries (``_isolation.ETC_FILES``) and the generated ``passwd`` and ``group`` were 22
mounts, about 2 ms of every sandbox start. Instead they are copied into one directory,
``envhub-etc-DIGEST/etc`` beside the sandboxes' directories (``_footprint.default_base_dir``),
named by what it holds and shared by every process on the host, and each launch binds it at
``/etc`` from an open fd.

What it guarantees:

1. **The same content as the binds**: each top-level entry is copied as a bind showed it (a
   symlink at the top is followed, as bwrap follows it; links inside a directory stay links,
   resolved inside the sandbox as before), keeping its mode (never readable by more users than
   on the host); ``passwd`` and ``group`` are the generated ones. What bwrap binds from the
   host on top (``NETWORK_ETC_FILES`` with the network on, a ``LocalSandbox(ro_binds=...)``
   path under ``/etc``) gets an empty placeholder of its type to be mounted on (bwrap cannot
   make one in the read-only copy).
2. **Not stale past the next launch**: :func:`etc_view` compares each source's ``stat``
   (device, inode, size, mtime) with the copy's at every call and uses (or makes) the copy of
   the new content when one changed (a package install rewrites ``ld.so.cache``, an admin
   edits ``hosts``). Inside a directory only additions, removals and renames change its own
   mtime: an entry of ``ld.so.conf.d`` edited in place shows at the next copy (only
   ``ldconfig`` reads those).
3. **Never changed or removed under a running sandbox**: a copy is complete before it gets its
   name (built under another, then renamed) and is never written again; each process that
   uses one holds a shared ``flock`` on its ``lock`` file for its lifetime (its forked
   children with it), and only :func:`collect_stale` (``envhub sandbox gc``) removes a copy,
   holding the exclusive lock no process then holds. Sandboxes cannot write it (a read-only
   bind; as root it is owned by root, not by any sandbox uid), nor another user of the host (a
   copy's name includes its maker's uid in its digest, and one not made by this uid is never
   used). So the host keeps one copy per ``/etc`` content and user, not one per process.

Seen from inside, ``/proc/self/mountinfo`` names the copy's directory as the source of
``/etc``, where the binds named the host's ``/etc`` files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from sandboxes._isolation import etc_entries

__all__ = ["PREFIX", "etc_view"]

PREFIX = "envhub-etc-"
"""Name prefix of the copies' directories (``collect_stale`` looks for it)."""

_lock = threading.Lock()
_held: dict[tuple[object, ...], tuple[int, Path]] = {}
"""(base dir, generated files, sources' stat, mount points) -> (the held lock's fd, ``etc``)."""


def etc_view(
    *, generated: Mapping[str, bytes], base_dir: str, mount_points: Sequence[str] = ()
) -> Path:
    """The directory to bind at ``/etc`` for a sandbox (see the module docstring);
    ``mount_points``: host paths under ``/etc/`` that bwrap binds over it."""
    names = etc_entries(network=False)
    sources = tuple(_stat_key(name) for name in names)
    points = tuple(sorted((path, os.path.isdir(path)) for path in mount_points))
    key = (base_dir, tuple(sorted(generated.items())), sources, points)
    with _lock:
        held = _held.get(key)
        if held is None or not held[1].is_dir():
            if held is not None:
                os.close(held[0])
            digest = hashlib.sha256(repr((os.geteuid(), key)).encode()).hexdigest()[:24]
            held = _held[key] = _hold(Path(base_dir, f"{PREFIX}{digest}"), names, generated, points)
    return held[1]


def _hold(
    top: Path,
    names: list[str],
    generated: Mapping[str, bytes],
    points: tuple[tuple[str, bool], ...],
) -> tuple[int, Path]:
    """A shared lock on ``top``'s copy, made first if missing (see guarantee 3). A ``top``
    this user did not make (the base directory may be world-writable, as ``/dev/shm`` and
    ``/tmp`` are, and the name predictable) is never used: a private copy is made instead."""
    for _ in range(5):  # a gc may remove an unheld copy between our finding and locking it
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(top).st_uid != os.geteuid() or not top.is_dir() or top.is_symlink():
                top = top.with_name(f"{top.name}-{os.getpid()}-{secrets.token_hex(4)}")
        if not top.is_dir():
            fd = _copy(top, names, generated, points)
            if fd is not None:
                return fd, top / "etc"
        try:
            fd = os.open(top / "lock", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(top / "lock")):
                return fd, top / "etc"
        os.close(fd)
    raise OSError(f"could not hold a copy of /etc at {top}: removed again and again")


def _stat_key(name: str) -> tuple[object, ...]:
    try:
        st = os.stat(f"/etc/{name}")
    except OSError:
        return (name,)
    return (name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _copy(
    top: Path,
    names: list[str],
    generated: Mapping[str, bytes],
    points: tuple[tuple[str, bool], ...],
) -> int | None:
    """Build the copy under a temporary name, locked, then rename it to ``top``; returns the
    lock's fd, shared now, or None when another process named its copy first."""
    new = Path(tempfile.mkdtemp(prefix=f"{PREFIX}new-", dir=top.parent))
    fd = os.open(new / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # gc leaves a copy being built alone
        etc = new / "etc"
        etc.mkdir()
        for name in names:
            source, target = Path("/etc", name), etc / name
            if source.is_dir():
                shutil.copytree(source, target, symlinks=True)
            else:
                shutil.copy2(source, target)
        for name, data in generated.items():
            (etc / name).write_bytes(data)
            os.chmod(etc / name, 0o644)
        for point, is_dir in points:  # what bwrap binds over the copy: a place to mount on
            target = etc / Path(point).relative_to("/etc")
            if not os.path.lexists(target):
                target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                target.mkdir(mode=0o755) if is_dir else target.touch(mode=0o644)
        for made in (etc, new):
            os.chmod(made, 0o755)
        try:
            os.rename(new, top)
        except OSError:  # another process named its copy first: use that one
            shutil.rmtree(new, ignore_errors=True)
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        os.close(fd)
        raise


def collect_stale(places: list[str]) -> list[str]:
    """Remove the copies in ``places`` that no process holds (and those whose building process
    died); returns their paths."""
    removed = []
    for top in (p for place in places for p in Path(place).glob(f"{PREFIX}*")):
        with contextlib.suppress(OSError):  # one being built gets a minute to lock itself
            if top.name.startswith(f"{PREFIX}new-") and time.time() - top.stat().st_mtime < 60:
                continue
        try:
            fd = os.open(top / "lock", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # held: in use
        else:
            shutil.rmtree(top, ignore_errors=True)
            removed.append(str(top))
        finally:
            os.close(fd)
    return removed
