"""Where a config problem's value came from: the override the user typed, not a file line above.

A section's own validator reports its problems at the section's path (``rollout.agent``); when
the bad value came from an override below that path, the problem names the override (it was
located at the file's enclosing ``rollout:`` line, which holds no such value)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def where(overrides: list[str], path: str, config: Path | None = QUICKSTART) -> str | None:
    with pytest.raises(ConfigError) as caught:
        load_config(config, overrides)
    [problem] = [p for p in caught.value.problems if p.path == path]
    return problem.where


def test_a_sections_problem_names_the_override_below_it() -> None:
    found = where(["rollout.agent.callable=my_agents"], "rollout.agent")
    assert found == "override 'rollout.agent.callable=my_agents'"


def test_a_problem_without_a_file_names_the_override_below_it() -> None:
    found = where(["rollout.agent.callable=my_agents"], "rollout.agent", config=None)
    assert found == "override 'rollout.agent.callable=my_agents'"


def test_a_value_from_the_file_keeps_its_line(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("rollout:\n  max_turns: 2\n  agent:\n    callable: my_agents\n")
    assert where([], "rollout.agent", config=config) == f"{config}:3"


def test_an_override_of_the_path_itself_still_wins() -> None:
    assert where(["train.lr=-1"], "train.lr") == "override 'train.lr=-1'"
