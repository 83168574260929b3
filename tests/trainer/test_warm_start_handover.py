"""What the warm start hands RL: the policy, and its optimiser unless ``sft.reset_optimizer``
(then RL's first update is AdamW's first, as after a LoRA warm start, for every strategy); and
file demonstrations are prompted as RL prompts (``rollout.context``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.strategies.ranks import run_ranks
from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import RoleConfig, load_config
from trainer.controller.batch import Batch
from trainer.controller.worker import WorkerContext
from trainer.workers.actor import ActorWorker


def adam_steps(state: dict[str, Any]) -> set[float]:
    """AdamW's step count of every parameter in an actor's saved state (megatron saves one
    optimiser state per rank)."""
    optimizer = state["optimizer_ranks"][0] if "optimizer_ranks" in state else state["optimizer"]
    return {float(param["step"]) for param in optimizer["state"].values()}


@pytest.mark.parametrize(("reset", "steps"), [(True, {1.0}), (False, {9.0})])
def test_sft_reset_optimizer_decides_whether_rl_continues_the_warm_starts_moments(
    tmp_path: Path, reset: bool, steps: set[float]
) -> None:
    from trainer.checkpoint import CheckpointManager
    from trainer.pipeline import AgenticPipeline

    overrides = ["train.steps=1", "train.ppo_epochs=1", "checkpoint.every=1", "eval.every=0"]
    cfg = load_config(
        QUICKSTART, [*TINY, *overrides, f"sft.reset_optimizer={reset}", f"output_dir={tmp_path}"]
    )
    AgenticPipeline(cfg).fit()  # 8 warm-start steps (4 epochs of 2 batches), then 1 RL step
    checkpoints = CheckpointManager(cfg.checkpoint_dir, lock=False)
    state = checkpoints.load(checkpoints.latest()).load_state("actor")
    assert adam_steps(state) == steps  # the RL step's own, or the warm start's 8 + 1


def test_the_warm_start_reports_its_progress_and_each_epochs_mean_nll(tmp_path: Path) -> None:
    """A long warm start shows where it is (``on_sft_step``: the CLI's bar and lines), and
    ``sft/nll`` is the last epoch's mean, not whichever batch came last."""
    from trainer.pipeline import AgenticPipeline

    overrides = ["train.steps=1", "eval.every=0", "checkpoint.every=0", f"output_dir={tmp_path}"]
    seen: list[tuple[int, int, float]] = []
    cfg = load_config(QUICKSTART, [*TINY, *overrides])
    rows = AgenticPipeline(cfg, on_sft_step=lambda *report: seen.append(report)).fit()
    assert [(done, total) for done, total, _ in seen] == [(k, 8) for k in range(1, 9)]
    nlls = [nll for *_, nll in seen]  # 4 epochs of 2 batches
    assert rows[0]["sft/nll"] == pytest.approx(sum(nlls[-2:]) / 2)
    assert rows[0]["sft/nll_first_epoch"] == pytest.approx(sum(nlls[:2]) / 2)
    assert rows[0]["sft/nll_first_epoch"] > rows[0]["sft/nll"]  # it learnt
    assert rows[0]["sft/steps"] == 8


def sft_batch(rows: int = 4, width: int = 10) -> Batch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    return Batch({"input_ids": ids, "attention_mask": mask, "response_mask": mask.clone()})


def reset_rank(rank: int, world: int, port: int, out: Any, policy_dir: str, name: str) -> None:
    """Two warm-start steps, the reset the pipeline makes, the step-0 checkpoint, one RL step."""
    from tests.trainer.strategies.dist_workers import join
    from trainer.strategies.distributed import shutdown_process_group

    join(rank, world, port)
    ctx = WorkerContext(role="actor_train", rank=0, world_size=1, backend="local")
    worker = ActorWorker(
        ctx,
        RoleConfig(strategy=name, device_mapping=[0]),
        model_path=policy_dir,
        optim={"lr": 1e-3, "micro_batch_size": 4},
    )
    for _ in range(2):
        worker.sft_step(sft_batch())
    worker.reset_optimizer()
    worker.state_dict()  # the step-0 checkpoint, taken before RL starts
    worker.sft_step(sft_batch())
    out["steps"] = adam_steps(worker.state_dict())
    shutdown_process_group()


@pytest.mark.parametrize("name", ["hf", "fsdp2", "megatron"])
def test_every_strategy_resets_its_optimiser_after_the_warm_start(
    policy_dir: Path, name: str
) -> None:
    if name == "megatron":
        pytest.importorskip("megatron.core", reason="needs megatron-core")
    assert run_ranks(reset_rank, 1, str(policy_dir), name)["steps"] == {1.0}


def test_file_demonstrations_are_prompted_with_the_rollout_context(tmp_path: Path) -> None:
    """``rollout.context: last_k_turns`` shows each turn only the opening messages and the last
    turns, in RL and in a file warm start alike."""
    from trainer.pipeline import AgenticPipeline

    turns = [("first", "left"), ("second", "down"), ("third", "right")]
    messages = [
        m
        for user, move in turns
        for m in ({"role": "user", "content": user}, {"role": "assistant", "content": move})
    ]
    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps({"messages": messages}) + "\n")
    context = [
        "rollout.context=last_k_turns",
        "rollout.context_turns=1",
        "rollout.sample_unit=turn",
    ]
    overrides = ["train.steps=0", "sft.source=file", f"sft.path={demos}", *context]
    cfg = load_config(QUICKSTART, [*TINY, *overrides, f"output_dir={tmp_path / 'run'}"])
    pipeline = AgenticPipeline(cfg)
    try:
        tokenizer = pipeline.renderer.tokenizer
        (demo,) = pipeline.file_demos
        last = demo.samples[-1]
        prompt = [t for t, m in zip(last.token_ids, last.response_mask, strict=True) if not m]
    finally:
        pipeline.close()
    shown = tokenizer.decode(prompt)
    assert "down" in shown and "third" in shown  # the last turn and the new message
    assert "left" not in shown  # the first answer is out of the context RL would show
