"""Ids a script registers with ``envhub.register`` (the README's own example) reach every CLI
command through ``--import MODULE`` or ``ENVHUB_PLUGINS=MODULE``, and the processes those
commands start (check's new-process replay, the hub's workers) see them too.

Each test runs the real ``envhub`` script in a folder holding the script, as a user would:
the script's own folder is not on ``sys.path`` there, so the module is found the documented way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import envhub

MY_ENVS = '''\
import envhub

class Echo(envhub.TextEnv):
    """Repeats what you say; the episode ends when you say bye."""

    def on_reset(self, options):
        return "Say something.", {}

    def on_step(self, action):
        if not action.strip():
            return self.invalid_action("Say at least one word.")
        done = action.strip() == "bye"
        return envhub.Turn(f"You said: {action}", reward=float(done), terminated=done, success=done)

envhub.register("acme/echo-v0", entry_point=Echo, max_turns=5)
'''

ENVHUB = Path(sys.executable).with_name("envhub")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    if not ENVHUB.exists():
        pytest.skip(f"no envhub script next to {sys.executable} (pip install -e .)")
    (tmp_path / "my_envs.py").write_text(MY_ENVS)
    return tmp_path


def envhub_cli(folder: Path, *args: str, input: str | None = None, **environ: str):
    env = {k: v for k, v in os.environ.items() if k != "ENVHUB_PLUGINS"}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200", **environ)
    return subprocess.run(
        [str(ENVHUB), *args],
        cwd=folder,
        env=env,
        input=input,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_without_import_the_unknown_id_error_says_why_and_what_to_do(folder):
    result = envhub_cli(folder, "check", "acme/echo-v0")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "exist only in the process that ran it" in result.stderr
    assert "--import MODULE (or ENVHUB_PLUGINS=MODULE in the environment)" in result.stderr


@pytest.mark.timeout(180)
def test_check_with_import_passes_and_the_new_process_sees_the_id_too(folder):
    result = envhub_cli(folder, "check", "--import", "my_envs", "acme/echo-v0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "✓ check_new_process" in result.stdout  # played, not skipped
    assert "all 1 environment(s) passed" in result.stdout


@pytest.mark.timeout(180)
def test_info_play_and_eval_take_import_too(folder):
    info = envhub_cli(folder, "info", "acme/echo-v0", "--import", "my_envs")
    assert info.returncode == 0, info.stderr
    assert "Say something." in info.stdout
    played = envhub_cli(folder, "play", "--import", "my_envs", "acme/echo-v0", input="bye\nn\n")
    assert played.returncode == 0, played.stderr
    assert "Episode over: solved." in played.stdout
    evaluated = envhub_cli(
        folder, "eval", "--import", "my_envs", "acme/echo-v0", "--agent", "random",
        "--episodes", "1", "--json",
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert "acme/echo-v0" in evaluated.stdout


def test_the_envhub_plugins_variable_does_what_import_does(folder):
    listed = envhub_cli(folder, "list", "-n", "acme", ENVHUB_PLUGINS="my_envs")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("acme/echo-v0\t5\tmy_envs\t")


def test_importing_a_module_that_is_not_there_is_an_error_naming_it(folder):
    result = envhub_cli(folder, "check", "--import", "my_envz", "acme/echo-v0")
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error: --import my_envz: ModuleNotFoundError: No module named 'my_envz'"
    )


@pytest.mark.timeout(180)
def test_serve_with_import_serves_the_scripts_env_from_its_workers(folder):
    from tests.envhub.server.hubtools import TOKEN, envhub_serve

    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}
    environ.pop("ENVHUB_PLUGINS", None)
    args = ("--import", "my_envs", "--env", "acme/echo-v0", "--workers", "1")
    with envhub_serve(*args, env=environ) as (_proc, port):
        env = envhub.make("acme/echo-v0", hub=f"ws://127.0.0.1:{port}", token=TOKEN)
        try:
            messages, _info = env.reset(seed=0)
            assert messages[0]["content"] == "Say something."
            assert env.step("bye")[2] is True
        finally:
            env.close()
