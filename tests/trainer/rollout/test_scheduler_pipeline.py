"""The scheduler inside AgenticPipeline: ``rollout.mode`` sync and async train real steps."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline


def run(tmp_path: Path, *overrides: str) -> list[dict]:
    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            "train.steps=3",
            "train.ppo_epochs=1",
            "sft.epochs=0",
            "eval.episodes=4",
            "eval.every=0",
            f"output_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )
    return AgenticPipeline(cfg).fit()


# decoupled: an entropy bonus moves the policy every step even when every reward in a group ties
# (an untrained policy's), so one-step-stale tokens really are off-policy and their weights show it.
@pytest.mark.parametrize(
    "correction",
    [[], ["rollout.is_truncation=2.0", "algorithm.loss.entropy_coef=0.05"]],
    ids=["behaviour-anchor", "decoupled"],
)
def test_async_training_within_the_staleness_bound(
    tmp_path: Path, correction: list[str], monkeypatch
) -> None:
    from trainer.rollout.rollouts import Rollouts

    # per step: the largest |w - 1| of a policy token's importance weight
    deviation: list[float] = []
    correct = Rollouts.off_policy_correction

    def recording(self, batch, actor):
        correct(self, batch, actor)
        if "is_weights" in batch:
            mask = batch["response_mask"].bool()
            deviation.append(float((batch["is_weights"][mask] - 1.0).abs().max()))

    monkeypatch.setattr(Rollouts, "off_policy_correction", recording)
    rows = run(tmp_path, "rollout.mode=async", "rollout.max_staleness=1", *correction)
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3] and rows[-1]["eval/success"] is not None
    for r in steps:
        lags = {
            int(k.rsplit("_", 1)[1]): v for k, v in r.items() if k.startswith("rollout/staleness_")
        }
        # nothing older than the bound was trained
        assert max(k for k, v in lags.items() if v > 0) <= 1
        assert "actor/pg_loss" in r
        if not correction:
            assert "rollout/is_weight_mean" not in r and deviation == []
        elif lags.get(1, 0) == 0:
            # all tokens from the current policy: the recomputed log-probs are the sampled ones
            assert deviation[r["step"] - 1] < 1e-4, r["step"]
        else:
            # one version behind: the weights measure how far the policy moved since sampling
            assert deviation[r["step"] - 1] > 1e-3, r["step"]
    if correction:
        # both cases were seen: step 1 has nothing older, a later step trained stale tokens
        assert steps[0]["rollout/staleness_1"] == 0 and any(
            r["rollout/staleness_1"] > 0 for r in steps[1:]
        )


def test_sync_scheduler_with_redundancy_and_dynamic_sampling(tmp_path: Path) -> None:
    rows = run(
        tmp_path, "rollout.mode=sync", "rollout.redundancy=1.5", "rollout.dynamic_sampling=true"
    )
    steps = [r for r in rows if r["step"] >= 1]
    assert len(steps) == 3
    for r in steps:
        assert {k for k, v in r.items() if k.startswith("rollout/staleness_") and v > 0} <= {
            "rollout/staleness_0"
        }
        assert "rollout/aborted_surplus_episodes" in r and "rollout/filtered_groups" in r


def test_async_resume_trains_new_groups_only_and_does_not_hang(tmp_path: Path, monkeypatch) -> None:
    trained: dict[int, list[int]] = {}
    to_batch = AgenticPipeline.to_batch

    def recording(self, episodes):
        trained[self.step + 1] = [t.group_id for t in episodes]  # self.step: the last finished step
        return to_batch(self, episodes)

    monkeypatch.setattr(AgenticPipeline, "to_batch", recording)
    first = run(tmp_path, "rollout.mode=async", "checkpoint.every=1", "train.steps=2")
    before = {g for ids in trained.values() for g in ids}
    trained.clear()
    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            "train.steps=4",
            "train.ppo_epochs=1",
            "sft.epochs=0",
            "eval.episodes=4",
            "eval.every=0",
            f"output_dir={tmp_path / 'run'}",
            "rollout.mode=async",
            "checkpoint.every=1",
        ],
    )
    rows = AgenticPipeline(cfg, resume=True).fit()
    assert [r["step"] for r in first] == [0, 1, 2] and [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    after = {g for ids in trained.values() for g in ids}
    # in-flight groups are lost, none trained twice
    assert sorted(trained) == [3, 4] and not after & before
    assert min(after) > max(before)
