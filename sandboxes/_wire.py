"""What the host reads from inside a warm local sandbox, read as hostile input.

Two sources, both controlled (in the worst case) by code the sandbox runs:

- **replies** of the zygote and of its spawner (``_zygote.py``), on ``SOCK_SEQPACKET`` sockets:
  one fixed-size message each: a kind byte, a signed 32-bit value and the number of the run it
  answers. ``reply`` accepts that shape and nothing else: a longer or shorter message, a kind
  or value out of range, file descriptors attached (no buffer is offered for them, so the
  kernel closes them: they are never installed in the host) raise ``ProtocolError``, after
  which the host trusts neither process again; so does an answer to another run than the one
  under way. On the spawner's socket the kernel attaches the sender's pid (``SO_PASSCRED``):
  the host learns which process spawns commands from the kernel, never from a message body;
- **/proc** files of the processes a reset spares, read in one ``read`` each (``proc``).

``in_process`` decides which runs the zygote runs in its own forked interpreter.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "REQUEST",
    "ProtocolError",
    "Reply",
    "descendants",
    "in_process",
    "inherited",
    "io_priority",
    "proc",
    "proc_stat",
    "reply",
    "status_fields",
    "zygote_source",
]

REQUEST = struct.Struct("!cI")
"""``R`` and the run's number (the host's counter): a reply must carry the same number, so an
answer sent twice, or late, can never pass for the next run's."""
_REPLY = struct.Struct("!ciI")
_CREDENTIALS = struct.Struct("iII")
"""``struct ucred``: pid, uid, gid."""
_VALUES = {b"X": range(256), b"Y": range(256), b"F": range(4096), b"H": range(1)}
"""Kinds and their values: exit status (``Y``: and the spawner retires), fork errno, hello."""
_STARTUP_ENV = ("PATH", "LANG", "LANGUAGE", "TZ")
"""Variables (with every ``LC_*``) that shape a Python interpreter as it starts: a run forked
from the zygote has the zygote's, so a run that sets other values is exec'd instead."""


class ProtocolError(Exception):
    """The zygote or spawner sent something it never sends: it is no longer trusted."""


Reply = tuple[bytes, int, int, int]
"""``(kind, value, run number, sender pid)``; the pid is 0 where the socket passes no
credentials."""


def reply(sock: socket.socket, *, credentials: bool = False) -> Reply | None:
    """One message from ``sock`` (None at EOF); anything but the shape above raises
    ``ProtocolError``. ``credentials``: the socket has ``SO_PASSCRED`` set, and the message
    must carry exactly the kernel's record of its sender."""
    ancillary = socket.CMSG_SPACE(_CREDENTIALS.size) if credentials else 0
    data, cmsgs, flags, _ = sock.recvmsg(_REPLY.size + 1, ancillary)
    if not data:
        return None
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) != _REPLY.size:
        raise ProtocolError(f"a {len(data)}-byte message (flags {flags:#x})")
    pid = 0
    if credentials:
        if len(cmsgs) != 1 or cmsgs[0][:2] != (socket.SOL_SOCKET, socket.SCM_CREDENTIALS):
            raise ProtocolError(f"a message without its sender's credentials: {cmsgs!r}")
        pid = _CREDENTIALS.unpack(cmsgs[0][2][: _CREDENTIALS.size])[0]
    elif cmsgs:
        raise ProtocolError("a message with ancillary data")
    kind, value, run = _REPLY.unpack(data)
    if value not in _VALUES.get(kind, ()):
        raise ProtocolError(f"message {kind!r} {value}")
    return kind, value, run, pid


@functools.cache
def zygote_source() -> str:
    """The program the sandbox's ``python3 -I -c`` runs (``_zygote.py``, read once)."""
    return Path(__file__).with_name("_zygote.py").read_text()


