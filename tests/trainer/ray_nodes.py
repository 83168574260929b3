"""Start and stop a real multi-node Ray cluster on this machine with ``ray start`` subprocesses.

Every node listens on a loopback address and declares its own ``envhub_device`` count.
``ray stop`` would kill every Ray process on the machine, including other people's; here we
end only the processes of *this* cluster: those whose command line names its temp dir or its
GCS address, and their children.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_IP = "127.0.0.2"  # Ray keeps this loopback address (it rewrites 127.0.0.1 to the host's IP)
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((NODE_IP, 0))
        return int(sock.getsockname()[1])


@dataclass
class RayNodes:
    """A running cluster: its address and what identifies its processes."""

    address: str
    temp_root: Path
    env: dict[str, str]
    pids: set[int] = field(default_factory=set)

    def stop(self) -> None:
        """Kill this cluster's processes (by pid) and remove its temp dir."""
        kill_ray_processes(self.temp_root, self.address)


def kill_ray_processes(temp_root: Path, address: str | None = None) -> None:
    """Kill the Ray processes whose command line names ``temp_root`` (or the GCS ``address``), and
    their children, then remove ``temp_root``. Other Ray instances on the machine are left alone."""
    import psutil

    # Our temp dir (unique), or our GCS address not followed by more digits (1234 is not 12345).
    patterns = [re.escape(str(temp_root) + "/")] + (
        [f"{re.escape(address)}(?!\\d)"] if address else []
    )
    mine = re.compile("|".join(patterns))
    victims: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if mine.search(cmdline):
            victims[proc.pid] = proc
            try:
                for child in proc.children(recursive=True):
                    victims[child.pid] = child
            except psutil.Error:
                pass
    victims.pop(os.getpid(), None)
    for proc in victims.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(victims.values()), timeout=10)
    shutil.rmtree(temp_root, ignore_errors=True)


def start_ray_nodes(
    devices_per_node: list[int], num_cpus: int = 1, timeout: float = 240.0
) -> RayNodes:
    """``ray start --head`` plus one ``ray start --address`` per further node."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    # short: Ray's socket paths are long
    temp_root = Path(tempfile.mkdtemp(prefix="ehr-", dir="/tmp"))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    address = f"{NODE_IP}:{port}"
    nodes = RayNodes(address, temp_root, env)
    common = [f"--node-ip-address={NODE_IP}", f"--num-cpus={num_cpus}", "--disable-usage-stats"]
    try:
        for i, count in enumerate(devices_per_node):
            where = (
                ["--head", f"--port={port}", "--include-dashboard=false"]
                if i == 0
                else [f"--address={address}"]
            )
            cmd = [
                ray_bin,
                "start",
                *where,
                *common,
                f'--resources={{"envhub_device": {count}}}',
                f"--temp-dir={temp_root / f'n{i}'}",
            ]
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
                )
    except BaseException:
        nodes.stop()
        raise
    return nodes


def wait_for_nodes(count: int, timeout: float = 120.0) -> None:
    """Wait until ``count`` nodes are alive in the connected cluster."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(1 for n in ray.nodes() if n.get("Alive")) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(
        f"only {sum(1 for n in ray.nodes() if n.get('Alive'))} of {count} Ray nodes came up"
    )
