"""``envhub serve`` builds each env the way it was asked to (``-k KEY=VALUE``, per ``--env``) and
refuses, in one line and before it says "serving", an env that cannot be built."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import sys

import httpx
from click.testing import CliRunner

import envhub
from envhub.registry import register
from envhub.server.cli import serve
from tests.envhub.pool.hostile_envs import HOSTILE
from tests.envhub.server.hubtools import TOKEN, envhub_serve, running_hub

GUESS = "games/guess-number-v0"


def run_serve(*args: str) -> tuple[int, str]:
    """``envhub serve ARGS`` in this process, stopped where it would start serving (exit 99)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("envhub.server.cli.run", lambda *a, **k: sys.exit(99))
        result = CliRunner().invoke(serve, [*args, "--token", TOKEN])
    return result.exit_code, result.output


def test_kwargs_given_with_k_build_the_served_env():
    with envhub_serve("--env", GUESS, "-k", "high=1000", "--workers", "1") as (_, port):
        remote = envhub.make(GUESS, hub=f"ws://127.0.0.1:{port}", token=TOKEN)
        try:
            messages, _ = remote.reset(seed=0)
        finally:
            remote.close()
    assert "between 1 and 1000" in messages[-1]["content"]


def test_with_several_envs_each_k_names_its_env():
    code, output = run_serve("--env", GUESS, "--env", "games/wordle-v0", "-k", "high=1000")
    assert code == 2
    assert f"-k {GUESS}:high=1000" in output  # the form to use
    assert "serving" not in output


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("high", "'high' is not key=value"),
        ("games/wordle-v0:high=3", "names games/wordle-v0, which is not served"),
    ],
)
def test_malformed_k_flags_are_usage_errors(flag, expected):
    code, output = run_serve("--env", GUESS, "-k", flag)
    assert code == 2 and expected in output, output


def test_an_env_that_cannot_be_built_is_one_error_line_before_serving(tmp_path):
    flag = tmp_path / "refuse"
    flag.touch()
    register("test/ctor-fails-v0", HOSTILE.entry_point, kwargs={"refuse_while": str(flag)})
    code, output = run_serve("--env", GUESS, "--env", "test/ctor-fails-v0")
    assert code == 2
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith(
        "error: cannot serve test/ctor-fails-v0: building the env raised RuntimeError: the env "
    )
    assert "(at hostile_envs.py:" in lines[0]
    assert "serving" not in output and "Traceback" not in output


def test_a_k_flag_the_env_does_not_take_is_refused_before_serving():
    code, output = run_serve("--env", GUESS, "-k", "hihg=3")
    assert code == 2
    assert output.startswith(f"error: cannot serve {GUESS}: ")
    assert "hihg" in output and "did you mean" in output and "serving" not in output


def test_an_entry_point_that_does_not_import_is_refused_before_serving():
    register("test/no-module-v0", "tests.no_such_module:Env")
    code, output = run_serve("--env", "test/no-module-v0")
    assert code == 2 and "serving" not in output
    assert output.startswith("error: cannot serve test/no-module-v0: ")
    assert "tests.no_such_module" in output


def test_a_served_max_turns_kwarg_is_what_clients_are_told():
    with running_hub(envs=[GUESS], env_kwargs={GUESS: {"max_turns": 3}}) as hub:
        remote = envhub.make(GUESS, hub=hub.url, token=TOKEN)
        try:
            assert remote.max_turns == 3
            remote.reset(seed=0)
            for _ in range(3):
                assert not remote.done
                remote.step("<answer>0</answer>")
            assert remote.done and remote.turn == 3
        finally:
            remote.close()
        served = httpx.get(f"{hub.http}/v1/envs", headers={"Authorization": f"Bearer {TOKEN}"})
        assert served.json()["envs"][0]["max_turns"] == 3
