"""Host-side resources of a local sandbox: a private uid, cgroups, a size-capped scratch tmpfs,
and symlink-safe file access into scratch.

Why each exists:

- **A uid per sandbox** (leased with ``flock`` so parallel processes never share one): the
  kernel counts RLIMIT_NPROC per uid, so a fork bomb in one sandbox cannot starve another, and
  one sandbox's processes cannot signal or ptrace another's.
- **cgroup v1 ``memory`` and ``pids``** (children of this process's own cgroups, where they are
  writable): a memory cap for the whole sandbox with an OOM-kill counter to report, a process
  cap that holds even for root-in-userns, and a list of every process to kill.
- **A tmpfs scratch** (``mount -t tmpfs -o size=``): a disk-fill attack fills at most
  ``Limits.disk_mb``, and ``reset()`` is an unmount.
- **``*at()`` file access with ``O_NOFOLLOW``**: the host reads and writes scratch as root, and
  the sandboxed program may have planted symlinks there (``ln -s /etc/shadow out.txt``). The
  same holds when it empties a warm sandbox's ``/tmp`` from outside (``empty_dir``), or looks at
  its ``/dev`` (``dir_listing``), through ``/proc/PID/root`` of the zygote.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import random
import signal
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from sandboxes.errors import SandboxError, SandboxFileError, ScratchFullError

__all__ = [
    "Cgroup",
    "DirListing",
    "UidLease",
    "dir_listing",
    "empty_dir",
    "is_root",
    "mount_tmpfs",
    "open_dir_at",
    "read_at",
    "unmount",
    "write_at",
]

UID_BASE = 200_000
UID_COUNT = 8192
LEASE_DIR = (
    Path("/run/envhub-sandbox-uids")
    if os.access("/run", os.W_OK)
    else Path("/tmp/envhub-sandbox-uids")
)


def _read_small(path: bytes) -> bytes:
    """A kernel file (cgroup, /proc) to its end. One read of such a file gives about a page
    (``cgroup.procs`` of a sandbox holding hundreds of processes is longer); reads of 64 KiB,
    not one large one, because a buffer over the allocator's mapping threshold costs a fresh
    mapping each time (~20 us, and these files are read on every run of a warm sandbox)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = [os.read(fd, 1 << 16)]
        while parts[-1]:
            parts.append(os.read(fd, 1 << 16))
        return b"".join(parts)
    finally:
        os.close(fd)


def is_root() -> bool:
    return os.geteuid() == 0


