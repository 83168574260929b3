"""``model.dtype: bfloat16``: the trainer keeps fp32 master weights and the engines bf16 ones; a
sync hands every engine the masters rounded to bf16, in half the bytes, on either transport."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.weights import sync_setup as S
from trainer.weights.sync import WeightSync
from trainer.weights.versioned import PolicyVersion


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_a_bf16_engine_receives_the_fp32_masters_rounded_in_half_the_bytes(
    model_dir: Path, transport: str
) -> None:
    from trainer.config import RoleConfig
    from trainer.workers.actor import ActorCluster
    from trainer.workers.infer import InferCluster

    common = {"model_path": str(model_dir), "dtype": "bfloat16"}
    actor = ActorCluster(
        "actor_train",
        RoleConfig(strategy="hf", device_mapping=[]),
        backend="local",
        worker_kwargs={**common, "optim": {"lr": 0.05}},
    )
    infer = InferCluster(
        "actor_infer",
        RoleConfig(strategy="hf", device_mapping=[], num_workers=2),
        backend="local",
        worker_kwargs=common,
    )
    try:
        S.train_away(actor, model_dir)
        masters = actor.get_weights()
        assert {str(t.dtype) for t in masters.values()} == {"torch.float32"}
        sync = WeightSync(actor, infer, policy=PolicyVersion(), transport=transport, bucket_mb=0.1)
        report = sync.sync()
        sent = {k: v.to(torch.bfloat16) for k, v in masters.items()}
        assert S.differing(sent, infer, 0) == [] and S.differing(sent, infer, 1) == []
        model = actor._workers[0].strategy.model  # (parameters(): a tied one once, as sent)
        assert report.nbytes == 2 * sum(p.numel() for p in model.parameters())
    finally:
        actor.shutdown()
        infer.shutdown()
