"""Per-role offload/reload around colocated phases, and a 2-rank FSDP2 reference role.

On CPU nothing moves (the state already lives in host memory), so what is asserted is the
logic a GPU run relies on: which states are away when, that each is restored before use,
that the per-role flags choose them, and that the engine sleeps during the train phase.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.strategies import dist_workers as W


def test_a_strategy_tracks_what_is_offloaded_and_restores_it_before_use(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from trainer.strategies.hf import HFTrainStrategy

    strategy = HFTrainStrategy(W.tiny_qwen2(), lr=1e-2, micro_batch_size=4)
    batch = W.tiny_batch()
    with caplog.at_level(logging.INFO, logger="trainer.strategies.offload"):
        strategy.offload(params=True, optimizer=False)  # e.g. offload_optimizer: false
    assert strategy.residency.away == {"params"}
    assert "moves nothing" in caplog.text  # said once, in the log, on CPU
    before = strategy.forward(batch).logprobs  # needs the parameters: reloaded for the call
    assert strategy.residency.away == set()
    strategy.offload()
    strategy.train_step(batch, W.nll_loss)  # needs both
    events = [(e.action, e.state, e.moved, e.reason) for e in strategy.residency.history]
    assert events == [
        ("offload", "params", False, "phase"),
        ("reload", "params", False, "use"),
        ("offload", "params", False, "phase"),
        ("offload", "optimizer", False, "phase"),
        ("reload", "params", False, "use"),
        ("reload", "optimizer", False, "use"),
    ]
    assert not torch.equal(strategy.forward(batch).logprobs, before)  # the step really trained


def test_a_frozen_strategy_has_no_optimizer_state_to_offload() -> None:
    from trainer.strategies.hf import HFTrainStrategy

    strategy = HFTrainStrategy(W.tiny_qwen2(), trainable=False)
    strategy.offload()
    assert strategy.residency.away == {"params"}
    strategy.reload()
    assert [(e.action, e.state) for e in strategy.residency.history] == [
        ("offload", "params"),
        ("reload", "params"),
    ]


@pytest.mark.timeout(300)
def test_colocated_roles_take_turns_with_per_role_flags(tmp_path: Path) -> None:
    """The quickstart with every role on device 0: the actor gives up only its parameters
    (offload_optimizer: false) while the engine generates, and the engine sleeps while it trains."""
    from tests.trainer.test_cli import QUICKSTART, TINY
    from trainer.config import load_config
    from trainer.pipeline import AgenticPipeline

    config = load_config(
        QUICKSTART,
        [
            *TINY,
            "train.steps=1",
            "eval.episodes=4",
            "sft.epochs=1",
            f"output_dir={tmp_path / 'run'}",
            "roles.actor_train.offload_optimizer=false",
        ],
    )
    assert config.device_plan.colocated_with("actor_train") == ("actor_infer",)
    seen: list = []
    pipeline = AgenticPipeline(
        config, on_step=lambda m: seen.append(pipeline.roles.actor.residency()[0])
    )
    pipeline.fit()  # closes the roles at the end
    history, actor = pipeline.colocation.history, seen[-1]  # after step 1 (with its eval)
    # rollout: the actor is offloaded; train: reloaded, the engine sleeps (KV cache); eval: swapped
    # again
    assert history[:3] == [
        ("offload", "actor_train"),
        ("offload", "actor_infer"),
        ("reload", "actor_train"),
    ]
    assert ("reload", "actor_infer") in history[3:]
    assert {state for _, state, _, _ in actor} == {"params"}  # the optimizer flag was honoured
    assert [(a, s, reason) for a, s, _, reason in actor][:2] == [
        ("offload", "params", "phase"),
        ("reload", "params", "phase"),
    ]
    assert not any(moved for _, _, moved, _ in actor)  # CPU: nothing moved


@pytest.mark.slow  # a local Ray and four gloo worker processes: ~60-90 s on the 2-core VM
@pytest.mark.timeout(400)
def test_two_rank_fsdp2_reference_and_critic_match_one_process(
    policy_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``roles.reference`` / ``roles.critic`` with ``strategy: fsdp2`` on 2 Ray ranks each: the
    reference's log-probs (the KL term) and the critic's values after a step equal one process's."""
    ray = pytest.importorskip("ray")
    from trainer.config import load_config
    from trainer.controller.batch import Batch
    from trainer.controller.resources import resources_for
    from trainer.models import load_policy
    from trainer.strategies.hf import HFTrainStrategy
    from trainer.workers.critic import CriticCluster, build_value_model, value_loss_fn
    from trainer.workers.reference import ReferenceCluster

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[3]))
    config = load_config(
        None,
        [
            "cluster.backend=ray",
            "cluster.num_cpus=2",
            "algorithm.loss.kl_coef=0.05",
            "algorithm.advantage_estimator=gae",
            "roles.reference.strategy=fsdp2",
            "roles.reference.device_mapping=[1,2]",
            "roles.critic.strategy=fsdp2",
            "roles.critic.device_mapping=[3,4]",
        ],
    )
    model, tokenizer = load_policy(policy_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (5, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[3, 6:] = 0  # right padding on one row
    batch = Batch({"input_ids": ids, "attention_mask": mask})
    expected = (
        HFTrainStrategy(model, trainable=False, micro_batch_size=2)
        .forward(dict(batch.columns))
        .logprobs
    )
    # the critic: 4 full rows (equal tokens per rank: the ranks' mean losses average to the batch's)
    response = torch.ones(4, 9, dtype=torch.long)
    response[:, :3] = 0
    critic_batch = {
        "input_ids": ids[:4],
        "attention_mask": torch.ones(4, 9, dtype=torch.long),
        "response_mask": response,
        "values": torch.zeros(4, 9),
        "returns": torch.rand(4, 9, generator=g),
    }
    plain = HFTrainStrategy(
        build_value_model(str(policy_dir)), kind="value", lr=1e-2, micro_batch_size=4
    )
    plain.train_step(critic_batch, value_loss_fn(0.2))
    expected_values = plain.forward(critic_batch).values * response
    manager = resources_for(config)
    try:
        reference = ReferenceCluster(
            "reference",
            config.roles.reference,
            backend="ray",
            resources=manager,
            worker_kwargs={"model_path": str(policy_dir), "micro_batch_size": 2},
        )
        critic = CriticCluster(
            "critic",
            config.roles.critic,
            backend="ray",
            resources=manager,
            worker_kwargs={
                "model_path": str(policy_dir),
                "optim": {"lr": 1e-2, "micro_batch_size": 4},
            },
        )
        try:
            got = reference.compute_logprobs(batch)["ref_logprobs"]  # 5 rows over 2 ranks: 3 + 2
            weights = reference.get_weights()  # a collective over both ranks
            reference.load_weights(weights)  # and back into the shards
            again = reference.compute_logprobs(batch)["ref_logprobs"]
            critic.train_step(Batch(critic_batch))
            values = critic.compute_values(Batch(critic_batch))["values"]
            critic_state = critic.state_dict()  # a collective: rank 0's full state
        finally:
            reference.shutdown()
            critic.shutdown()
    finally:
        manager.shutdown()
        ray.shutdown()
    torch.testing.assert_close(got * mask, expected * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(again, got, atol=0, rtol=0)
    assert set(weights) == set(model.state_dict())
    torch.testing.assert_close(values, expected_values, atol=1e-5, rtol=1e-4)
    assert set(critic_state["model"]) == set(plain.model.state_dict())
