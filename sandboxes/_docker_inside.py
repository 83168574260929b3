"""What the docker backend runs *inside* a container: its uids and its shell scripts.

Each script uses the shell's builtins, ``find`` and ``ipcrm`` only, so any image with
``/bin/sh`` and those works. ``docker.py`` says when each runs and what it guarantees.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from sandboxes._docker_exec import KILL_ALL
from sandboxes.base import Limits, Sandbox

__all__ = [
    "CLEAN",
    "KEEPALIVE_USER",
    "LIVE_WHILE_STDIN",
    "NO_IPC_LEFT",
    "RUN_USER",
    "SCRATCH_OK",
    "SCRATCH_OWNER",
    "SESSION_USER",
    "SETUP",
    "WRAP",
    "WRITABLE",
    "container_spec",
]

RUN_USER, SESSION_USER, KEEPALIVE_USER = "1000:1000", "1001:1000", "65534:65534"
"""Runs, sessions and the container's keep-alive main process each have a uid, so ``kill -9 -1``
as one of them (a run's cleanup) never touches the others."""
SCRATCH_OWNER = "0:1000"
"""Who sets scratch's mode at start: its owner (no capability needed), in group 1000 so that
the setgid bit sticks. Root in the container has no capabilities: it cannot signal the others."""
LIVE_WHILE_STDIN = "while read -r _; do :; done"
"""The container's main process: it lives until its stdin closes, which the engine does when
our attached socket closes (``StdinOnce``), i.e. when ``stop()`` closes it or the process that
owns the sandbox dies, SIGKILLed included; ``auto_remove`` then removes the container. So a
sandbox never outlives its owner on the engine, and a ``stop()`` the engine did not answer
(down, hung) still takes effect once the engine sees the socket closed."""
WRAP = 'umask 002; exec "$@"'
"""The program *is* the exec's process: no wrapper of its uid that it could kill or stop."""
WRITABLE = (Sandbox.workdir, "/tmp", "/dev/shm", "/dev/mqueue")
"""Everything a run can write (each size-capped); ``reset()`` empties all of them."""
CLEAN = (
    KILL_ALL + "; ipcrm --all 2>/dev/null; find " + " ".join(WRITABLE) + " -mindepth 1 -delete 2>&1"
)
NO_IPC_LEFT = (
    "n=0; for f in /proc/sysvipc/msg /proc/sysvipc/sem /proc/sysvipc/shm; do "
    "while read -r line; do n=$((n+1)); done < $f; done; "
    '[ $n -le 3 ] || { echo "SysV IPC objects left"; exit 1; }'
)
"""Each /proc/sysvipc file has one header line: more than three lines in all means objects."""
SCRATCH_MODE = "3770"
"""Scratch is root's, group 1000 (runs and sessions write it), setgid (files stay group 1000)
and sticky: only its owner may chmod it, set its ACLs or its ``user.*`` xattrs, so nothing a
run does to scratch *itself* (mode 000 for the next user's files, a note) survives ``reset()``.
The cost of the sticky bit: a run cannot delete a file a session (uid 1001) made in scratch's
top level, nor the other way round (subdirectories are unaffected)."""
SCRATCH_OK = (
    f'[ -n "$(find {Sandbox.workdir} -maxdepth 0 -perm {SCRATCH_MODE} -uid 0 -gid 1000)" ] || '
    f'{{ echo "{Sandbox.workdir} is not mode {SCRATCH_MODE}, root:1000"; exit 1; }}'
)
"""Checked at start and by ``reset()``: an engine or image that gives scratch other metadata."""
SETUP = (
    f"chmod {SCRATCH_MODE} {Sandbox.workdir}; " + SCRATCH_OK + "; while read -r k v _; do "
    "case $k in Seccomp:) s=$v;; NoNewPrivs:) n=$v;; CapBnd:) b=$v;; esac; "
    'done < /proc/self/status; [ "$s" = 2 ] && [ "$n" = 1 ] && [ "$b" = 0000000000000000 ] || '
    '{ echo "Seccomp: ${s:-?}, NoNewPrivs: ${n:-?}, CapBnd: ${b:-?}"; exit 3; }'
)
"""Run as ``SCRATCH_OWNER`` (the tmpfs takes the image's mode for its root, whatever ``mode=``
says): scratch as ``SCRATCH_MODE`` says, and proof that the engine applied what the docstring
promises: a seccomp filter (mode 2), no-new-privileges, an empty capability bounding set."""


def container_spec(
    docker: Any, limits: Limits, *, cpus: float, volumes: Mapping[str, Any], label: str
) -> dict[str, Any]:
    """``containers.create`` keyword arguments (all but the image) for a sandbox's container:
    every limit of ``limits`` the engine enforces, the keep-alive, scratch and ``/tmp``.
    ``docker`` is the SDK module, ``label`` the sandbox's id (label ``envhub.sandbox``)."""
    lim = limits
    cpu = max(1, math.ceil(lim.cpu_time_s))
    ulimits = [
        docker.types.Ulimit(name="cpu", soft=cpu, hard=cpu + 1),
        docker.types.Ulimit(
            name="fsize", soft=lim.max_file_size_mb << 20, hard=lim.max_file_size_mb << 20
        ),
        docker.types.Ulimit(name="core", soft=0, hard=0),
        docker.types.Ulimit(name="nofile", soft=1024, hard=1024),
    ]
    place_mb = lim.place_mb
    disk = place_mb << 20
    ulimits.append(
        docker.types.Ulimit(name="msgqueue", soft=min(disk, 800 << 10), hard=min(disk, 800 << 10))
    )
    # SysV shm: place_mb in all; gone once no process holds it
    ipc_caps = {
        "kernel.shmmax": str(disk),
        "kernel.shmall": str(disk // os.sysconf("SC_PAGE_SIZE")),
        "kernel.shm_rmid_forced": "1",
    }
    return {
        "command": ["/bin/sh", "-c", LIVE_WHILE_STDIN],
        "stdin_open": True,  # and StdinOnce: the engine closes it when we detach
        "auto_remove": True,
        "init": True,
        "user": KEEPALIVE_USER,
        "working_dir": Sandbox.workdir,
        "hostname": "sandbox",
        "read_only": True,
        "network_mode": None if lim.network else "none",
        "ipc_mode": "private",
        "shm_size": f"{place_mb}m",
        "sysctls": ipc_caps,
        "mem_limit": f"{lim.memory_mb}m",
        "memswap_limit": f"{lim.memory_mb}m",
        "pids_limit": lim.max_processes + 2,  # + docker-init and the keep-alive shell
        "nano_cpus": int(cpus * 1e9),
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "ulimits": ulimits,
        "environment": {},
        "labels": {"envhub.sandbox": label},
        "volumes": volumes,
        "tmpfs": {
            Sandbox.workdir: f"rw,exec,size={place_mb}m,uid=0,gid=1000",
            "/tmp": f"rw,exec,size={place_mb}m,mode=1777",
        },
    }
