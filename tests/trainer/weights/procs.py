"""Receiver processes for the weight-transport tests (importable by name for ``spawn``)."""

from __future__ import annotations

from typing import Any

PROMPTS = [[1, 5, 9, 3], [7, 2], [4, 4, 4, 8, 1]]


def greedy(engine: Any) -> list[list[int]]:
    """Greedy continuations of ``PROMPTS`` (the engine's own batch path)."""
    from trainer.strategies.base import GenerationRequest

    results = engine.generate_batch(
        [
            GenerationRequest(f"r{i}", p, max_new_tokens=6, temperature=0.0)
            for i, p in enumerate(PROMPTS)
        ]
    )
    return [r.token_ids for r in results]


def make_engine(seed: int) -> Any:
    import torch

    from tests.trainer.strategies.dist_workers import tiny_qwen2
    from trainer.strategies.hf_engine import HFEngine
    from trainer.weights.versioned import VersionedEngine

    torch.set_num_threads(1)
    model = tiny_qwen2(seed=seed, tie=True)
    # HF's 0.02-std init makes every greedy continuation repeat its last token
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    return VersionedEngine(HFEngine(model, eos_token_id=-1, pad_token_id=0))


def receiver(inbox: Any, outbox: Any) -> None:
    """Load a sync over shared memory, then one over a gloo broadcast group; report the greedy
    outputs."""
    try:
        from trainer.weights.transport import BroadcastGroup, open_bucket

        engine = make_engine(seed=99)
        outbox.put(("before", greedy(engine.engine)))
        version, names = inbox.get(timeout=60)

        def buckets() -> Any:
            while (handle := inbox.get(timeout=60)) is not None:
                bucket, close = open_bucket(handle)
                yield bucket
                close()

        engine.load(buckets(), version=version, expected_names=names)
        outbox.put(("shm", engine.check(), greedy(engine.engine)))
        group = BroadcastGroup("127.0.0.1", inbox.get(timeout=60), 1, 2, timeout_s=30)
        served = group.receive_into(engine)
        outbox.put(("broadcast", served, greedy(engine.engine)))
        group = BroadcastGroup("127.0.0.1", inbox.get(timeout=60), 1, 2, timeout_s=30)
        next(group.receive())  # take the first bucket, then die mid-sync
        import os

        os._exit(0)
    except Exception as error:  # noqa: BLE001 - reported to the test
        import traceback

        outbox.put(("error", repr(error), traceback.format_exc()))
