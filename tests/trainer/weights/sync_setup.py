"""For the weight-sync tests: a policy folder with non-degenerate weights, clusters, checks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS = [[1, 5, 9, 3], [7, 2], [4, 4, 4, 8, 1], [3, 1, 4, 1, 5, 9, 2, 6]]


def spread_policy(source: Path, target: Path, seed: int = 0) -> Path:
    """``source``'s policy with weights drawn at std 0.3, so greedy continuations depend on them.

    (HF's 0.02-std init makes a tiny model repeat its last token whatever the weights, so
    equal greedy outputs would prove nothing.)
    """
    import torch

    from trainer.models import load_policy

    model, tokenizer = load_policy(source)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def make_clusters(model_dir: Path, **actor_kwargs: Any) -> tuple[Any, Any]:
    """A one-rank hf trainer and two hf engines, in this process (the local backend)."""
    from trainer.config import RoleConfig
    from trainer.workers.actor import ActorCluster
    from trainer.workers.infer import InferCluster

    common = {"model_path": str(model_dir)}
    actor = ActorCluster(
        "actor_train",
        RoleConfig(strategy="hf", device_mapping=[]),
        backend="local",
        worker_kwargs={**common, "optim": {"lr": 0.05}, **actor_kwargs},
    )
    infer = InferCluster(
        "actor_infer",
        RoleConfig(strategy="hf", device_mapping=[], num_workers=2),
        backend="local",
        worker_kwargs=common,
    )
    return actor, infer


def dying_at(update_weights: Callable[[Any], None], index: int) -> Callable[[Any], None]:
    """``update_weights`` that raises "engine process died" when it reaches tensor ``index``."""

    def dying_update(weights: Any) -> None:
        def first_few() -> Any:
            for at, item in enumerate(weights):
                if at == index:
                    raise RuntimeError("engine process died")
                yield item

        update_weights(first_few())

    return dying_update


def train_away(actor: Any, model_dir: Path) -> None:
    """Three behaviour-cloning steps: the trainer's weights move away from the engines'."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    for _ in range(3):
        actor.sft_step(random_batch(vocab))


def random_batch(vocab: int, rows: int = 8, width: int = 10, seed: int = 3) -> Any:
    """A behaviour-cloning batch of random tokens (training on it moves away from the engine's
    weights)."""
    import torch

    from trainer.controller.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    return Batch({"input_ids": ids, "attention_mask": mask, "response_mask": mask.clone()})


def requests(max_new_tokens: int = 6) -> list[Any]:
    from trainer.strategies.base import GenerationRequest

    return [
        GenerationRequest(f"g{i}", p, max_new_tokens=max_new_tokens, temperature=0.0)
        for i, p in enumerate(PROMPTS)
    ]


def engine_greedy(infer: Any) -> list[Any]:
    """Greedy results of the inference cluster's engines (the requests split over the ranks, in
    order)."""
    batch = requests()
    size = -(-len(batch) // infer.world_size)
    parts = [batch[start : start + size] for start in range(0, len(batch), size)]

    async def run() -> list[list[Any]]:
        return await asyncio.gather(
            *(infer.generate_on(rank, part) for rank, part in enumerate(parts))
        )

    return [result for part in asyncio.run(run()) for result in part]


def trainer_greedy(weights: dict[str, Any], model_path: Path) -> list[list[int]]:
    """Greedy continuations of an HF model holding exactly the trainer's gathered weights."""
    import torch

    from trainer.models import load_policy
    from trainer.strategies.hf_engine import HFEngine

    model, tokenizer = load_policy(model_path)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    engine = HFEngine(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
        device="cpu",
    )
    with torch.no_grad():
        return [r.token_ids for r in engine.generate_batch(requests())]


def trainer_logprobs(actor: Any, results: list[Any]) -> list[list[float]]:
    """The trainer's own (sharded) forward: log-probs of each engine continuation."""
    import torch

    from trainer.controller.batch import Batch

    rows = [p + r.token_ids for p, r in zip(PROMPTS, results)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    out = actor.compute_logprobs(Batch({"input_ids": ids, "attention_mask": mask}))["logprobs"]
    return [
        out[i, len(p) : len(p) + len(r.token_ids)].tolist()
        for i, (p, r) in enumerate(zip(PROMPTS, results))
    ]


def trainer_engine_weights(actor: Any) -> dict[str, Any]:
    """The tensors the trainer sends an engine (LoRA merged in), as its rank 0 computes them."""
    return {name: tensor.detach().clone() for name, tensor in actor._workers[0]._full_weights()}


def differing(trainer: dict[str, Any], infer: Any, rank: int) -> list[str]:
    """Names of ``trainer`` tensors that inference worker ``rank``'s engine does not hold
    bitwise (local backend: the engine is in this process)."""
    import torch

    engine = infer._workers[rank].engine
    held = getattr(engine, "engine", engine).model.state_dict()
    return [
        name
        for name, tensor in trainer.items()
        if name not in held or not torch.equal(tensor.to(held[name].dtype), held[name])
    ]
