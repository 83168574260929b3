"""Rollouts sampled at ``rollout.temperature`` != 1 train on-policy, with the async correction on.

The trainer takes its log-probs at the rollout temperature (``tests/trainer/strategies/
test_temperature.py``), so with ``top_p = 1`` the engine's sampled log-probs are valid old
log-probs: nothing is recomputed and ``async`` keeps its importance weights and staleness bound.
Only ``top_p < 1`` (a truncated distribution the trainer does not model) still recomputes them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.rollout.test_scheduler_pipeline import run
from trainer.config import load_config
from trainer.controller.batch import Batch
from trainer.pipeline import AgenticPipeline
from trainer.rollout.rollouts import Rollouts

SAMPLING = {"top_p=1": ["rollout.top_p=1.0"], "top_p=0.9": ["rollout.top_p=0.9"]}


class RecordingActor:
    """An actor whose recomputed log-probs are the behaviour ones plus ``shift``."""

    def __init__(self, shift: float) -> None:
        self.shift, self.calls = shift, 0

    def compute_logprobs(self, batch: Batch) -> Batch:
        self.calls += 1
        return Batch({"logprobs": batch["old_logprobs"] + self.shift})


def behaviour_batch() -> Batch:
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    return Batch({"old_logprobs": torch.full((2, 3), -1.5) * mask, "response_mask": mask})


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_old_logprobs_are_recomputed_only_under_top_p(sampling: list[str]) -> None:
    cfg = load_config(None, ["rollout.temperature=0.7", *sampling])
    actor, batch = RecordingActor(shift=0.25), behaviour_batch()
    sampled = batch["old_logprobs"].clone()
    pipeline: Any = SimpleNamespace(
        cfg=cfg,
        roles=SimpleNamespace(actor=actor, reference_logprobs=lambda batch: None),
        rollouts=SimpleNamespace(off_policy_correction=lambda batch, actor: None),
    )
    AgenticPipeline.reference_logprobs(pipeline, batch)
    recomputed = cfg.rollout.top_p < 1
    assert actor.calls == int(recomputed)
    expected = sampled + 0.25 if recomputed else sampled
    torch.testing.assert_close(batch["old_logprobs"], expected)


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_async_importance_weights_stay_on_away_from_temperature_one(sampling: list[str]) -> None:
    cfg = load_config(
        None,
        ["rollout.mode=async", "rollout.is_truncation=2.0", "rollout.temperature=0.7", *sampling],
    )
    rollouts: Any = SimpleNamespace(cfg=cfg, last_metrics={})
    actor, batch = RecordingActor(shift=0.25), behaviour_batch()
    Rollouts.off_policy_correction(rollouts, batch, actor)
    if cfg.rollout.top_p < 1:  # the pipeline recomputed old_logprobs: nothing left to weigh
        assert "is_weights" not in batch and actor.calls == 0
        return
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(
        batch["is_weights"][mask], torch.full((3,), float(torch.exp(torch.tensor(0.25))))
    )
    assert rollouts.last_metrics["rollout/is_weight_mean"] == pytest.approx(1.2840, abs=1e-4)


def test_async_run_at_temperature_weighs_stale_tokens_only(tmp_path: Path, monkeypatch) -> None:
    """A real ``async`` run sampled at T = 0.7 (evaluated at another temperature, which must not
    leak into training): tokens of the current policy get weight 1, as the engine's log-probs at
    T are the trainer's; stale ones do not."""
    deviation: list[float] = []
    correct = Rollouts.off_policy_correction

    def recording(self, batch, actor):
        correct(self, batch, actor)
        assert "is_weights" in batch, "no importance weights at temperature 0.7"
        deviation.append(
            float((batch["is_weights"][batch["response_mask"].bool()] - 1).abs().max())
        )

    monkeypatch.setattr(Rollouts, "off_policy_correction", recording)
    rows = run(
        tmp_path,
        "eval.temperature=0.3",
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "rollout.is_truncation=2.0",
        "rollout.temperature=0.7",
        "algorithm.loss.entropy_coef=0.05",
    )
    steps = [r for r in rows if r["step"] >= 1]
    assert len(deviation) == 3 and steps[0]["rollout/staleness_1"] == 0
    assert deviation[0] < 1e-4  # step 1: every token is the current policy's
    # later steps train stale tokens when an episode outlived a weight update (how many depends on
    # the threads' timing): those are weighed
    stale = [d for d, r in zip(deviation, steps, strict=True) if r["rollout/staleness_1"] > 0]
    assert all(d > 1e-3 for d in stale)
