"""What ``envhub eval`` prints: every number whole at any width (a table that fits, one
``key=value`` record per row on a narrow terminal, tab-separated lines when piped), rows labelled
for what was played, and a hint when a model's turns are all invalid actions."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="needs the openai extra: pip install -e '.[openai]'")
pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")

from click.testing import CliRunner, Result
from rich.console import Console

import envhub
import envhub.eval_cli
from envhub.cli import main
from tests.envhub.openai_servers import completion, scripted_server
from tests.helpers import CountdownEnv

LOOKUP = "tools/lookup-v0"
NO_EXPERT = "evalout/countdown-v0"
"""Say 'go' to win; has tools; ``expert_action()`` is the default None."""
envhub.register(NO_EXPERT, CountdownEnv, max_turns=3)


def eval_cli(*args: str, columns: int | None = None) -> Result:
    env = {"COLUMNS": str(columns)} if columns else {}
    return CliRunner().invoke(main, ["eval", *args], env=env)


def on_a_terminal(monkeypatch: pytest.MonkeyPatch, width: int) -> io.StringIO:
    """Make ``envhub eval`` print to a terminal ``width`` columns wide; returns what it shows."""
    shown = io.StringIO()
    terminal = Console(file=shown, force_terminal=True, width=width, color_system=None)
    monkeypatch.setattr(envhub.eval_cli, "console", terminal)
    return shown


def numbers(row: dict[str, Any]) -> list[str]:
    """The numbers of a summary row as the table writes them."""
    return [
        f"{row['success_rate']:.0%}",
        f"{row['pass_at_k']:.0%}",
        f"{row['pass_at_k_high']:.0%}",
        f"{row['mean_return']:+.2f}",
        f"{row['mean_turns']:.1f}",
        f"{row['invalid_rate']:.2f}",
        f"{row['mean_tokens_in']:,.0f}/{row['mean_tokens_out']:,.0f}",
    ]


def model_run(tmp_path: Path, *options: str, columns: int | None = None) -> tuple[Result, list]:
    """Two envs, two tries per seed, a model: every column the table can have but failures."""
    with scripted_server(lambda body: completion("<answer>0 0</answer>")) as server:
        result = eval_cli(
            LOOKUP, "games/sokoban-v0", "--model", server.url, "--episodes", "3",
            "--samples", "2", "--max-turns", "2", "--out", str(tmp_path), *options,
            columns=columns,
        )  # fmt: skip
    return result, json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.parametrize("width", [80, 100])
def test_a_narrow_terminal_shows_every_number_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    shown = on_a_terminal(monkeypatch, width)
    result, rows = model_run(tmp_path)
    assert result.exit_code == 0, result.output
    text = shown.getvalue()
    assert "…" not in text, text
    results = [line for line in text.splitlines() if not line.startswith("episodes: ")]
    assert max(len(line) for line in results) <= width  # (the paths' line may be longer)
    for row in rows:
        assert row["env_id"] in text and row["agent"] in text
        for number in numbers(row):
            assert number in text, (number, text)


def test_a_wide_terminal_keeps_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shown = on_a_terminal(monkeypatch, 200)
    result, rows = model_run(tmp_path)
    assert result.exit_code == 0, result.output
    text = shown.getvalue()
    assert "│" in text and "invalid/turn" in text and "…" not in text
    for number in numbers(rows[0]):
        assert number in text


def test_piped_output_is_one_tab_separated_line_per_row(tmp_path: Path) -> None:
    result, rows = model_run(tmp_path, columns=60)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if "\t" in line]
    header, *body = (line.split("\t") for line in lines)
    assert header[:4] == ["env", "agent", "episodes", "success"] and "invalid/turn" in header
    assert [cells[0] for cells in body] == [row["env_id"] for row in rows]
    for cells, row in zip(body, rows, strict=True):
        assert len(cells) == len(header)
        for number in numbers(row):
            assert any(number in cell for cell in cells), (number, cells)
    assert "…" not in result.stdout


def test_an_env_without_an_expert_is_not_labelled_expert_play() -> None:
    result = eval_cli(NO_EXPERT, "--episodes", "2", columns=200)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    expert_rows = [line for line in lines if "expert" in line]
    assert expert_rows and all("random" in line for line in expert_rows), result.stdout
    assert f"{NO_EXPERT} has no expert (expert_action() returned None)" in result.stderr
    played = eval_cli(NO_EXPERT, "--episodes", "2", "--json")
    rows = {row["agent"]: row for row in json.loads(played.stdout)}
    assert rows["expert"]["random_turn_rate"] == 1.0 and rows["random"]["random_turn_rate"] == 0


def test_a_model_whose_every_turn_is_invalid_gets_a_hint_naming_the_env_feedback() -> None:
    with scripted_server(lambda body: completion("I think I should go.")) as server:
        result = eval_cli(NO_EXPERT, "--model", server.url, "--episodes", "2", columns=200)
        short = eval_cli(NO_EXPERT, "--model", server.url, "--episodes", "1", "--max-turns", "1")
    assert result.exit_code == 0, result.output
    assert "invalid/turn" in result.stdout
    hint = [line for line in result.stderr.splitlines() if line.startswith("hint:")]
    assert len(hint) == 1, result.stderr
    assert NO_EXPERT in hint[0] and "every turn" in hint[0]
    assert "'I think I should go.' is not 'go'." in hint[0]  # the env's own feedback
    assert "format" in hint[0] and "--tools" in hint[0]
    assert "--max-tokens" not in hint[0]  # no reply was cut off (test_eval_strict_api.py)
    assert short.exit_code == 0 and "hint:" in short.stderr  # one turn, invalid: all invalid


def test_a_model_url_without_a_scheme_is_refused_naming_the_fix() -> None:
    result = eval_cli(NO_EXPERT, "--model", "127.0.0.1:18011/v1", "--episodes", "1")
    assert result.exit_code == 2
    assert "--model needs http:// or https://" in result.output
    assert "http://127.0.0.1:18011/v1" in result.output
    assert "is the server running" not in result.output


def test_tools_sent_natively_are_not_also_listed_in_the_env_prompt() -> None:
    with scripted_server(lambda body: completion("<answer>0 0</answer>")) as server:
        for mode in ("native", "auto", "text"):
            result = eval_cli(LOOKUP, "--model", server.url, "--episodes", "1", "--tools", mode)
            assert result.exit_code == 0, result.output
    native, auto, text = ((r["messages"][0]["content"], "tools" in r) for r in server.requests)
    assert native[1] and "You can call these tools" not in native[0]  # the template lists them
    assert auto[1] and "You can call these tools" in auto[0]  # a refusing server: text calls
    assert not text[1] and "You can call these tools" in text[0]
