"""`envhub serve --backend ray --address HOST:PORT` through the CLI, against a cluster started with
`ray start --head --port=PORT` as the README says.

The head is started the user's way; the only extra flags keep it to this test (its own temp dir
and free ports, two CPUs). It gets its own token file (``RAY_AUTH_TOKEN_PATH``): a token exists,
so `ray start` turns on token authentication, as it does on any machine where a local Ray has
run before (that writes ``~/.ray/auth_token``). Joining by address then needs
``RAY_AUTH_MODE=token``; without it `envhub serve` must say so, not print a traceback.
Teardown kills exactly this cluster's processes (never `ray stop`, which kills everyone's).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

import httpx

from envhub.client import RemoteEnv
from envhub.pool.errors import RayConnectError
from tests.envhub.pool.raycluster import TwoNodeCluster, free_port
from tests.envhub.server.hubtools import TOKEN, envhub_serve
from tests.envhub.server.test_serve_cli import play_to_the_end

ENV = "games/guess-number-v0"


class ReadmeHead(TwoNodeCluster):
    """One head node, `ray start --head --port=PORT`, token authentication on (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_path = Path(self.temp_dir) / "auth_token"
        self.token_path.write_text(uuid.uuid4().hex)
        self.env = {
            **os.environ,
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_AUTH_MODE", None)  # as a user's shell has it
        self.said = ""

    def start(self) -> None:
        command = [
            self.ray,
            "start",
            "--head",
            f"--port={self.port}",  # the README's command; the rest is the test's own
            f"--temp-dir={self.temp_dir}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            "--disable-usage-stats",
        ]
        done = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=180, check=False
        )
        self.said = done.stdout + done.stderr
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}):\n{self.said[-3000:]}"
            )

    def titles(self) -> list[str]:
        """Process titles of this cluster's processes (actors are titled ``ray::ClassName``)."""
        found = []
        for pid in self.pids():
            try:
                found.append(
                    Path(f"/proc/{pid}/cmdline")
                    .read_bytes()
                    .split(b"\0")[0]
                    .decode(errors="replace")
                )
            except OSError:
                pass
        return found


@pytest.fixture(scope="module")
def head() -> Iterator[ReadmeHead]:
    cluster = ReadmeHead()
    try:
        cluster.start()
        assert "Token authentication is enabled" in cluster.said, cluster.said[-2000:]
        yield cluster
    finally:
        cluster.stop()
        assert not cluster.pids(), "the test cluster left processes behind"


def serve_once(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "envhub.cli",
        "serve",
        "--env",
        ENV,
        "--backend",
        "ray",
        *args,
        "--token",
        TOKEN,
        "--port",
        str(free_port()),
    ]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=180, check=False
    )


@pytest.mark.slow  # a `ray start` head and a serve process: ~30 s on the 2-core VM
def test_serve_joins_a_ray_start_cluster_by_address_and_drains_on_sigterm(head: ReadmeHead) -> None:
    env = {**head.env, "RAY_AUTH_MODE": "token"}  # the fix the README and the error give
    with envhub_serve(
        "--env",
        ENV,
        "--backend",
        "ray",
        "--address",
        f"127.0.0.1:{head.port}",
        "--workers",
        "2",
        env=env,
    ) as (proc, port):
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["workers_alive"] == 2
        # the pool's workers are actors of this cluster
        assert head.titles().count("ray::RayEnvHost") == 2
        remote = RemoteEnv(ENV, f"ws://127.0.0.1:{port}", token=TOKEN)
        remote.reset(seed=0)
        assert play_to_the_end(remote)["success"] is True  # a whole episode played on the cluster
        remote.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, (
            f"SIGTERM must drain and exit 0, got {proc.returncode}:\n{out[-3000:]}"
        )


@pytest.mark.slow
def test_serve_that_cannot_join_names_the_fix(head: ReadmeHead) -> None:
    # Ray's own retry budget (20 s by default): the same error, sooner
    env = {**head.env, "RAY_gcs_server_port_wait_time_s": "2"}
    # RAY_AUTH_MODE unset: no token is sent
    done = serve_once("--address", f"127.0.0.1:{head.port}", env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"error: could not join the Ray cluster at '127.0.0.1:{head.port}': "
        "it uses token authentication" in done.stderr
    )
    assert "set RAY_AUTH_MODE=token" in done.stderr and "Traceback" not in done.stderr, done.stderr[
        -3000:
    ]
    nobody = free_port()
    done = serve_once("--address", f"127.0.0.1:{nobody}", env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (
        f"error: could not join the Ray cluster at '127.0.0.1:{nobody}': "
        "nothing accepts connections" in done.stderr
    )
    assert "Use the address `ray start --head` printed" in done.stderr


def test_a_token_refusal_is_reported_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``ray.init`` raises when the cluster wants a token this process does not send."""
    from envhub.pool.ray import connect

    def refuse(**kwargs: object) -> None:
        try:
            raise ray.exceptions.AuthenticationError(
                "RPC error: InvalidAuthToken: Authentication token is missing"
            )
        except ray.exceptions.AuthenticationError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:6379") from cause

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with (
        socket.create_server(("127.0.0.1", 0)) as listening,
        pytest.raises(RayConnectError) as info,
    ):
        address = (
            f"127.0.0.1:{listening.getsockname()[1]}"  # something answers there (the probe passes)
        )
        connect(address)
    assert str(info.value).startswith(
        f"could not join the Ray cluster at '{address}': it uses token authentication"
    )
    assert "RAY_AUTH_MODE=unset" in str(info.value) and "set RAY_AUTH_MODE=token" in str(info.value)