class UidLease:
    """An unused uid in [UID_BASE, UID_BASE+UID_COUNT), held until ``release()``."""

    def __init__(self) -> None:
        LEASE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        # (never the process's global random: envs that seed it, TextArena's and GEM's, keep
        # their own streams swapped in while they run: envhub.adapters.global_rng)
        start = random.SystemRandom().randrange(UID_COUNT)
        for i in range(UID_COUNT):
            uid = UID_BASE + (start + i) % UID_COUNT
            fd = os.open(LEASE_DIR / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise SandboxError(
            f"all {UID_COUNT} sandbox uids are in use; stop some sandboxes (leases in {LEASE_DIR})"
        )

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def stale_uid_lease(uid: int) -> Iterator[bool]:
    """Holds the lease on ``uid`` for the block if no live process does (yields True), so that
    nothing leases it while what a dead holder left is cleaned up; yields False if held."""
    try:
        fd = os.open(LEASE_DIR / f"{uid}.lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def _own_cgroup(controller: str) -> Path | None:
    """The writable cgroup v1 directory this process lives in for ``controller``, if any
    (looked up once per process: four lookups were a quarter of a sandbox's start)."""
    return _own_cgroup_of(os.getpid(), controller)


@functools.lru_cache(maxsize=8)
def _own_cgroup_of(pid: int, controller: str) -> Path | None:
    root = Path("/sys/fs/cgroup") / controller
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                here = root / path.lstrip("/")
                return here if here.is_dir() and os.access(here, os.W_OK) else None
    except OSError:
        return None
    return None


def cgroups_available() -> bool:
    return _own_cgroup("memory") is not None and _own_cgroup("pids") is not None


class Cgroup:
    """A memory+pids cgroup v1 pair named ``name`` under this process's own cgroups.

    ``parent`` nests it (limits of the parent still apply). ``delegate_uid`` may move
    processes in (its ``cgroup.procs`` is chowned), so an unprivileged launcher can join.
    """

    def __init__(
        self,
        name: str,
        *,
        memory_bytes: int | None = None,
        pids_max: int | None = None,
        parent: Cgroup | None = None,
        delegate_uid: int | None = None,
    ) -> None:
        self.dirs: dict[str, Path] = {}
        try:
            self._create(name, memory_bytes, pids_max, parent, delegate_uid)
        except BaseException:
            for path in self.dirs.values():
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise

    def _create(
        self,
        name: str,
        memory_bytes: int | None,
        pids_max: int | None,
        parent: Cgroup | None,
        delegate_uid: int | None,
    ) -> None:
        for controller in ("memory", "pids"):
            base = parent.dirs[controller] if parent else _own_cgroup(controller)
            if base is None:
                raise SandboxError(f"cgroup v1 {controller} controller is not writable here")
            path = base / name
            path.mkdir()
            self.dirs[controller] = path
            if delegate_uid is not None:
                for f in ("cgroup.procs", "tasks"):
                    os.chown(path / f, delegate_uid, -1)
        if memory_bytes is not None:
            (self.dirs["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):  # absent without swap accounting
                (self.dirs["memory"] / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):
                (self.dirs["memory"] / "memory.swappiness").write_text("0")
        if pids_max is not None:
            (self.dirs["pids"] / "pids.max").write_text(str(pids_max))
        self._procs = [os.fsencode(p / "cgroup.procs") for p in self.dirs.values()]
        self._oom_control: int | None = None
        """``memory.oom_control``, kept open: read at offset 0 again it is current (it is read
        before and after every warm run; an open costs ~20x a read). ``cgroup.procs`` is not:
        an open file keeps the list it first read."""

    @property
    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.dirs.values()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self._procs:  # read on every run of a warm sandbox: no pathlib here
            with contextlib.suppress(OSError):
                found.update(int(x) for x in _read_small(path).split())
        return found

    def oom_kills(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            if self._oom_control is None:
                path = self.dirs["memory"] / "memory.oom_control"
                self._oom_control = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            for line in os.pread(self._oom_control, 4096, 0).splitlines():
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
        return 0

    def kill_all(
        self, timeout: float = 5.0, exclude: set[int] | frozenset[int] = frozenset()
    ) -> bool:
        """SIGKILL every process in the cgroup (but ``exclude``) until none is left; forks race
        us, and pids.max bounds how many."""
        return kill_until_gone(lambda: self.pids() - exclude, timeout)

    def remove(self) -> None:
        if self._oom_control is not None:
            os.close(self._oom_control)
            self._oom_control = None
        self.kill_all()
        for path in self.dirs.values():
            for _ in range(200):  # rmdir fails with EBUSY until the killed tasks are reaped
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.005)


def kill_until_gone(find: Callable[[], set[int]], timeout: float) -> bool:
    """SIGKILL the pids ``find()`` returns until it returns none (forks race us); False if
    some survived ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = 0.0001  # a killed process is gone within microseconds when a CPU is free
    while True:
        pids = find()
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def kill_uid(uid: int, timeout: float = 5.0) -> bool:
    """SIGKILL every process whose real or effective uid is ``uid`` until none is left (a
    private leased uid: what a dead owner's sandbox left running, also outside its cgroups).
    False if some survived ``timeout``."""
    wanted = str(uid).encode()

    def processes() -> set[int]:
        found = set()
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/status", "rb") as f:
                        uids = next(line for line in f if line.startswith(b"Uid:")).split()[1:3]
                except (OSError, StopIteration):
                    continue
                if wanted in uids:
                    found.add(int(entry.name))
        return found

    return kill_until_gone(processes, timeout)


_libc = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2


def mount_tmpfs(path: Path, *, size_mb: int, uid: int, gid: int) -> None:
    """Mount a size-capped tmpfs at ``path``, owned by uid:gid, mode 0700 (needs CAP_SYS_ADMIN)."""
    opts = f"size={size_mb}m,mode=0700,uid={uid},gid={gid}".encode()
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def unmount(path: Path) -> None:
    if _libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not mounted / gone: nothing to do
            raise OSError(err, f"umount {path}: {os.strerror(err)}")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _parent_dir(
    root: Path, parts: tuple[str, ...], *, create: bool, owner: tuple[int, int] | None
) -> Iterator[int]:
    fd = os.open(root, _DIR_FLAGS)
    try:
        for i, name in enumerate(parts[:-1]):
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    missing = "/".join(parts[: i + 1])
                    raise SandboxFileError(
                        f"{'/'.join(parts)!r}: directory {missing!r} does not exist"
                    ) from None
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except OSError as e:  # (tmpfs: out of inodes)
                    if e.errno == errno.ENOSPC:
                        raise _full(parts) from None
                    raise
                if owner:
                    os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SandboxFileError(
                        f"{'/'.join(parts)!r}: {'/'.join(parts[: i + 1])!r} "
                        "is a symlink or not a directory; "
                        "scratch paths may not go through symlinks"
                    ) from None
                raise
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def _full(parts: tuple[str, ...]) -> ScratchFullError:
    return ScratchFullError(f"scratch is full writing {'/'.join(parts)!r}; raise Limits.disk_mb")


def write_at(
    root: Path, parts: tuple[str, ...], data: bytes, *, owner: tuple[int, int] | None
) -> None:
    """Write ``root/parts`` without following any symlink.

    New directories and the file are chowned to ``owner``. A full scratch (``ENOSPC``) raises
    ``ScratchFullError``, a symlink, directory or device in the way ``SandboxFileError``.
    """
    with _parent_dir(root, parts, create=True, owner=owner) as dfd:
        try:
            flags = (
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            )
            fd = os.open(parts[-1], flags, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise SandboxFileError(
                    f"{'/'.join(parts)!r} is a symlink, directory or device; cannot write it"
                ) from None
            if e.errno == errno.ENOSPC:
                raise _full(parts) from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxFileError(
                    f"{'/'.join(parts)!r} is not a regular file; cannot write it"
                )
            if owner:
                os.fchown(fd, *owner)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise _full(parts) from None
            raise
        finally:
            os.close(fd)


def read_at(root: Path, parts: tuple[str, ...]) -> bytes:
    """Read ``root/parts`` without following any symlink; only regular files."""
    with _parent_dir(root, parts, create=False, owner=None) as dfd:
        try:
            fd = os.open(
                parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd
            )
        except FileNotFoundError:
            raise SandboxFileError(f"{'/'.join(parts)!r} does not exist in scratch") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SandboxFileError(
                    f"{'/'.join(parts)!r} is a symlink; refusing to follow it"
                ) from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxFileError(f"{'/'.join(parts)!r} is not a regular file")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)


def open_dir_at(dir_fd: int, path: str) -> int:
    """Open directory ``path`` (``/``-separated, relative to ``dir_fd``) without following any
    symlink on the way; the caller closes the fd. Raises ``OSError`` (``ELOOP``, ``ENOTDIR``...)."""
    fd = os.dup(dir_fd)
    try:
        for name in (part for part in path.split("/") if part):
            nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


class _TooBig(Exception):
    pass


def empty_dir(dir_fd: int, *, max_entries: int = 100_000, max_depth: int = 256) -> bool:
    """Delete everything inside the directory ``dir_fd``, following no symlink (as root, in a
    tree a sandboxed program made: nothing may run there meanwhile). False when it could not:
    an entry that will not go, more than ``max_entries`` entries or ``max_depth`` levels (the
    caller then starts over some other way rather than spend unbounded time here)."""
    budget = [max_entries]

    def empty(fd: int, depth: int) -> None:
        with os.scandir(fd) as entries:
            names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for name, is_dir in names:
            budget[0] -= 1
            if budget[0] < 0 or (is_dir and depth >= max_depth):
                raise _TooBig
            if is_dir:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                try:
                    empty(sub, depth + 1)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)

    try:
        empty(dir_fd, 0)
    except (OSError, _TooBig):
        return False
    return not os.listdir(dir_fd)


DirListing = tuple[tuple[str, int, int, int, int, int, int, str], ...]
"""Each entry of a directory: name, mode (type included), owner, file system, inode, device
numbers, link target (``dir_listing``)."""


def dir_listing(dir_fd: int) -> DirListing:
    """The entries of the directory ``dir_fd``, sorted by name, following no symlink. Two
    listings differ when any entry was added, removed, replaced or changed. (Tuples, not text:
    this is read on every reset of a warm sandbox, and formatting was a third of its cost.)"""
    entries = []
    with os.scandir(dir_fd) as found:
        for entry in found:
            st = entry.stat(follow_symlinks=False)
            link = os.readlink(entry.name, dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) else ""
            owner, node = (st.st_uid, st.st_gid), (st.st_dev, st.st_ino, st.st_rdev)
            entries.append((entry.name, st.st_mode, *owner, *node, link))
    return tuple(sorted(entries))


DirState = tuple[int, int, int, tuple[tuple[str, bytes], ...]]
"""A directory's own mode, owner (uid, gid) and extended attributes (``dir_state``)."""


def dir_state(dir_fd: int) -> DirState:
    """What emptying the directory ``dir_fd`` leaves as a run set it: its own mode, owner and
    extended attributes (a workdir made unwritable, a note in an attribute)."""
    st = os.fstat(dir_fd)
    try:
        attrs = tuple((n, os.getxattr(dir_fd, n)) for n in sorted(os.listxattr(dir_fd)))
    except OSError:  # a file system without extended attributes
        attrs = ()
    return st.st_mode, st.st_uid, st.st_gid, attrs


def place_states(root_fd: int, paths: Sequence[str]) -> dict[str, DirState]:
    """``dir_state`` of each of ``paths`` under ``root_fd`` (following no symlink)."""
    states = {}
    for path in paths:
        fd = open_dir_at(root_fd, path)
        try:
            states[path] = dir_state(fd)
        finally:
            os.close(fd)
    return states


def empty_places(root_fd: int, places: Mapping[str, DirState]) -> bool:
    """Empty each directory of ``places`` (paths under ``root_fd``, following no symlink) and
    check that its own state is still the one ``places`` holds; its times start afresh (they
    could carry a note too). False when one could not be emptied or was changed."""
    for path, state in places.items():
        fd = open_dir_at(root_fd, path)
        try:
            if not empty_dir(fd) or dir_state(fd) != state:
                return False
            os.utime(fd)
        finally:
            os.close(fd)
    return True


def inet_sockets(proc_fd: int) -> int:
    """How many internet sockets (TCP, UDP, raw; open, orphaned, or in TIME_WAIT: the kernel
    keeps a closed connection with no process holding it) the network namespace of the process
    whose ``/proc`` directory is ``proc_fd`` counts, from its ``sockstat`` files (the
    namespace's own counters: listing ``net/tcp`` walks the whole host's table, ~2 ms); 0 when
    the namespace is the host's own (``network=True``: nothing of the sandbox's to find)."""
    if os.readlink("ns/net", dir_fd=proc_fd) == os.readlink("/proc/self/ns/net"):
        return 0
    count = 0
    for name in ("sockstat", "sockstat6"):
        fd = os.open(f"net/{name}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)
        try:
            text = os.read(fd, 1 << 16).decode()
        finally:
            os.close(fd)
        for line in text.splitlines():  # "TCP: inuse 0 orphan 0 tw 0 alloc 0 mem 0", ...
            fields = line.split()[1:]
            for key, value in zip(fields[::2], fields[1::2], strict=False):
                if key in ("inuse", "tw"):  # (orphan, alloc, mem: the host's, not its own)
                    count += int(value)
    return count


def unix_sockets_left(proc_fd: int, holders: Callable[[], Iterable[int]]) -> int:
    """How many UNIX sockets the network namespace of the process whose ``/proc`` directory is
    ``proc_fd`` lists (``net/unix``: the namespace's own table) that no process ``holders()``
    names has open: sockets held only by the kernel (a socket whose own fd is in flight in it, an
    SCM_RIGHTS cycle, lives with its name bound and what else is in flight until the kernel's
    unix garbage collector frees it, some time after its last process died), or by a process
    that should not be there. 0 when the namespace is the host's own, as ``inet_sockets``.

    Two readings, each asking ``holders()`` after the table, and only what both find unheld
    counts: a spared process that forks or opens or closes a socket meanwhile (the zygote
    forking its spare: a socketpair, one end for a child no earlier reading knew) holds what
    it holds by the second reading; a socket only the kernel holds is unheld in both."""
    if os.readlink("ns/net", dir_fd=proc_fd) == os.readlink("/proc/self/ns/net"):
        return 0
    unheld = _unheld_unix_sockets(proc_fd, holders)
    if unheld:
        unheld &= _unheld_unix_sockets(proc_fd, holders)
    return len(unheld)


def _unheld_unix_sockets(proc_fd: int, holders: Callable[[], Iterable[int]]) -> set[str]:
    """The inodes ``net/unix`` lists that no process ``holders()`` names (asked after the
    table is read) has an fd on."""
    fd = os.open("net/unix", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)
    try:
        text = b"".join(iter(functools.partial(os.read, fd, 1 << 16), b"")).decode()
    finally:
        os.close(fd)
    # "Num RefCount Protocol Flags Type St Inode [Path]": the inode is what an fd links to
    listed = {fields[6] for fields in map(str.split, text.splitlines()[1:]) if len(fields) > 6}
    named = holders()  # (asked either way: what it names is after the table)
    for pid in named if listed else ():
        with contextlib.suppress(OSError):  # (a process that is gone holds nothing)
            for name in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{name}")  # "socket:[INODE]"
                    if link.startswith("socket:["):
                        listed.discard(link[len("socket:[") : -1])
    return listed
