"""The trainer's log-probs are those of the distribution the rollouts sample from.

An engine sampling at ``rollout.temperature`` T draws from ``softmax(logits / T)`` and reports
``log_softmax(logits / T)`` of each token; the actor's old and new log-probs and the reference's
must be taken at the same T (``forward(..., temperature=T)``), or the PPO ratio and the policy
gradient are those of another policy than the one that sampled. SFT steps stay at T = 1, entropy
is that of the sampling distribution, and a temperature of 0 (greedy) is refused with the fix.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from trainer.config import RoleConfig
from trainer.controller.batch import Batch
from trainer.controller.worker import WorkerContext
from trainer.errors import ConfigError
from trainer.strategies.base import GenerationRequest
from trainer.strategies.hf import HFTrainStrategy, token_logprobs
from trainer.strategies.hf_engine import HFEngine
from trainer.workers.actor import ActorWorker
from trainer.workers.reference import ReferenceWorker

T = 0.7
"""A rollout temperature far enough from 1 that log-probs at 1 differ by far more than 1e-4."""


def sampled_batch(policy: Any, temperature: float = T) -> dict[str, Any]:
    """Right-padded rows of prompt + tokens an ``HFEngine`` sampled at ``temperature``, with
    the engine's log-probs in ``old_logprobs`` (the behaviour log-probs) under the response."""
    model, tokenizer = policy
    engine = HFEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=3
    )
    texts = ["Your first move?", "You moved right.\n\nS F H\nF P F\n\nYour next move?"]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for text in texts
    ]
    results = engine.generate_batch(
        [GenerationRequest(f"r{i}", p, 8, temperature=temperature) for i, p in enumerate(prompts)]
    )
    width = max(len(p) + len(r.token_ids) for p, r in zip(prompts, results, strict=True))
    batch = {
        "input_ids": torch.zeros(len(prompts), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(prompts), width, dtype=torch.long),
        "response_mask": torch.zeros(len(prompts), width),
        "old_logprobs": torch.zeros(len(prompts), width),
    }
    for row, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        start, end = len(prompt), len(prompt) + len(result.token_ids)
        batch["input_ids"][row, :end] = torch.tensor(prompt + result.token_ids)
        batch["attention_mask"][row, :end] = 1
        batch["response_mask"][row, start:end] = 1
        batch["old_logprobs"][row, start:end] = torch.tensor(result.logprobs)
    return batch


@pytest.mark.parametrize("options", [{}, {"packing": True}], ids=["padded", "packed"])
def test_logprobs_at_the_rollout_temperature_are_the_engines(policy, options) -> None:
    batch = sampled_batch(policy)
    mask = batch["response_mask"].bool()
    strategy = HFTrainStrategy(copy.deepcopy(policy[0]), trainable=False, **options)
    at_t = strategy.forward(batch, temperature=T).logprobs
    torch.testing.assert_close(at_t[mask], batch["old_logprobs"][mask], atol=1e-4, rtol=0)
    # the test can fail: at T = 1 the same tokens have other log-probs
    at_one = strategy.forward(batch).logprobs
    assert float((at_one[mask] - batch["old_logprobs"][mask]).abs().max()) > 1e-2


def test_entropy_is_the_sampling_distributions(policy) -> None:
    batch = sampled_batch(policy)
    model = copy.deepcopy(policy[0])
    out = HFTrainStrategy(model, trainable=False).forward(batch, with_entropy=True, temperature=T)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1] / T
    expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    mask = batch["attention_mask"][:, 1:].bool()
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy[:, 1:][mask], expected[mask], atol=1e-4, rtol=0)


def test_a_temperature_of_zero_has_no_logprobs() -> None:
    logits, ids = torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.long)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            token_logprobs(logits, ids, temperature=bad)


def actor(policy_dir: Any, temperature: float, **kwargs: Any) -> ActorWorker:
    ctx = WorkerContext(role="actor_train", rank=0, world_size=1, backend="local")
    return ActorWorker(
        ctx,
        RoleConfig(device_mapping=[0]),
        model_path=str(policy_dir),
        optim={"lr": 0.0, "micro_batch_size": 8},
        temperature=temperature,
        **kwargs,
    )


