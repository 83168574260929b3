"""``python ray_reaper.py DRIVER_PID``: stop what a local Ray outlives its driver with.

``init_local_ray`` starts Ray inside the driver (``envhub train``). When the driver ends, or
is stopped by a signal it handles, Ray stops its processes; when it is killed outright
(``kill -9``, the OOM killer), the raylet and GCS exit but the dashboard agent and the
runtime-env agent (the raylet's children, renamed ``ray::DashboardAgent`` /
``ray::RuntimeEnvAgent``) run on forever, one pair per killed run.

This watcher runs beside the driver in a session of its own (so a Ctrl-C to the driver's
group does not stop it first). Every two seconds it notes the driver's descendants (pid and start
time, read from ``/proc``); once the driver is gone, however it ended, it gives them
``GRACE_S`` to exit, then SIGKILLs those still running: whatever the driver started and left
behind, Ray's or not (a pid reused by another process has another start time and is spared).
It imports nothing from the trainer. Linux only (``/proc``); elsewhere it exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

GRACE_S = 10.0
"""How long Ray's own processes get to exit after the driver died."""
POLL_S = 2.0

Stat = tuple[int, int, str]
"""A process's (parent pid, start time in clock ticks, state letter) from ``/proc/PID/stat``."""


def _stat(pid: int) -> Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # after "(comm)", which may hold spaces
    return int(fields[1]), int(fields[19]), fields[0]


def _processes() -> dict[int, Stat]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            found[int(entry.name)] = stat
    return found


def _descendants(root: int, table: dict[int, Stat]) -> dict[int, int]:
    """``root``'s descendants in ``table`` as pid -> start time."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found[pid] = table[pid][1]
        stack.extend(children.get(pid, []))
    return found


def _running(pid: int, started: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] == started and stat[2] != "Z"


def watch(driver: int, *, grace_s: float = GRACE_S, poll_s: float = POLL_S) -> list[int]:
    """Wait for ``driver`` to end, then kill its leftover descendants; return their pids."""
    known: dict[int, int] = {}
    while (stat := _stat(driver)) is not None and stat[2] != "Z":
        known.update(_descendants(driver, _processes()))
        known.pop(os.getpid(), None)  # the watcher is the driver's child too
        time.sleep(poll_s)
    deadline = time.monotonic() + grace_s
    while (left := [p for p, s in known.items() if _running(p, s)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(poll_s)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # it ended meanwhile
    return left


if __name__ == "__main__":
    if sys.platform.startswith("linux"):
        watch(int(sys.argv[1]))
