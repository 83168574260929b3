"""A third-party package, pip-installed on its own, shows up through its entry point alone.

The package is built from source in a temp folder and installed with pip into a separate
target folder (nothing touches the project's venv); the CLI then runs with that folder on
PYTHONPATH, exactly as it would after `pip install acme-envs`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-envs"
version = "0.1.0"

[project.entry-points."envhub.envs"]
acme = "acme_envs:register"
acme-broken = "acme_envs:missing_register_function"
"""

MODULE = '''\
"""An envhub plugin: one good env, one that breaks the contract, one plugin that fails."""
import random

import envhub


class Echo(envhub.TextEnv):
    """Repeats what you say; ends when you say bye."""

    def on_reset(self, options):
        return "Say something.", {}

    def on_step(self, action):
        done = action.strip() == "bye"
        return envhub.Turn(
            f"You said: {action}", reward=1.0 if done else 0.0, terminated=done, success=done
        )


class Flaky(Echo):
    """Deliberately broken: its first observation ignores the seed."""

    def on_reset(self, options):
        return f"Secret {random.random()}", {}


def register():
    envhub.register(
        "acme/echo-v0", entry_point="acme_envs:Echo", max_turns=5, description="Echo echo."
    )
    envhub.register("acme/flaky-v0", entry_point="acme_envs:Flaky", max_turns=5)
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("acme-src")
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "acme_envs.py").write_text(MODULE)
    target = tmp_path_factory.mktemp("site")
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
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    return target


def run(plugin_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")]),
    }
    envhub_cli = Path(sys.executable).with_name("envhub")
    return subprocess.run(
        [str(envhub_cli), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_installed_plugin_is_listed_and_the_broken_one_reported(plugin_path):
    result = run(plugin_path, "list", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    by_id = {row["id"]: row for row in listing["envs"]}
    assert by_id["acme/echo-v0"]["source"] == "acme"
    assert by_id["acme/echo-v0"]["description"] == "Echo echo."
    assert "games/sokoban-v0" in by_id  # a broken plugin does not hide the others
    [failure] = listing["plugin_errors"]
    assert failure["name"] == "acme-broken" and "missing_register_function" in failure["error"]


def test_installed_plugin_env_is_made_through_envhub_make(plugin_path):
    code = textwrap.dedent(
        """
        import warnings, envhub
        warnings.simplefilter("ignore")
        env = envhub.make("acme/echo-v0")
        env.reset(seed=0)
        print(env.step("bye")[4]["success"], env.max_turns)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(plugin_path)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "5"]


def test_check_passes_a_good_plugin_env_and_fails_a_broken_one(plugin_path):
    good = run(plugin_path, "check", "acme/echo-v0")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "all 1 environment(s) passed" in good.stdout
    bad = run(plugin_path, "check", "acme/flaky-v0")
    assert bad.returncode == 1
    assert "✗ check_seed_determinism" in bad.stdout
    assert "draw every random choice from self.np_random" in bad.stdout
