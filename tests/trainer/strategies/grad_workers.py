"""Rank bodies for ``test_grad_equivalence.py`` (importable by name: ``run_ranks`` pickles them)."""

from __future__ import annotations

from typing import Any

from tests.trainer.strategies.dist_workers import join, tiny_qwen2

LOSS = {
    "clip_low": 0.2,
    "clip_high": 0.28,
    "kl_coef": 0.1,
    "kl_estimator": "k3",
    "kl_mode": "loss",
    "entropy_coef": 0.01,
}
"""PPO + KL loss + entropy bonus: every term of ``ppo_loss_fn`` goes through the aggregation."""


def gradients(model: Any) -> dict[str, Any]:
    """Full (unsharded) CPU gradients by parameter name; a collective for DTensor gradients."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        grads[name] = (
            (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu().clone()
        )
    return grads


def fsdp2_grads_rank(
    rank: int,
    world: int,
    port: int,
    out: Any,
    batch: dict[str, Any],
    rows: list[int],
    modes: list[str],
) -> None:
    """FSDP2 on ``world`` ranks, rank r holding ``rows[r]`` consecutive rows, micro-batch size 1."""
    join(rank, world, port)
    from trainer.config import LossConfig
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.fsdp2 import FSDP2TrainStrategy
    from trainer.workers.actor import ppo_loss_fn

    start = sum(rows[:rank])
    mine = {k: v[start : start + rows[rank]] for k, v in batch.items()}
    for mode in modes:
        strategy = FSDP2TrainStrategy(
            tiny_qwen2(), lr=0.0, max_grad_norm=None, micro_batch_size=1, device="cpu"
        )
        strategy.train_step(mine, ppo_loss_fn(LossConfig(**LOSS, agg_mode=mode)), with_entropy=True)
        out[(mode, rank)] = gradients(strategy.model)
    shutdown_process_group()


def megatron_gradients(strategy: Any) -> dict[str, Any]:
    """The Megatron model's gradients, gathered over its TP group, under HF names (PP = 1)."""
    import torch
    import torch.distributed as dist

    from trainer.strategies.megatron_convert import megatron_to_hf

    shards: list[dict[str, Any]] = [{} for _ in range(strategy.tp_size)]
    for name, param in strategy.model.named_parameters():
        grad = param.grad.detach().contiguous()
        parts = [torch.empty_like(grad) for _ in range(strategy.tp_size)]
        dist.all_gather(parts, grad, group=strategy.tp_group)
        for rank, part in enumerate(parts):
            shards[rank][name] = part
    return {k: v.cpu().clone() for k, v in megatron_to_hf([shards], strategy.layout).items()}


def megatron_grads_rank(
    rank: int,
    world: int,
    port: int,
    out: Any,
    batch: dict[str, Any],
    rows: list[int],
    modes: list[str],
) -> None:
    """Megatron on ``world`` ranks, TP=2 (then TP=1 x DP=2), rank r given ``rows[r]`` rows,
    micro-batches of 1."""
    join(rank, world, port)
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as mpu

    from trainer.config import LossConfig
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.megatron import MegatronTrainStrategy
    from trainer.workers.actor import ppo_loss_fn

    start = sum(rows[:rank])
    mine = {k: v[start : start + rows[rank]] for k, v in batch.items()}
    for tp in (2, 1):
        for mode in modes if tp == 2 else modes[:1]:  # DP=2: one mode keeps the default tier short
            strategy = MegatronTrainStrategy(
                tiny_qwen2(),
                lr=0.0,
                max_grad_norm=None,
                micro_batch_size=1,
                device="cpu",
                tensor_parallel_size=tp,
            )
            strategy.train_step(
                mine, ppo_loss_fn(LossConfig(**LOSS, agg_mode=mode)), with_entropy=True
            )
            out[(tp, mode, rank)] = megatron_gradients(strategy)
        mpu.destroy_model_parallel()
    shutdown_process_group()
