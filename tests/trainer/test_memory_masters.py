"""The memory estimate counts what ``model.dtype: bfloat16`` really keeps: fp32 master weights,
gradients and AdamW moments for the trainable roles, ``model.dtype`` for the frozen reference, the
engines and a frozen LoRA base; the weight sync is sized in the engines' dtype."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trainer.test_memory import EXAMPLES, TINY, TINY_PARAMS, parts
from trainer.config import load_config
from trainer.memory import estimate
from trainer.model_shape import ModelShape

BF16 = [
    "model.tiny={}",
    "model.dtype=bfloat16",
    "algorithm.advantage_estimator=gae",
    "algorithm.loss.kl_coef=0.1",
]
"""A bf16 run with every role: a critic (GAE) and a frozen reference (the KL term)."""


def plan(*overrides: str) -> Any:
    return estimate(load_config(None, [*BF16, *overrides]), ModelShape.from_config(TINY))


def test_trainable_roles_are_counted_in_fp32_and_frozen_ones_in_model_dtype() -> None:
    bf16 = plan()
    assert {"actor_train", "critic", "reference", "actor_infer"} <= set(bf16.roles)
    for role in ("actor_train", "critic"):
        held = parts(bf16, role)
        assert held["weights"] >= TINY_PARAMS * 4, role  # fp32 masters (the critic adds a head)
        assert held["gradients"] == held["weights"], role
        assert held["optimizer"] == 2 * held["weights"], role
    assert parts(bf16, "reference", "forward")["weights"] == TINY_PARAMS * 2
    assert parts(bf16, "actor_infer", "generate")["weights"] == TINY_PARAMS * 2


@pytest.mark.parametrize(("warm_start", "base_bytes"), [("adapters", 2), ("full", 4)])
def test_a_frozen_lora_base_is_counted_in_model_dtype(warm_start: str, base_bytes: int) -> None:
    """A LoRA base stays in ``model.dtype`` while frozen; one the warm start trains is fp32."""
    lora = plan("model.lora.rank=4", f"model.lora.warm_start={warm_start}", "sft.epochs=1")
    assert parts(lora, "actor_train")["weights"] == TINY_PARAMS * base_bytes


@pytest.mark.parametrize("strategy", ["hf", "fsdp2", "megatron"])
def test_the_weight_sync_is_sized_in_the_engines_dtype(strategy: str) -> None:
    """Every strategy casts its fp32 masters to ``model.dtype`` before sending them."""
    from trainer.memory import model_shape, sync_buckets

    sent = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(
            EXAMPLES / "quickstart.yaml",
            [f"model.dtype={dtype}", f"roles.actor_train.strategy={strategy}"],
        )
        _, _, sent[dtype], what = sync_buckets(cfg, model_shape(cfg)[0])
        assert dtype in what, what
    assert sent["float32"] == 2 * sent["bfloat16"]
