"""A real `envhub serve` process: sessions, fds and memory come back to baseline; SIGTERM drains
gracefully."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import os
import signal
import socket
import time
from pathlib import Path

import httpx
from websockets.exceptions import ConnectionClosed

from envhub.client import RemoteEnv
from envhub.server.errors import RemoteError, SessionLostError
from tests.envhub.server.hubtools import envhub_serve

TOKEN = "cli-test-token-42"
ENV = "games/guess-number-v0"


def children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    return (
        int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    )


def play_to_the_end(env: RemoteEnv) -> dict:
    low, high = 1, 100
    while True:
        guess = (low + high) // 2
        obs, _, terminated, truncated, info = env.step(f"<answer>{guess}</answer>")
        text = obs[-1]["content"].lower()
        if "higher" in text:
            low = guess + 1
        elif "lower" in text:
            high = guess - 1
        if terminated or truncated:
            return info


@pytest.fixture
def served():
    with envhub_serve(
        "--env", ENV, "--workers", "2", "--drain-timeout", "20", "--grace", "0.5", token=TOKEN
    ) as running:
        yield running


def test_serve_returns_to_baseline_and_drains_on_sigterm(served):
    proc, port = served
    http, hub = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}"
    workers = children(proc.pid)
    assert len(workers) == 2

    # Baseline after one warm-up session, then 30 more sessions (some refused, some dropped).
    warm = RemoteEnv(ENV, hub, token=TOKEN)
    warm.reset(seed=0)
    warm.close()
    time.sleep(0.5)
    base_fds, base_rss = fds(proc.pid), rss_mib(proc.pid)
    for i in range(30):
        if i % 3 == 0:
            with pytest.raises(RemoteError, match="unauthorized"):
                RemoteEnv(ENV, hub, token="wrong-token-000")
            continue
        env = RemoteEnv(ENV, hub, token=TOKEN)
        env.reset(seed=i)
        env.step("<answer>50</answer>")
        if i % 3 == 1:
            env.close()
        else:  # vanish: the hub reaps it after --grace
            env._link.ws.socket.shutdown(2)
            env._link.closed = True
    deadline = time.monotonic() + 10
    while httpx.get(f"{http}/health").json()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    health = httpx.get(f"{http}/health").json()
    assert health == {
        "status": "ok",
        "sessions": 0,
        "workers_alive": 2,
        "workers": 2,
        "problems": [],
    }
    assert children(proc.pid) == workers, "no worker was added or lost"
    assert fds(proc.pid) <= base_fds + 2, f"server fds {base_fds} -> {fds(proc.pid)}"
    assert rss_mib(proc.pid) < base_rss + 20, (
        f"server RSS {base_rss:.0f} -> {rss_mib(proc.pid):.0f} MiB"
    )

    # Drain: one session mid-episode, one idle between episodes.
    running = RemoteEnv(ENV, hub, token=TOKEN)
    running.reset(seed=1)
    running.step("<answer>50</answer>")
    idle = RemoteEnv(ENV, hub, token=TOKEN)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(f"{http}/health").status_code != 503:
        assert time.monotonic() < deadline, "health never reported draining"
        time.sleep(0.05)
    assert httpx.get(f"{http}/health").json()["status"] == "draining"
    with pytest.raises(RemoteError, match="draining"):
        RemoteEnv(ENV, hub, token=TOKEN)
    with pytest.raises((RemoteError, SessionLostError, ConnectionClosed)):
        idle.reset(seed=0)  # the idle session was closed at once
    info = play_to_the_end(running)  # the running episode finishes normally
    assert info["turn"] >= 2 and running.draining
    assert proc.wait(30) == 0, proc.stdout.read()
    assert "draining" in proc.stdout.read()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers), "workers outlived the server"


def _open_file_limit_128_of_512() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 512))


def soft_open_file_limit(pid: int) -> int:
    line = next(
        line
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
        if line.startswith("Max open files")
    )
    return int(line.split()[3])


def test_serve_raises_its_fd_limit_and_outlives_a_flood_of_silent_connections():
    """`envhub serve` lifts its soft open-file limit to the hard one; silent sockets beyond that
    limit cannot lock clients out."""
    with envhub_serve(
        "--env",
        ENV,
        "--workers",
        "1",
        "--backend",
        "inline",
        "--request-timeout",
        "60",
        token=TOKEN,
        preexec_fn=_open_file_limit_128_of_512,
    ) as (proc, port):
        assert soft_open_file_limit(proc.pid) == 512
        # more than the hub has fds
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(700)]
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=20).json()["status"] == "ok"
            env = RemoteEnv(ENV, f"ws://127.0.0.1:{port}", token=TOKEN)
            env.reset(seed=0)
            assert not play_to_the_end(env)["invalid_action"]
            env.close()
        finally:
            for sock in silent:
                sock.close()
