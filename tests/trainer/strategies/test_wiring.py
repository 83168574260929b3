"""Choosing a training strategy per role: names, options and layouts that cannot run are refused
with the fix, in the config (all problems at once) and when a worker builds the strategy."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from trainer.config import RoleConfig, load_config
from trainer.controller.worker import WorkerContext
from trainer.errors import ConfigError
from trainer.strategies.parallel_errors import ParallelConfigError
from trainer.strategies.registry import make_train_strategy
from trainer.workers.actor import ActorWorker


def test_config_names_every_parallel_problem_and_its_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(
            None,
            [
                "roles.actor_train.strategy=megatron",
                "roles.actor_train.device_mapping=[0,1,2]",
                "roles.actor_train.strategy_args.tensor_parallel_size=2",
                "cluster.backend=local",
                "env.num_groups=3",
                "env.group_size=4",
                "rollout.engine=vllm",
                "weight_sync.only_changed=true",
            ],
        )
    message = str(caught.value)
    assert (
        "cluster.backend: actor_train strategy 'megatron' on 3 workers needs one process per rank"
        in message
    )
    assert "set cluster.backend: ray" in message
    assert "tensor_parallel_size: 2 must be a positive divisor of the role's 3 workers" in message
    assert "weight_sync.only_changed: vLLM reloads whole layers" in message
    with pytest.raises(
        ConfigError,
        match="pipeline_parallel_size: 2: tensor_parallel_size x pipeline_parallel_size "
        "= 2 x 2 must divide the role's 2 workers",
    ):
        load_config(
            None,
            [
                "roles.actor_train.strategy=megatron",
                "roles.actor_train.device_mapping=[0,1]",
                "roles.actor_train.strategy_args.tensor_parallel_size=2",
                "cluster.backend=ray",
                "roles.actor_train.strategy_args.pipeline_parallel_size=2",
            ],
        )


def test_sharded_strategies_pass_the_config_on_ray() -> None:
    for strategy, extra in (
        ("fsdp2", []),
        ("megatron", ["roles.actor_train.strategy_args.tensor_parallel_size=2"]),
        ("megatron", ["roles.actor_train.strategy_args.pipeline_parallel_size=2"]),
    ):
        cfg = load_config(
            None,
            [
                f"roles.actor_train.strategy={strategy}",
                "roles.actor_train.device_mapping=[0,1]",
                "cluster.backend=ray",
                *extra,
            ],
        )
        assert cfg.roles.actor_train.world_size == 2


def test_make_train_strategy_refuses_unknown_names_options_and_layouts(policy) -> None:
    model, _ = policy
    with pytest.raises(
        ValueError, match="unknown training strategy 'deepspeed'; use one of hf, fsdp2, megatron"
    ):
        make_train_strategy("deepspeed", model)
    with pytest.raises(
        ParallelConfigError,
        match=r"strategy_args \['tensor_parallel'\] are not options of the 'fsdp2'",
    ):
        make_train_strategy("fsdp2", model, strategy_args={"tensor_parallel": 2})
    with pytest.raises(
        ParallelConfigError,
        match="tensor_parallel_size=2 must be a positive divisor of the role's 3",
    ):
        make_train_strategy(
            "megatron", model, world_size=3, strategy_args={"tensor_parallel_size": 2}
        )
    with pytest.raises(
        ParallelConfigError, match="pipeline_parallel_size=2: .* = 1 x 2 must divide the role's 3"
    ):
        make_train_strategy(
            "megatron", model, world_size=3, strategy_args={"pipeline_parallel_size": 2}
        )


def test_a_local_multi_rank_sharded_actor_is_refused_before_loading(policy_dir) -> None:
    ctx = WorkerContext(role="actor_train", rank=0, world_size=2, backend="local")
    with pytest.raises(ParallelConfigError, match="set cluster.backend: ray"):
        ActorWorker(
            ctx, RoleConfig(strategy="fsdp2", device_mapping=[0, 1]), model_path=str(policy_dir)
        )
