"""``--resume`` refuses, before building anything, an algorithm change whose saved state is not
in the checkpoint: a KL term the run did not have (its warm-started anchor was never saved) and
a critic (GAE) the run did not train. The message names the setting and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_train_cli_refusals import Runs, previous_run, record_runs, train


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Runs:
    return record_runs(monkeypatch)


def test_adding_a_kl_term_to_a_warm_started_run_is_refused_naming_the_setting(
    tmp_path: Path, started: Runs
) -> None:
    """A fresh run anchors the KL to its warm-started policy; a run saved without a KL term kept
    no copy of it, so the resumed reference would be the untrained initial policy."""
    out = previous_run(tmp_path / "run", 4, "sft.epochs=24")  # (the quickstart has no KL term)
    result = train(
        f"output_dir={out}",
        "train.steps=8",
        "sft.epochs=24",
        "algorithm.loss.kl_coef=0.1",
        "--resume",
    )
    assert result.exit_code == 1, result.output
    assert f"cannot resume from {out / 'checkpoints' / 'step_00000004'}" in result.output
    assert "algorithm.loss.kl_coef: the run was saved without a KL term" in result.output
    assert "resume with algorithm.loss.kl_coef=0" in result.output
    assert "start a new run" in result.output
    assert not started


def test_adding_a_kl_term_without_a_warm_start_resumes(tmp_path: Path, started: Runs) -> None:
    """Without a warm start the anchor is the initial policy, which the resume loads too."""
    out = previous_run(tmp_path / "run", 4, "sft.epochs=0")
    result = train(f"output_dir={out}", "train.steps=8", "algorithm.loss.kl_coef=0.1", "--resume")
    assert result.exit_code == 0, result.output
    assert len(started) == 1


def test_a_kl_term_the_run_already_had_resumes(tmp_path: Path, started: Runs) -> None:
    out = previous_run(tmp_path / "run", 4, "sft.epochs=24", "algorithm.loss.kl_coef=0.05")
    result = train(
        f"output_dir={out}",
        "train.steps=8",
        "sft.epochs=24",
        "algorithm.loss.kl_coef=0.1",
        "--resume",
    )
    assert result.exit_code == 0, result.output
    assert len(started) == 1


def test_resuming_a_grpo_run_as_gae_is_refused_before_building(
    tmp_path: Path, started: Runs
) -> None:
    out = previous_run(tmp_path / "run")  # the quickstart: grpo, no critic
    result = train(
        f"output_dir={out}", "train.steps=8", "algorithm.advantage_estimator=gae", "--resume"
    )
    assert result.exit_code == 1, result.output
    assert "algorithm.advantage_estimator: the run was saved with grpo" in result.output
    assert "no critic" in result.output
    assert "resume with algorithm.advantage_estimator=grpo" in result.output
    assert not started


def test_dropping_the_critic_resumes(tmp_path: Path, started: Runs) -> None:
    """The saved critic is then not loaded; nothing the run needs is missing."""
    out = previous_run(tmp_path / "run", 4, "algorithm.advantage_estimator=gae")
    result = train(f"output_dir={out}", "train.steps=8", "--resume")
    assert result.exit_code == 0, result.output
    assert len(started) == 1
