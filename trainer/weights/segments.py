"""The weight sync's POSIX shared-memory segments: made under names of a live owner, so what a
killed owner left is found and removed.

A segment holds buckets of the model's weights (up to a whole host copy of it) in RAM-backed
``/dev/shm``, and only its creator unlinks it (``SharedSegment.close``, ``SegmentPool.close``,
or Python's resource tracker). When the driver of a Ray run is killed hard (``kill -9``, the
OOM killer), Ray kills the trainer worker and its resource tracker together, and the segment
would stay until reboot - one per crash, each model-sized.

So every segment a process makes is named ``envhub-ws-<token>-<n>``, where ``<token>`` is the
process's own, and the process holds an exclusive ``flock`` on ``envhub-ws-<token>.lock`` for
its whole life (the lock file is made under a temporary name, locked, then renamed, so no other
process ever sees it unlocked); at a normal exit the lock file goes after the segments. Before
a process makes its first segment, :func:`collect_stale_segments` removes the segments of every
token whose lock file nobody holds or is gone: a lock dies with its process, whatever the PID
namespace, and a live owner's segments are never touched. Segments of other users are left
alone (``/dev/shm`` is sticky).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import secrets
import threading
from pathlib import Path
from typing import Any

__all__ = ["SHM_DIR", "attach_segment", "collect_stale_segments", "create_segment"]

SHM_DIR = Path("/dev/shm")
"""Where Linux keeps POSIX shared memory (``shm_open`` names are files here)."""

PREFIX = "envhub-ws-"

_CREATED: set[str] = set()  # segments this process created (and must keep registered for cleanup)
_lock = threading.Lock()
_owner: tuple[int, str, int] | None = None
"""``(pid, token, fd of the held lock file)`` of this process, made on first use."""
_count = 0


def _own_token() -> str:
    """This process's token, its lock file made and held on first use (after a fork: anew)."""
    global _owner
    if _owner is not None and _owner[0] == os.getpid():
        return _owner[1]
    token = secrets.token_hex(6)
    fd = -1
    if SHM_DIR.is_dir():
        temporary = SHM_DIR / f"{PREFIX}new-{token}"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(temporary, SHM_DIR / f"{PREFIX}{token}.lock")
        collect_stale_segments()
    _owner = (os.getpid(), token, fd)
    return token


def create_segment(size: int) -> Any:
    """A new ``multiprocessing.shared_memory.SharedMemory`` of ``size`` bytes (at least 1), named
    for this process (the first one also removes what dead owners left)."""
    from multiprocessing import shared_memory

    global _count
    with _lock:
        token = _own_token()
        _count += 1
        name = f"{PREFIX}{token}-{_count}"
    segment = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    _CREATED.add(segment.name)
    return segment


def attach_segment(name: str) -> Any:
    """Open an existing segment without adopting it: Python < 3.13 registers every opened segment
    with this process's resource tracker, which would unlink it when this process exits."""
    from multiprocessing import resource_tracker, shared_memory

    segment = shared_memory.SharedMemory(name=name)
    if name in _CREATED:  # our own (a receiver thread of the same process): registered already
        return segment
    # ``_name`` (private): the name with its leading "/", as ``SharedMemory`` registered it
    name_registered = segment._name  # type: ignore[attr-defined]
    try:
        resource_tracker.unregister(name_registered, "shared_memory")
    except OSError:  # the tracker process is gone: nothing is registered to undo
        pass
    return segment


def collect_stale_segments() -> list[str]:
    """Remove the segments of owners that are gone (their lock file unheld, or removed at their
    exit), and those lock files; returns the segments' names."""
    removed: list[str] = []
    try:
        names = [path.name[len(PREFIX) :] for path in SHM_DIR.glob(f"{PREFIX}*")]
    except OSError:
        return removed
    tokens = {name.split("-")[0].removesuffix(".lock") for name in names if name[:4] != "new-"}
    for token in sorted(tokens):
        lock = SHM_DIR / f"{PREFIX}{token}.lock"
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:  # its owner removed it at exit: what is left is stale
            fd = -1
        except OSError:  # not ours to open
            continue
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # held: its owner is alive
                    continue
            for segment in SHM_DIR.glob(f"{PREFIX}{token}-*"):
                with contextlib.suppress(OSError):  # another user's, or removed meanwhile
                    segment.unlink()
                    removed.append(segment.name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    lock.unlink()
        finally:
            if fd >= 0:
                os.close(fd)
    return removed


def _release_own_lock() -> None:
    """At exit: the lock file goes (the segments' own ``close`` unlinks them, or the next
    process's :func:`collect_stale_segments` does)."""
    if _owner is not None and _owner[0] == os.getpid() and _owner[2] >= 0:
        with contextlib.suppress(OSError):
            (SHM_DIR / f"{PREFIX}{_owner[1]}.lock").unlink()


# Registered at import, before any ``SharedSegment`` or ``SegmentPool`` registers its own close:
# exit handlers run last-registered first, so the lock goes only after the segments did.
atexit.register(_release_own_lock)
