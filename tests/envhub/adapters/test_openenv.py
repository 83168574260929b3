"""OpenEnv env servers as envhub envs, through openenv-core's own client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="needs the openenv extra: pip install 'envhub[openenv]'")

import envhub
from envhub.errors import SourceConfigError, SourceConnectionError
from tests.envhub.adapters import openenv_apps
from tests.envhub.openai_servers import serve_app
from tests.envhub.pool.raycluster import free_port
from tests.helpers import process_alive

APP = "tests.envhub.adapters.openenv_apps:app"


def test_a_running_openenv_server_keeps_the_contract():
    with serve_app(openenv_apps.app) as url:
        make = lambda: envhub.make("openenv/remote-v0", base_url=url)
        envhub.check_env(make(), factory=make)
        env = make()
        messages, info = env.reset(seed=2)
        assert messages == [
            {"role": "user", "content": "Guess my number from 1 to 9; you have 3 tries."}
        ]
        assert info["openenv"] == url
        answers = [env.step(str(guess)) for guess in range(1, 10)[:3]]
        env.close()
    rewards = [reward for _, reward, _, _, _ in answers]
    assert answers[-1][2] or 1.0 in rewards  # it ended: a right guess, or out of tries


def test_success_is_a_full_final_reward_unless_a_threshold_says_otherwise():
    """OpenEnv's protocol says no more than reward and done, and this server pays 0.1 for a
    wrong final answer: by default only a full reward is a success; success_threshold= takes
    another convention (OpenEnv's own harness counts any positive final reward)."""
    with serve_app(openenv_apps.partial_credit_app) as url:
        env = envhub.make("openenv/remote-v0", base_url=url)
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step("Berlin")
        assert (reward, terminated, info["success"]) == (0.1, True, False)
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step("Paris")
        assert (reward, terminated, info["success"]) == (1.0, True, True)
        env.close()
        env = envhub.make("openenv/remote-v0", base_url=url, success_threshold=1e-9)
        env.reset(seed=0)
        assert env.step("Berlin")[4]["success"]
        env.close()
    with pytest.raises(SourceConfigError, match=r"success_threshold=nan.*a finite number"):
        envhub.make("openenv/remote-v0", base_url=url, success_threshold=float("nan"))


def test_an_openenv_app_runs_as_a_local_process_and_stops_at_close():
    env = envhub.make("openenv/local-v0", app=APP)
    first, _ = env.reset(seed=5)
    assert "Guess my number" in first[-1]["content"]
    env.step("5")
    pid = env._server._process.pid
    assert process_alive(pid)
    env.close()
    assert not process_alive(pid)


def test_a_server_that_is_down_or_speaks_another_protocol_is_named():
    port = free_port()
    env = envhub.make("openenv/remote-v0", base_url=f"http://127.0.0.1:{port}")
    with pytest.raises(
        SourceConnectionError, match=f"cannot reach the OpenEnv server at http://127.0.0.1:{port}"
    ):
        env.reset(seed=0)
    with serve_app(openenv_apps.no_schema_app) as url:
        env = envhub.make("openenv/remote-v0", base_url=url)
        with pytest.raises(
            SourceConnectionError, match="GET /schema with HTTP 404.*another OpenEnv"
        ):
            env.reset(seed=0)
    with serve_app(openenv_apps.no_websocket_app) as url:
        env = envhub.make("openenv/remote-v0", base_url=url)
        with pytest.raises(SourceConnectionError, match="refused a WebSocket session"):
            env.reset(seed=0)
    with pytest.raises(SourceConfigError, match="exactly one of base_url"):
        envhub.make("openenv/remote-v0")


@pytest.fixture(scope="module")
def echo_package(tmp_path_factory) -> Path:
    """OpenEnv's own template env (`openenv init echo_env`), pip-installed into a folder."""
    source = tmp_path_factory.mktemp("openenv-src")
    openenv = Path(sys.executable).with_name("openenv")
    subprocess.run(
        [str(openenv), "init", "echo_env"], cwd=source, check=True, capture_output=True, timeout=300
    )
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source / "echo_env"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return site


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_installed_openenv_env_package_gets_an_id_and_passes_the_checker(echo_package):
    """`pip install` of OpenEnv's template env: `envhub list` shows openenv/echo-v0 and
    `envhub check` passes on it (each env the checker builds starts its own server)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(echo_package), *sys.path])}
    listed = subprocess.run(
        [sys.executable, "-m", "envhub.cli", "list", "--source", "openenv", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    rows = {row["id"]: row for row in json.loads(listed.stdout)["envs"]}
    assert rows["openenv/echo-v0"]["kwargs"] == {"app": "echo_env.server.app:app"}
    checked = subprocess.run(
        [sys.executable, "-m", "envhub.cli", "check", "openenv/echo-v0"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
