"""The seccomp filter every local sandbox runs under: a short deny list, compiled by libseccomp.

Why a filter at all: namespaces and a private uid keep sandboxed code away from the host, but
not from the processes *of its own sandbox* that outlive a run — the warm executor, and in
``unshare`` mode every later sandbox that leases the same uid. These syscall families would
let one user's code reach the next user through them, or hold memory no cap bounds, so they
are denied outright:

- **Process memory of others**: ``ptrace``, ``process_vm_readv``/``process_vm_writev``,
  ``pidfd_getfd`` (take over a spared process, rewrite what it runs after ``reset()``).
  Opening ``/proc/PID/mem`` is not a syscall of its own; it is stopped by the executor being
  non-dumpable and PID 1 of its namespace (see ``_executor.py``).
- **Kernel keyrings**: ``add_key``, ``keyctl``, ``request_key``. Keyrings are not files, so
  ``reset()`` cannot empty them; the user keyring stays on a uid across sandboxes, and the
  host's session keyring is inherited by every process it starts.
- **SysV IPC** (``shmget``, ``msgget``, ``semget``...): kernel memory that no tmpfs cap bounds
  (``disk_mb`` never applies; without cgroups nothing does), in objects that are not files.
  POSIX shared memory and semaphores (files in the capped ``/dev/shm``) and POSIX message
  queues (``/dev/mqueue``, emptied on reset) are what programs use instead, and they work.
- **Kernel surface no sandboxed program needs** (as Docker's default profile does): BPF,
  perf events, userfaultfd, io_uring, module and kexec loading, mount and namespace calls,
  swap, reboot, accounting, quotas, raw I/O ports, handle-based opens.

Every denied call fails with ``EPERM``, which programs handle as "not allowed here". Calls
from another ABI (i386 ``int 0x80``, x32) kill the process: the filter only speaks the native
one, so they could otherwise bypass it.

The program is compiled by libseccomp (the library bubblewrap, Docker and systemd use) through
its ctypes binding ``pyseccomp``, once per process, and handed to bubblewrap (``--seccomp``)
or installed by :data:`LOADER_SOURCE` in ``unshare`` mode. Where libseccomp is missing,
:func:`program` returns None and ``LocalSandbox.protections`` says the filter is off.
"""

from __future__ import annotations

import errno
import functools
import os

__all__ = ["DENIED_SYSCALLS", "LOADER_SOURCE", "memfd", "program", "unavailable_reason"]

DENIED_SYSCALLS: tuple[str, ...] = (
    # memory and fds of other processes
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    # kernel keyrings
    "add_key",
    "keyctl",
    "request_key",
    # SysV IPC: memory no tmpfs cap bounds, objects outside any file system (POSIX shm in the
    # capped /dev/shm, POSIX semaphores and message queues work instead)
    "shmget",
    "shmat",
    "shmctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semctl",
    "semtimedop",
    # kernel surface
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "unshare",
    "setns",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "iopl",
    "ioperm",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "syslog",
    "vhangup",
)
"""Syscalls a sandboxed program may not make (each fails with EPERM); see the module docstring."""

_KEYCTL_NR = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine, -1)

LOADER_SOURCE = r"""
import ctypes, os, sys
KEYCTL_NR = @KEYCTL_NR@
prog = bytes.fromhex(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(prog, len(prog))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
libc.syscall(KEYCTL_NR, 1, None)  # KEYCTL_JOIN_SESSION_KEYRING: drop the host's session keyring
if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
    err = os.strerror(ctypes.get_errno()).encode()
    os.write(2, b"envhub: cannot install the seccomp filter: %s\n" % err)
    os._exit(125)
os.execvp(sys.argv[2], sys.argv[2:])
""".replace("@KEYCTL_NR@", str(_KEYCTL_NR))
"""``python3 -I -S -c LOADER_SOURCE HEX ARGV...``: join a fresh session keyring (so the host's
is no longer possessed), set no_new_privs, install the filter, exec ARGV (``PR_SET_NO_NEW_PRIVS``
= 38, ``PR_SET_SECCOMP`` = 22 with ``SECCOMP_MODE_FILTER`` = 2)."""


@functools.cache
def _compiled() -> tuple[bytes | None, str]:
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: libseccomp.so not found
        return None, (
            f"libseccomp is unavailable ({e}); install it (apt-get install -y libseccomp2) "
            "and pip install pyseccomp"
        )
    filt = seccomp.SyscallFilter(seccomp.ALLOW)
    filt.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for name in DENIED_SYSCALLS:
        try:
            filt.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (OSError, ValueError):
            continue  # not a syscall on this architecture (e.g. iopl on aarch64)
    with os.fdopen(os.memfd_create("envhub-seccomp", os.MFD_CLOEXEC), "w+b") as tmp:
        filt.export_bpf(tmp)  # libseccomp writes to the fd itself
        tmp.seek(0)
        return tmp.read(), ""


def program() -> bytes | None:
    """The compiled BPF program (raw ``struct sock_filter`` array), or None without libseccomp."""
    return _compiled()[0]


def unavailable_reason() -> str:
    """Why :func:`program` is None ("" when the filter is available)."""
    return _compiled()[1]


def memfd(name: str, data: bytes) -> int:
    """A sealed-size anonymous file holding ``data``, positioned at 0 (for ``bwrap --seccomp FD``,
    ``--ro-bind-data FD``): the caller passes it to the child and closes it after the spawn."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
