"""``envhub train --import MODULE``: ids a script registers reach the trainer as they reach
every other command (``check``, ``play``, ``eval``, ...), and the processes it starts see them
through ``ENVHUB_PLUGINS``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
from click.testing import CliRunner

import trainer.cli
from envhub.cli import main

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
CHEAP = ["sft.epochs=0", "train.steps=0", "eval.episodes=2", "logging.progress=false"]
MY_ENVS = """\
import envhub

class Echo(envhub.TextEnv):
    def on_reset(self, options):
        return "Say something.", {}

    def on_step(self, action):
        done = action.strip() == "bye"
        return envhub.Turn(f"You said: {action}", reward=float(done), terminated=done)

envhub.register("acme/train-import-echo-v0", entry_point=Echo, max_turns=5)
"""


def test_train_takes_import_and_names_the_module_for_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_train_envs.py").write_text(MY_ENVS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ENVHUB_PLUGINS", raising=False)
    started: list[Any] = []

    def run(cfg: Any, resume: bool, console: Any) -> list[dict[str, Any]]:
        started.append((cfg, os.environ.get("ENVHUB_PLUGINS")))
        return [{"time_s": 1.0}]

    monkeypatch.setattr(trainer.cli, "_run", run)
    result = CliRunner().invoke(
        main,
        [
            "train", "--import", "my_train_envs", str(QUICKSTART), *CHEAP,
            "env.id=acme/train-import-echo-v0", "env.kwargs={}", f"output_dir={tmp_path / 'run'}",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [(cfg, plugins)] = started
    assert cfg.env.ids == ["acme/train-import-echo-v0"]
    assert plugins == "my_train_envs"  # what the run's worker processes load too


def test_a_module_that_is_not_there_is_refused_naming_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["train", "--import", "my_envz", str(QUICKSTART), *CHEAP, "--dry-run"]
    )
    assert result.exit_code == 2
    assert "error: --import my_envz: ModuleNotFoundError: No module named 'my_envz'" in (
        result.stderr
    )
