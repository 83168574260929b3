"""A throwaway two-node Ray cluster on this machine, torn down by pid.

``ray start --head`` plus a second ``ray start --address`` with its own custom resource,
both on 127.0.0.1, each with one CPU. Ray daemons may ignore SIGTERM, and ``ray stop
--force`` would also kill any other Ray instance on the machine, so teardown SIGKILLs
exactly the processes of this cluster: those whose command line names its temp dir or
GCS port, and their descendants.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        table[int(entry.name)] = (ppid, cmdline)
    return table


class TwoNodeCluster:
    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="envhub-ray-")
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        self.ray = str(Path(sys.executable).with_name("ray"))

    def start(self) -> None:
        common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
        self._run(
            [
                self.ray,
                "start",
                "--head",
                "--port",
                str(self.port),
                "--temp-dir",
                self.temp_dir,
                "--include-dashboard",
                "false",
                "--resources",
                json.dumps({"node1": 1}),
                *common,
            ]
        )
        self._run(
            [
                self.ray,
                "start",
                "--address",
                self.address,
                "--resources",
                json.dumps({"node2": 1}),
                *common,
            ]
        )

    def _run(self, command: list[str]) -> None:
        done = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                f"{done.stderr[-2000:]}"
            )

    def pids(self) -> set[int]:
        table = _processes()
        mine = {
            pid
            for pid, (_, cmd) in table.items()
            if self.temp_dir in cmd or f":{self.port} " in f"{cmd} "
        }
        mine.discard(os.getpid())
        grew = True
        while grew:  # add descendants (Ray's core workers, actors)
            grew = False
            for pid, (ppid, _) in table.items():
                if ppid in mine and pid not in mine and pid != os.getpid():
                    mine.add(pid)
                    grew = True
        return mine

    def stop(self) -> None:
        for _ in range(3):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
