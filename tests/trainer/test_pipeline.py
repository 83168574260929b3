"""AgenticPipeline in process: each algorithm path trains a real step (critic, reference, KL, GSPO).

An untrained policy's episodes all earn the same env reward (every move is invalid), which
gives every estimator zero advantages and a step that changes nothing; ``varied_reward`` (a user
reward function) makes the rewards in a group differ, so each step must really move the policy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline

VARIED = "env.rewards=[{kind: function, function: 'tests.trainer.test_pipeline:varied_reward'}]"


def varied_reward(episode) -> float:
    """0, 0.5 or 1 from the policy's text: differs between the episodes of a group."""
    actions = "".join(m["content"] for m in episode.messages if m["role"] == "assistant")
    return sum(map(ord, actions)) % 3 / 2


def build(tmp_path: Path, *overrides: str) -> AgenticPipeline:
    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            "train.steps=1",
            "train.ppo_epochs=1",
            "sft.epochs=0",
            "eval.episodes=4",
            f"output_dir={tmp_path / 'run'}",
            VARIED,
            *overrides,
        ],
    )
    return AgenticPipeline(cfg)


def run(tmp_path: Path, *overrides: str) -> list[dict]:
    return build(tmp_path, *overrides).fit()


def assert_policy_trained(step: dict) -> None:
    # a real gradient, not zero advantages
    assert step["actor/optimizer_steps"] >= 1 and step["actor/grad_norm"] > 0


def test_gae_with_critic_and_kl_penalty_and_gspo(tmp_path: Path) -> None:
    rows = run(
        tmp_path,
        "algorithm.advantage_estimator=gae",
        "algorithm.lam=0.9",
        "algorithm.loss.kl_coef=0.05",
        "algorithm.loss.kl_mode=penalty",
        "algorithm.loss.gspo=true",
        "algorithm.loss.agg_mode=seq-mean-token-mean",
        "roles.critic.device_mapping=[1]",
        "roles.reference.device_mapping=[1]",
    )
    step = rows[-1]
    # the critic was fitted to returns it did not know
    assert step["step"] == 1 and step["critic/value_loss"] > 0
    # reference == policy before the first update
    assert step["actor/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert_policy_trained(step)


def test_rloo_and_reinforce_pp_with_kl_loss(tmp_path: Path) -> None:
    for estimator in ("rloo", "reinforce_pp"):
        rows = run(
            tmp_path / estimator,
            f"algorithm.advantage_estimator={estimator}",
            "algorithm.loss.kl_coef=0.1",
            "algorithm.loss.kl_mode=loss",
            "algorithm.loss.dual_clip=3.0",
            "train.ppo_epochs=2",
        )
        step = rows[-1]
        assert_policy_trained(step)
        # the second epoch ran a policy the first moved: away from the sampling policy and reference
        assert step["actor/approx_kl_old"] > 1e-6 and step["actor/kl_ref"] > 1e-6, estimator
        assert step["eval/episodes"] == 4


@pytest.mark.slow
def test_the_same_run_on_ray_workers(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    import ray

    try:
        rows = run(tmp_path, "cluster.backend=ray", "cluster.num_cpus=2")
        assert rows[-1]["step"] == 1
        # the reward function ran on the reward worker, the actor trained
        assert_policy_trained(rows[-1])
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_run_whose_env_workers_route_their_own_turns(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    import ray

    try:
        pipeline = build(
            tmp_path,
            "train.steps=2",
            "cluster.backend=ray",
            "cluster.num_cpus=2",
            "rollout.mode=async",
            "rollout.env_workers=2",
            "rollout.route_in_workers=true",
            "rollout.pause_timeout_s=45",
        )
        rows = pipeline.fit()
    finally:
        ray.shutdown()
    cfg = pipeline.cfg
    assert [row["step"] for row in rows if "actor/grad_norm" in row] == [1, 2]
    assert_policy_trained(rows[-1])
    routing, driver = pipeline.rollouts.routing, pipeline.rollouts.router
    assert routing is not None and routing.version == 2  # the workers' routers followed the sync
    assert routing.pause_timeout_s == 45
    # every training turn went through the workers' own routers; the driver's router served
    # only the evaluation episodes
    trained = sum(
        r["rollout/turns_mean"] * cfg.batch_size for r in rows if "rollout/turns_mean" in r
    )
    assert routing.totals().requests >= trained > 0
    assert driver.totals().requests <= 4 * cfg.rollout.max_turns * (1 + cfg.train.steps)


def test_a_build_that_fails_after_the_workers_started_stops_them_and_frees_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook user whose pipeline fails to build (here: its metric sink) fixes the cause and
    builds again in the same process: the first attempt's workers were stopped and its run
    folder released, so the retry starts."""
    from trainer import pipeline

    started: list = []
    real_start_roles = pipeline.start_roles

    def start_roles(*args, **kwargs):
        started.append(roles := real_start_roles(*args, **kwargs))
        return roles

    def broken_sink(*args, **kwargs):
        raise RuntimeError("the metric sink broke")

    monkeypatch.setattr(pipeline, "start_roles", start_roles)
    with monkeypatch.context() as broken:
        broken.setattr(pipeline, "MetricsLog", broken_sink)
        with pytest.raises(RuntimeError, match="the metric sink broke"):
            build(tmp_path)
    [roles] = started
    assert all(cluster._closed for cluster in roles.clusters), "the workers were left running"
    build(tmp_path).close()  # the run folder's lock was released


def test_truncated_episodes_are_counted_and_with_mask_truncated_not_trained(tmp_path: Path) -> None:
    """One move per episode cuts every episode that has not fallen in a hole: the share shows
    as ``train/truncated``, and with ``algorithm.mask_truncated`` none of their tokens gets an
    advantage (the stored episodes, as the viewer shows them)."""
    import envhub.runs

    rows = run(tmp_path, "rollout.max_turns=1", "algorithm.mask_truncated=true")
    stored = envhub.runs.open(tmp_path / "run")
    page = stored.episodes(kind="train", step=1, limit=None)
    cut = [row for row in page.rows if row["truncated"]]
    assert cut and rows[-1]["train/truncated"] == pytest.approx(len(cut) / page.total)
    for row in cut:
        assert not any(stored.episode(row["key"])["advantages"]), row["key"]


def test_a_bfloat16_run_exports_its_policy_in_bfloat16(tmp_path: Path) -> None:
    """The roles train fp32 masters, but ``final_policy/`` is what a user serves: in
    ``model.dtype`` (half the size; vLLM's ``--dtype auto`` would serve a float32 folder in fp16),
    and loadable as it says."""
    import json

    import torch

    from trainer.models import load_policy

    run(tmp_path, "model.dtype=bfloat16")
    folder = tmp_path / "run" / "final_policy"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    stored = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    model, _ = load_policy(folder, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_batch_whose_every_episode_is_masked_takes_no_optimizer_step(tmp_path: Path) -> None:
    """One move can never reach the goal of a 3x3 map without holes, so every episode is cut
    short; with ``mask_truncated`` nothing of the batch is trained, and AdamW is not stepped
    either (a step on zero gradients would still move the weights by its momentum and decay)."""
    kwargs = "env.kwargs={action_format: raw, size: 3, hole_fraction: 0.0, max_turns: 6}"
    rows = run(tmp_path, kwargs, "rollout.max_turns=1", "algorithm.mask_truncated=true")
    assert rows[-1]["train/truncated"] == 1.0
    assert rows[-1]["actor/optimizer_steps"] == 0
