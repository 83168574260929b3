"""``model.dtype: bfloat16`` (what the GPU recipes set) still trains: the trainable roles keep fp32
master weights and AdamW moments, so an update of lr=1e-6 on a weight of ~0.02 (far below half a
bf16 ulp) is not rounded away; compute runs in ``model.dtype`` where that is cheap (autocast or
fsdp2 mixed precision on CUDA). The engines and the frozen reference hold ``model.dtype``, and the
weight sync sends them that dtype (bytes sized accordingly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.strategies.ranks import run_ranks
from trainer.config import LoraConfig, RoleConfig
from trainer.controller.batch import Batch
from trainer.controller.worker import WorkerContext
from trainer.workers.actor import ActorWorker
from trainer.workers.critic import CriticWorker
from trainer.workers.reference import ReferenceWorker

LR = 1e-6
"""The GPU recipes' ``train.lr``."""


def actor(policy_dir: Any, dtype: str, config: RoleConfig | None = None, **kw: Any) -> ActorWorker:
    ctx = WorkerContext(role="actor_train", rank=0, world_size=1, backend="local")
    return ActorWorker(
        ctx,
        config or RoleConfig(device_mapping=[0]),
        model_path=str(policy_dir),
        dtype=dtype,
        optim={"lr": LR, "micro_batch_size": 8},
        **kw,
    )


def sft_batch(vocab: int, rows: int = 8, width: int = 12) -> Batch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    return Batch({"input_ids": ids, "attention_mask": mask, "response_mask": mask.clone()})


def changed_share(worker: ActorWorker, steps: int = 3) -> float:
    """The share of the policy's weight elements that ``steps`` SFT steps at ``LR`` changed."""
    before = {k: v.float().clone() for k, v in worker.get_weights().items()}
    vocab = before["model.embed_tokens.weight"].shape[0]
    for _ in range(steps):
        worker.sft_step(sft_batch(vocab))
    after = worker.get_weights()
    changed = sum(int((after[k].float() != before[k]).sum()) for k in before)
    return changed / sum(v.numel() for v in before.values())


def moment_dtypes(state: dict[str, Any]) -> set[str]:
    return {
        str(value.dtype)
        for param in state["optimizer"]["state"].values()
        for key, value in param.items()
        if key in ("exp_avg", "exp_avg_sq")
    }


def test_a_bf16_config_trains_fp32_master_weights_at_a_small_lr(policy_dir: Path) -> None:
    worker = actor(policy_dir, "bfloat16")
    share = changed_share(worker)
    assert share > 0.5, f"only {share:.1%} of the weights moved at lr={LR:g}"
    state = worker.state_dict()  # what the checkpoint holds
    assert {str(t.dtype) for t in state["model"].values()} == {"torch.float32"}
    assert moment_dtypes(state) == {"torch.float32"}


def test_the_weight_sync_sends_the_engines_dtype(policy_dir: Path) -> None:
    """The engines hold ``model.dtype``: the sync casts the fp32 masters to it, on both paths
    (shard-direct sizes and buckets, and the gathered stream), so it moves half the bytes."""
    worker = actor(policy_dir, "bfloat16")
    numels = {k: v.numel() for k, v in worker.get_weights().items()}
    sizes = dict(worker.weight_sizes())  # (a tied head is sent once, under the embedding's name)
    assert sizes and sizes == {k: 2 * numels[k] for k in sizes}
    try:
        handles = worker.begin_shard_sync(2**20)
        assert handles is not None
        assert {m.dtype for h in handles for m in h.metas} == {"bfloat16"}
        worker.write_weight_bucket(handles[0])
        worker.begin_weight_sync(2**20)
        bucket = worker.next_weight_bucket()
        assert bucket is not None and {m.dtype for m in bucket.metas} == {"bfloat16"}
    finally:
        worker.close_weight_sync()


def test_a_bf16_critic_trains_fp32_masters_and_the_reference_stays_bf16(policy_dir: Path) -> None:
    critic = CriticWorker(
        WorkerContext(role="critic", rank=0, world_size=1, backend="local"),
        RoleConfig(device_mapping=[0]),
        model_path=str(policy_dir),
        dtype="bfloat16",
        optim={"lr": LR, "micro_batch_size": 8},
    )
    assert {str(t.dtype) for t in critic.state_dict()["model"].values()} == {"torch.float32"}
    reference = ReferenceWorker(
        WorkerContext(role="reference", rank=0, world_size=1, backend="local"),
        RoleConfig(device_mapping=[0]),
        model_path=str(policy_dir),
        dtype="bfloat16",
    )
    assert {str(t.dtype) for t in reference.get_weights().values()} == {"torch.bfloat16"}


@pytest.mark.parametrize("full_warm_start", [False, True])
def test_a_frozen_lora_base_stays_bf16_and_what_trains_is_fp32(
    policy_dir: Path, full_warm_start: bool
) -> None:
    """Adapters train in fp32 over a base kept in ``model.dtype`` (frozen, it needs no master
    copy); a base that trains too (``warm_start: full``) is loaded in fp32."""
    worker = actor(
        policy_dir,
        "bfloat16",
        lora=LoraConfig(rank=4, warm_start="full" if full_warm_start else "adapters"),
        full_warm_start=full_warm_start,
    )
    model = worker.strategy.model
    adapters = {str(p.dtype) for n, p in model.named_parameters() if ".lora_" in n}
    base = {str(p.dtype) for n, p in model.named_parameters() if ".lora_" not in n}
    assert adapters == {"torch.float32"}
    assert base == {"torch.float32" if full_warm_start else "torch.bfloat16"}


def fsdp2_master_rank(rank: int, world: int, port: int, out: Any, policy_dir: str) -> None:
    """One fsdp2 rank with bf16 mixed precision (the CUDA default) over ``model.dtype: bf16``."""
    from tests.trainer.strategies.dist_workers import join
    from trainer.strategies.distributed import shutdown_process_group

    join(rank, world, port)
    config = RoleConfig(
        strategy="fsdp2", device_mapping=[0], strategy_args={"mixed_precision": True}
    )
    worker = actor(policy_dir, "bfloat16", config)
    out["share"] = changed_share(worker)
    state = worker.state_dict()
    out["weights"] = {str(t.dtype) for t in state["model"].values()}
    out["moments"] = moment_dtypes(state)
    out["sizes"] = dict(worker.weight_sizes())
    out["numels"] = {k: v.numel() for k, v in worker.get_weights().items()}
    worker.close_weight_sync()
    shutdown_process_group()


def test_fsdp2_mixed_precision_over_a_bf16_config_keeps_fp32_masters(policy_dir: Path) -> None:
    out = run_ranks(fsdp2_master_rank, 1, str(policy_dir))
    assert out["share"] > 0.5, f"only {out['share']:.1%} of the weights moved at lr={LR:g}"
    assert out["weights"] == {"torch.float32"} and out["moments"] == {"torch.float32"}
    assert out["sizes"] and out["sizes"] == {k: 2 * out["numels"][k] for k in out["sizes"]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_hf_strategy_computes_in_bf16_over_fp32_masters(policy_dir: Path) -> None:
    """On CUDA the linears run under bf16 autocast while the weights they read stay fp32."""
    worker = actor(policy_dir, "bfloat16")
    assert str(worker.strategy.device).startswith("cuda")
    seen: set[str] = set()
    linear = next(m for m in worker.strategy.model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda _m, _i, out: seen.add(str(out.dtype)))
    assert changed_share(worker) > 0.5
    assert seen == {"torch.bfloat16"} and linear.weight.dtype == torch.float32