def in_process(argv: Sequence[str], env: Mapping[str, str], zygote_env: Mapping[str, str]) -> bool:
    """Whether ``argv`` is ``python3 -I FILE ...`` or ``python3 -I -c CODE ...`` with the same
    interpreter-shaping environment as the zygote: then the zygote's fork runs it in place."""
    if len(argv) < 3 or argv[0] != "python3" or argv[1] != "-I":
        return False
    script = argv[2]
    if (script == "-c" and len(argv) < 4) or (script != "-c" and script[:1] in ("", "-")):
        return False
    keys = {k for k in (*env, *zygote_env) if k in _STARTUP_ENV or k.startswith("LC_")}
    return all(env.get(k) == zygote_env.get(k) for k in keys)


def proc(pid: int, name: str) -> str:
    """``/proc/PID/NAME`` in one read (small files: status, stat, limits)."""
    fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)


def status_fields(text: str, names: Iterable[str]) -> dict[str, str]:
    """The fields ``names`` (``State``, ``TracerPid``, ``SigPnd``...) of ``/proc/PID/status``
    text as ``{field: value}``, leaving out those it lacks. Only the fields asked for: parsing
    all ~55 lines was a third of what checking a warm sandbox between users cost."""
    found = {}
    for name in names:
        line = _line_of(text, f"{name}:\t")
        if line:
            found[name] = line[len(name) + 2 :]
    return found


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: ``[0]`` state, ``[1]`` parent,
    ``[16]`` nice, ``[19]`` start time, ``[38]`` policy. Raises ``OSError`` when it is gone."""
    try:
        return proc(pid, "stat").rsplit(")", 1)[1].split()
    except IndexError:
        raise OSError(f"/proc/{pid}/stat is not what the kernel writes") from None


_IOPRIO_GET = {"x86_64": 252, "aarch64": 31}
"""``ioprio_get``'s system call number (glibc has no wrapper) by machine."""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def io_priority(pid: int) -> int:
    """``pid``'s I/O priority (class and level, as ``ioprio_get`` gives it); -1 where this
    machine's system call number is not known or the call failed."""
    number = _IOPRIO_GET.get(platform.machine())
    return -1 if number is None else int(_libc().syscall(number, 1, pid))  # 1: a process


def inherited(pid: int, status: str | None = None) -> dict[str, str]:
    """What every process ``pid`` starts inherits from it and a process of the same uid could
    change through its pid (``prlimit``, ``setpriority``, ``sched_setaffinity``,
    ``sched_setscheduler``, ``sched_setattr``, ``ioprio_set``): rlimits, nice, CPU affinity,
    scheduling policy and time slice, I/O priority; and its start time (a process of a run that
    got the pid of one it killed is another process). Empty when ``pid`` is gone."""
    try:
        stat = proc_stat(pid)
        limits = proc(pid, "limits")
        status = proc(pid, "status") if status is None else status
    except OSError:
        return {}
    try:  # (a kernel built without scheduler debugging has no such file)
        sched = proc(pid, "sched")
    except OSError:
        sched = ""
    return {
        "limits": limits,
        "nice": stat[16],
        "start": stat[19],
        "policy": stat[38],
        "cpus": _line_of(status, "Cpus_allowed_list:"),
        "slice": _line_of(sched, "se.slice"),
        "io": str(io_priority(pid)),
    }


def _line_of(text: str, prefix: str) -> str:
    """The first line of ``text`` that starts with ``prefix`` ("" if none)."""
    if text.startswith(prefix):
        start = 0
    else:
        start = text.find(f"\n{prefix}") + 1
        if not start:
            return ""
    end = text.find("\n", start)
    return text[start:] if end < 0 else text[start:end]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before children."""
    out, i = [pid], 0
    while i < len(out):
        try:
            tasks = os.listdir(f"/proc/{out[i]}/task")
        except OSError:
            tasks = []
        for task in tasks:
            try:
                out += [int(x) for x in proc(out[i], f"task/{task}/children").split()]
            except (OSError, ValueError):
                continue
        i += 1
    return out[1:]
