"""``envhub play`` and ``envhub info`` when the env's own code fails: one clear line, as
``envhub check`` says it, never a traceback; ``play`` keeps the session so the player can
``:reset`` or ``:quit``, and cuts very long messages short with a note."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import envhub
from envhub.cli import main
from envhub.play import MAX_SHOWN_CHARS

BUGS = "tests.envhub.author_bugs"
IDS = {
    "errs/ctor-v0": "CannotBeBuilt",
    "errs/reset-v0": "RaisesOnReset",
    "errs/step-v0": "RaisesOnStep",
    "errs/huge-v0": "Huge",
    "errs/many-v0": "ManyLong",
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    for env_id, name in IDS.items():
        envhub.register(env_id, f"{BUGS}:{name}", max_turns=5)


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.mark.parametrize("command", ["play", "info"])
def test_a_constructor_error_is_one_line_naming_it_and_where(command):
    result = run(command, "errs/ctor-v0", input=":quit\n")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(
        "error: building the env raised ValueError: low must be below high, got low=500, "
        "high=100 (at author_bugs.py:"
    )
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_info_says_a_reset_error_in_one_line():
    result = run("info", "errs/reset-v0")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(
        "error: the env's reset(seed=0) raised RuntimeError: needs the DATA_DIR environment "
        "variable (at author_bugs.py:"
    )
    assert "envhub check errs/reset-v0" in result.stderr
    assert "Traceback" not in result.output


def test_play_says_a_reset_error_and_keeps_the_session():
    result = run("play", "errs/reset-v0", "--seed", "0", input="up\n:reset\n:quit\n")
    assert result.exit_code == 0, result.output
    said = "the env's reset(seed=0) raised RuntimeError: needs the DATA_DIR environment variable"
    assert said in result.output
    assert "no episode is running: :reset starts one, :quit leaves" in result.output
    assert "reset(seed=1) raised" in result.output  # :reset tried the next episode
    assert result.output.rstrip().endswith("bye")


def test_play_says_a_step_error_and_the_player_can_reset_and_win():
    typed = "boom\nanything\n:reset\n<answer>win</answer>\nn\n"
    result = run("play", "errs/step-v0", "--seed", "0", input=typed)
    assert result.exit_code == 0, result.output
    assert "the env's step() raised KeyError: 'best' (at author_bugs.py:" in result.output
    assert "this episode cannot go on: :reset or :quit" in result.output
    assert "no episode is running" in result.output  # "anything" was not sent to the env
    assert "Episode over: solved." in result.output
    assert "Traceback" not in result.output


def test_play_cuts_a_very_long_message_short_with_a_note():
    result = run("play", "errs/huge-v0", "--seed", "0", input=":quit\n")
    assert result.exit_code == 0, result.output
    assert f"(message truncated: showing the first {MAX_SHOWN_CHARS:,} of 300,000 characters)" in (
        result.output
    )
    assert result.output.count("x") < 2 * MAX_SHOWN_CHARS


def test_play_shows_at_most_so_much_of_one_observation_however_many_messages_hold_it():
    result = run("play", "errs/many-v0", "--seed", "0", input=":quit\n")
    assert result.exit_code == 0, result.output
    assert "(message truncated: showing the first 5,000 of 15,000 characters)" in result.output
    assert "(3 more message(s) not shown: too long)" in result.output
    assert result.output.count("y") < 2 * MAX_SHOWN_CHARS
