"""The envhub CLI as a user types it (click's runner, in-process)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import envhub
from envhub.cli import main


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None):
        return runner.invoke(main, list(args), input=input, catch_exceptions=False)

    return invoke


def test_version_and_help(cli):
    assert cli("--version").output.strip() == f"envhub, version {envhub.__version__}"
    help_text = cli("--help").output
    for command in ("list", "info", "check", "play", "eval"):
        assert command in help_text
    assert "envhub play games/sokoban-v0" in help_text


def test_list_json_has_at_least_four_games(cli):
    result = cli("list", "--json")
    assert result.exit_code == 0
    envs = json.loads(result.output)["envs"]
    families = {row["family"] for row in envs if row["id"].startswith("games/")}
    assert len(families) >= 4
    assert {"games/sokoban-v0", "games/frozen-lake-v0", "games/wordle-v0"} <= {
        row["id"] for row in envs
    }


def test_list_table_and_filters(cli):
    output = cli("list", "--namespace", "games", "--no-variants").output
    assert "games/sokoban-v0" in output and "games/sokoban-8x8-v0" not in output


def test_info_shows_kwargs_and_first_observation(cli):
    result = cli("info", "games/guess-number-v0", "--json")
    data = json.loads(result.output)
    assert "high" in data["accepted_kwargs"] and data["max_turns"] == 10
    assert "games/guess-number-hard-v0" in data["variants"]
    assert data["first_observation"][0]["role"] == "user"


def test_unknown_id_exits_2_with_a_hint(cli):
    result = CliRunner().invoke(main, ["info", "games/sokobn-v0"])
    assert result.exit_code == 2
    assert "Did you mean 'games/sokoban-v0'" in result.output


def test_check_passes_and_bad_kwargs_are_explained(cli):
    result = cli("check", "games/guess-number-v0", "-k", "high=30")
    assert result.exit_code == 0 and "all 1 environment(s) passed" in result.output
    result = CliRunner().invoke(main, ["check", "games/guess-number-v0", "-k", "hihg=30"])
    assert result.exit_code == 2 and "did you mean 'high'?" in result.output
    result = CliRunner().invoke(main, ["check", "games/guess-number-v0", "-k", "oops"])
    assert result.exit_code == 2 and "is not key=value" in result.output


def test_check_in_worker_processes_reports_every_id_and_pins_a_crash_on_its_env():
    envhub.register("tests/bad-text-v0", "tests.envhub.test_checker:RaisesOnBadText", max_turns=3)
    envhub.register("tests/crashing-v0", "tests.helpers:CrashingEnv", max_turns=3)
    envhub.register("helpers/countdown-v0", "tests.helpers:CountdownEnv", max_turns=3)
    good = ["games/guess-number-v0", "helpers/countdown-v0", "games/frozen-lake-v0"]
    bad = ["tests/bad-text-v0", "tests/crashing-v0"]
    result = CliRunner().invoke(main, ["check", "--jobs", "2", *good, *bad])
    assert result.exit_code == 1, result.output
    # one block per id, in whatever order they finished
    headers = [line for line in result.output.splitlines() if line in good + bad]
    assert sorted(headers) == sorted(good + bad), result.output
    assert "2 of 5 environment(s) failed:" in result.output
    assert sorted(result.output.rsplit("failed:", 1)[1].strip().split(", ")) == bad
    crash_block = result.output.split("tests/crashing-v0\n", 1)[1]
    assert "the checker process died while checking this id" in crash_block.split("\n\n")[0]
    # a check that fails in a worker says what it says in this process
    alone = CliRunner().invoke(main, ["check", "tests/bad-text-v0"])
    failing = [line.strip() for line in alone.output.splitlines() if "✗" in line]
    assert failing and all(line in result.output for line in failing)


def test_check_without_ids_is_a_usage_error():
    result = CliRunner().invoke(main, ["check"])
    assert result.exit_code == 2 and "give one or more env ids, or --all" in result.output


def test_eval_compares_agents(cli):
    result = cli("eval", "games/guess-number-v0", "--episodes", "5", "--json")
    rows = {row["agent"]: row for row in json.loads(result.output)}
    assert rows["expert"]["success_rate"] == 1.0
    assert rows["random"]["success_rate"] < 1.0
    assert rows["random"]["episodes"] == 5


def test_play_from_piped_input(cli):
    result = cli("play", "games/guess-number-easy-v0", "--seed", "0", input=":hint\n10\n:quit\n")
    assert "between 1 and 20" in result.output
    assert "hint: <answer>10</answer>" in result.output
    assert "reward" in result.output and "bye" in result.output


def test_a_missing_optional_package_names_the_extra(monkeypatch):
    import envhub.cli

    monkeypatch.setitem(envhub.cli.LAZY_COMMANDS, "needs-ray", "tests.helpers:missing_ray_command")
    result = CliRunner().invoke(main, ["needs-ray"])
    assert result.exit_code == 2
    assert (
        "optional package 'ray'" in result.output and "pip install 'envhub[ray]'" in result.output
    )


def test_commands_run_torch_with_passive_openmp_waits(cli, monkeypatch):
    """Spinning OpenMP waiters took the cores of a loaded CPU machine from the working threads;
    every command sets the passive policy before torch loads, unless the user set one."""
    import os

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli("list")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli("list")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_list_piped_prints_one_whole_line_per_env(cli):
    """`envhub list | grep ...`: piped, a table squeezed to 80 columns broke every description
    over many lines; each env is one line (id, max turns, source, description, tab-separated)."""
    from envhub.registry import list_envs

    output = cli("list", "--namespace", "games").output
    specs = {s.id: s for s in list_envs("games")}
    lines = {line.split("\t")[0]: line.split("\t") for line in output.splitlines()}
    assert set(lines) == set(specs)
    sokoban = lines["games/sokoban-v0"]
    assert sokoban[3] == specs["games/sokoban-v0"].description
    assert lines["games/sokoban-8x8-v0"][3].startswith("variant of games/sokoban-v0: ")
