"""The one table of strategy names: every row loads a class that agrees with what the row declares,
and an unknown name is refused with the names that exist."""

from __future__ import annotations

import pytest

from trainer.strategies.registry import (
    INFERENCE_ENGINES,
    TRAIN_STRATEGIES,
    can_offload,
    engine_spec,
    train_strategy_spec,
)

pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["hf", "fsdp2"])
def test_each_training_row_loads_a_base_strategy_that_agrees_with_it(name: str) -> None:
    from trainer.strategies.base import BaseTrainStrategy

    spec = TRAIN_STRATEGIES[name]
    cls = spec.load()
    assert issubclass(cls, BaseTrainStrategy) and cls.name == name
    assert cls.collective == spec.sharded  # ranks that build together also pad micro-batch counts
    assert ("tensor_parallel_size" in cls.options()) == spec.tensor_parallel


def test_megatron_row_agrees_with_its_class() -> None:
    pytest.importorskip("megatron.core")
    cls = TRAIN_STRATEGIES["megatron"].load()
    assert cls.name == "megatron" and cls.collective
    assert {"tensor_parallel_size", "pipeline_parallel_size"} <= cls.options()


def test_unknown_names_are_refused_with_the_choices_and_a_hint() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown training strategy 'fsdp'; use one of hf, fsdp2, megatron "
        r"\(did you mean 'fsdp2'\?\)",
    ):
        train_strategy_spec("fsdp")
    with pytest.raises(ValueError, match="unknown inference engine 'vlm'; use one of hf, vllm"):
        engine_spec("vlm")


def test_offload_capability_comes_from_the_table() -> None:
    assert all(can_offload(name) for name in [*TRAIN_STRATEGIES, *INFERENCE_ENGINES, "function"])
    assert can_offload("deepspeed") is None
    assert INFERENCE_ENGINES["vllm"].partial_weights is False
