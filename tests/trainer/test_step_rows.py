"""What each ``metrics.jsonl`` row of a real (tiny) run says about its step: the time of every
phase, the checkpoint's included, and at step 0 the warm start's and the evaluation's; what was
played beside what was trained; and a row whose checkpoint was saved is never lost to a kill."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline


def config(tmp_path: Path, *overrides: str) -> Any:
    return load_config(
        QUICKSTART,
        [
            *TINY,
            "sft.epochs=1",
            "train.steps=2",
            "train.ppo_epochs=1",
            "eval.every=0",
            "checkpoint.every=0",
            f"output_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def rows(tmp_path: Path) -> list[dict[str, Any]]:
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_every_row_times_what_its_step_did_the_checkpoint_and_the_warm_start_included(
    tmp_path: Path,
) -> None:
    """Step 0 warm-starts, evaluates and checkpoints; step 1 only trains; step 2 (the last)
    trains, evaluates and checkpoints. Each row times the phases its step ran."""
    AgenticPipeline(config(tmp_path)).fit()
    zero, one, two = rows(tmp_path)
    assert {"timing/sft_s", "timing/eval_s", "timing/checkpoint_s"} <= zero.keys()
    assert "timing/checkpoint_s" not in one and "timing/eval_s" not in one
    assert {"timing/rollout_s", "timing/train_s", "timing/eval_s", "timing/checkpoint_s"} <= (
        two.keys()
    )


def test_a_batch_rows_played_figures_are_its_trained_ones_when_nothing_is_filtered(
    tmp_path: Path,
) -> None:
    """``rollout.mode: batch`` trains every group it plays: ``rollout/played_*`` then equals
    ``train/*``. Failures are counted as attempts and as lost episodes, under those names."""
    AgenticPipeline(config(tmp_path, "sft.epochs=0", "train.steps=1")).fit()
    step = rows(tmp_path)[1]
    assert step["rollout/played_episodes"] == step["train/episodes"] == 8
    assert step["rollout/played_success"] == pytest.approx(step["train/success"])
    assert step["rollout/played_reward"] == pytest.approx(step["train/reward"])
    assert step["rollout/played_turns"] == pytest.approx(step["train/turns"])
    assert step["rollout/failed_attempts"] == 0 and step["rollout/lost_episodes"] == 0
    assert "train/failed_episodes" not in step and "rollout/failed_episodes" not in step


class Killed(Exception):
    """Stands for a kill of the run's process."""


def test_a_run_killed_after_a_checkpoint_but_before_its_row_gets_the_row_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is saved before the row is written (the row times it): a kill in between
    must not leave the resumed run without that step's row."""
    original = AgenticPipeline.log_step

    def killed_at_step_1(self: AgenticPipeline, metrics: dict[str, Any]) -> None:
        if metrics["step"] == 1:
            raise Killed
        original(self, metrics)

    with monkeypatch.context() as patch:
        patch.setattr(AgenticPipeline, "log_step", killed_at_step_1)
        with pytest.raises(Killed):
            AgenticPipeline(config(tmp_path, "sft.epochs=0", "checkpoint.every=1")).fit()
    assert [row["step"] for row in rows(tmp_path)] == [0]
    cfg = config(tmp_path, "sft.epochs=0", "checkpoint.every=1")
    AgenticPipeline(cfg, resume=True).fit()
    recovered = rows(tmp_path)
    assert [row["step"] for row in recovered] == [0, 1, 2]
    assert "train/success" in recovered[1] and "actor/pg_loss" in recovered[1]
