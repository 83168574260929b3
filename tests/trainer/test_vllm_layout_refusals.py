"""A vLLM engine spans ``tensor_parallel_size`` x ``pipeline_parallel_size`` devices, and each
``actor_infer`` worker holds ``num_devices_per_worker`` of them: a config where the two disagree
is refused at load, naming both keys (on GPUs each worker would otherwise see one GPU and fail to
start its engine, or stack several engines' shards on one device)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
VLLM = [
    "rollout.engine=vllm",
    "model.tiny.num_heads=2",
    "cluster.backend=ray",
    "roles.actor_train.device_mapping=[0,1]",
    "roles.actor_train.strategy=fsdp2",
    "roles.actor_infer.device_mapping=[0,1]",
]


def problems(*overrides: str) -> list[str]:
    try:
        load_config(QUICKSTART, [*VLLM, *overrides])
    except ConfigError as error:
        return [str(p) for p in error.problems]
    return []


def engine_layout(found: list[str]) -> list[str]:
    return [p for p in found if "num_devices_per_worker" in p]


def test_a_tensor_parallel_engine_on_one_device_workers_is_refused_naming_both_keys() -> None:
    [problem] = engine_layout(problems("roles.actor_infer.strategy_args.tensor_parallel_size=2"))
    assert problem.startswith("roles.actor_infer.num_devices_per_worker: ")
    assert "roles.actor_infer.strategy_args.tensor_parallel_size" in problem
    assert "set roles.actor_infer.num_devices_per_worker: 2" in problem


def test_workers_of_two_devices_with_a_one_device_engine_are_refused() -> None:
    [problem] = engine_layout(problems("roles.actor_infer.num_devices_per_worker=2"))
    assert "tensor_parallel_size" in problem


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "roles.actor_infer.strategy_args.tensor_parallel_size=2",
            "roles.actor_infer.num_devices_per_worker=2",
        ],
    ],
)
def test_an_engine_as_wide_as_its_worker_passes_this_check(overrides: list[str]) -> None:
    assert engine_layout(problems(*overrides)) == []