def test_a_ppo_step_on_fresh_rollouts_starts_at_ratio_one(policy, policy_dir) -> None:
    """Fresh samples are on-policy: the engine's log-probs are the actor's old log-probs, the
    first PPO ratio is 1 on every token (no recompute needed), and the actor's own recomputed
    old log-probs agree."""
    batch = sampled_batch(policy)
    mask = batch["response_mask"].bool()
    worker = actor(policy_dir, T)
    recomputed = worker.compute_logprobs(Batch(batch))["logprobs"]
    torch.testing.assert_close(recomputed[mask], batch["old_logprobs"][mask], atol=1e-4, rtol=0)
    batch["advantages"] = batch["response_mask"].clone()
    metrics = worker.train_step(Batch(batch))
    assert metrics["actor/approx_kl_old"] < 1e-8 and metrics["actor/clipfrac"] == 0.0


def test_sft_steps_stay_at_temperature_one(policy, policy_dir) -> None:
    """Behaviour cloning fits the model's own distribution, whatever the rollouts sample at."""
    batch = sampled_batch(policy)
    mask = batch["response_mask"]
    at_one = HFTrainStrategy(copy.deepcopy(policy[0]), trainable=False).forward(batch).logprobs
    nll = actor(policy_dir, T).sft_step(Batch(batch))["sft/nll"]
    assert nll == pytest.approx(float(-(at_one * mask).sum() / mask.sum()), abs=1e-5)


def test_the_reference_logprobs_are_at_the_rollout_temperature(policy, policy_dir) -> None:
    batch = sampled_batch(policy)
    mask = batch["response_mask"].bool()
    ctx = WorkerContext(role="reference", rank=0, world_size=1, backend="local")
    worker = ReferenceWorker(
        ctx, RoleConfig(device_mapping=[0]), model_path=str(policy_dir), temperature=T
    )
    got = worker.compute_logprobs(Batch(batch))["ref_logprobs"]
    torch.testing.assert_close(got[mask], batch["old_logprobs"][mask], atol=1e-4, rtol=0)


def test_greedy_rollouts_are_refused_with_the_fix(policy_dir) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.temperature: 0\.0 samples greedily"):
        actor(policy_dir, 0.0)
    ctx = WorkerContext(role="reference", rank=0, world_size=1, backend="local")
    with pytest.raises(ConfigError, match=r"rollout\.temperature: 0\.0 samples greedily"):
        ReferenceWorker(
            ctx, RoleConfig(device_mapping=[0]), model_path=str(policy_dir), temperature=0.0
        )


PARALLEL = {
    "fsdp2": ("fsdp2", 1, 1),
    "megatron": ("megatron", 1, 1),
    "megatron-pp2": ("megatron", 2, 2),
}
"""Strategy, ranks, pipeline stages: fsdp2's forward, megatron's and its 1F1B schedule's."""


@pytest.mark.parametrize("layout", PARALLEL.values(), ids=PARALLEL.keys())
def test_parallel_strategies_take_logprobs_at_the_temperature(layout: tuple[str, int, int]) -> None:
    """fsdp2 and megatron give the log-probs, entropy and loss the plain strategy gives at T."""
    from tests.trainer.strategies import dist_workers as W
    from tests.trainer.strategies.ranks import run_ranks

    name, world, pp = layout
    if name == "megatron":
        pytest.importorskip("megatron.core")
    out = run_ranks(W.temperature_rank, world, name, T, pp)
    batch = W.tiny_batch(rows=4)
    plain = HFTrainStrategy(W.tiny_qwen2(layers=4), lr=1e-2, micro_batch_size=1)
    expected = plain.forward(batch, with_entropy=True, temperature=T)
    got = {key: torch.cat([out[(r, key)] for r in range(world)]) for key in ("logprobs", "entropy")}
    torch.testing.assert_close(got["logprobs"], expected.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["entropy"], expected.entropy, atol=1e-4, rtol=0)
    nll = plain.train_step(batch, W.nll_loss, temperature=T)["nll"]
    assert all(out[(r, "metrics")]["nll"] == pytest.approx(nll, abs=1e-5) for r in range(world))
