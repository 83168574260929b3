"""AgenticPipeline in-process: every algorithm path runs a real step (critic, reference, KL, GSPO)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline


def run(tmp_path: Path, *overrides: str) -> list[dict]:
    cfg = load_config(QUICKSTART, [*TINY, "train.steps=1", "train.ppo_epochs=1", "sft.epochs=0", "eval.episodes=4",
                                   f"output_dir={tmp_path / 'run'}", *overrides])
    return AgenticPipeline(cfg).fit()


def test_gae_with_critic_and_kl_penalty_and_gspo(tmp_path: Path) -> None:
    rows = run(tmp_path, "algorithm.advantage_estimator=gae", "algorithm.lam=0.9",
               "algorithm.loss.kl_coef=0.05", "algorithm.loss.kl_mode=penalty", "algorithm.loss.gspo=true",
               "algorithm.loss.agg_mode=seq-mean-token-mean", "roles.critic.device_mapping=[1]",
               "roles.reference.device_mapping=[1]")
    step = rows[-1]
    assert step["step"] == 1 and "critic/value_loss" in step and "actor/kl_ref" in step
    assert step["actor/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # reference == policy before the first update


def test_rloo_and_reinforce_pp_with_kl_loss(tmp_path: Path) -> None:
    for estimator in ("rloo", "reinforce_pp"):
        rows = run(tmp_path / estimator, f"algorithm.advantage_estimator={estimator}", "algorithm.loss.kl_coef=0.1",
                   "algorithm.loss.kl_mode=loss", "algorithm.loss.dual_clip=3.0", "train.ppo_epochs=2")
        assert rows[-1]["actor/optimizer_steps"] >= 1 and rows[-1]["eval/success"] is not None


@pytest.mark.slow
def test_the_same_run_on_ray_workers(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    import ray

    try:
        rows = run(tmp_path, "cluster.backend=ray", "cluster.num_cpus=2")
        assert rows[-1]["step"] == 1
    finally:
        ray.shutdown()
