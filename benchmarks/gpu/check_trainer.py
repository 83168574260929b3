"""GPU check sections that go through the trainer's own entry points: a LoRA step, a packed step.

Unlike ``check.py``'s sections, which build strategies by hand, these load the 0.5B one-GPU
recipe (``examples/qwen2.5-0.5b-sokoban-1gpu.yaml``) with ``trainer.config.load_config`` and the
knobs under test as overrides, start its roles with ``trainer.roles.start_roles`` (local backend:
the workers live in this process) and train through ``ActorCluster.train_step``, the call the
pipeline makes. The policy is a random model of Qwen2.5-0.5B's shape with a Qwen2 tokenizer of
Sokoban's texts (``tests.gpu.recipe_models``; nothing is downloaded). Every batch row is the
recipe's longest row (``trainer.memory``'s assumption), so the peak memory can be set against
the estimate for the same config.

``lora``    ``model.lora.rank=16`` (all linear layers): train tokens/s, MFU at 4N FLOPs per
            token (a frozen base computes no weight gradients), peak memory / estimate.
            Skipped, saying so, while the knob trains every parameter (LoRA not wired yet).
``packed``  ``train.packing=true`` with ``train.micro_batch_tokens`` = one longest row, on a
            heavy-tailed batch (one longest row among 15 short ones): tokens/s of real tokens
            packed and padded (the same budget without packing), MFU at 6N. Skipped while the
            micro-batches come out as padded rows (packing not wired yet).

``--smoke`` runs both on the CPU with a tiny model of the same family.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "qwen2.5-0.5b-sokoban-1gpu.yaml"
PEAK_BF16 = 989e12
"""H100/H200 SXM dense bf16 tensor-core peak, FLOP/s (as ``check.py``)."""
SMOKE_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4352,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}
_POLICY: dict[bool, Path] = {}


def _policy(smoke: bool) -> Path:
    """The random policy folder (built once per process)."""
    if smoke not in _POLICY:
        from transformers.utils import logging as hf_logging

        from tests.gpu.recipe_models import QWEN2_5_0_5B, random_policy

        hf_logging.disable_progress_bar()

        folder = Path(tempfile.mkdtemp(prefix="envhub-gpu-check-")) / "policy"
        _POLICY[smoke] = random_policy(
            folder,
            SMOKE_SHAPE if smoke else QWEN2_5_0_5B,
            env_id="games/sokoban-v0",
            env_kwargs={"max_turns": 30},
            dtype="float32" if smoke else "bfloat16",
        )
    return _POLICY[smoke]


def _config(smoke: bool, overrides: list[str]) -> Any:
    """The recipe's config on the random policy, with ``overrides``."""
    from trainer.config import load_config

    policy = _policy(smoke)
    fixed = [
        f"model.path={policy}",
        f"output_dir={policy.parent / 'run'}",
        "logging.progress=false",
    ]
    if smoke:
        fixed += ["model.dtype=float32", "rollout.max_turns=1", "rollout.max_new_tokens=8"]
    return load_config(RECIPE, [*fixed, *overrides])


def _start(smoke: bool, overrides: list[str]) -> tuple[Any, Any]:
    """The config with ``overrides`` and its running roles."""
    from trainer.roles import start_roles

    cfg = _config(smoke, overrides)
    return cfg, start_roles(cfg, _policy(smoke))


def _row_tokens(cfg: Any) -> tuple[int, int]:
    """(the recipe's longest row, the vocabulary) as ``trainer.memory`` sees them."""
    from trainer.memory import model_shape
    from trainer.memory_roles import sequence_tokens

    shape = model_shape(cfg)[0]
    return sequence_tokens(cfg, shape)[0], shape.vocab_size


def _params(roles: Any) -> tuple[int, int]:
    """(parameters, trained parameters) of the actor's model."""
    unique = {id(p): p for p in _strategy(roles).model.parameters()}.values()
    return sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad)


def _strategy(roles: Any) -> Any:
    """The actor's strategy (local backend: the worker is an object of this process)."""
    return roles.actor._workers[0].strategy


def _batch(lengths: list[int], width: int, vocab: int) -> Any:
    """A PPO batch of right-padded rows of these lengths (all tokens are the policy's)."""
    import torch

    from trainer.controller.batch import Batch

    g = torch.Generator().manual_seed(0)
    rows = len(lengths)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return Batch(
        {
            "input_ids": torch.randint(1, vocab, (rows, width), generator=g) * mask,
            "attention_mask": mask,
            "response_mask": mask.clone(),
            "old_logprobs": torch.zeros(rows, width),
            "advantages": torch.randn(rows, width, generator=g),
        }
    )


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_steps(roles: Any, batch: Any, steps: int) -> tuple[float, float | None]:
    """(seconds per train step after one warm-up step, peak GiB of the timed steps)."""
    import torch

    device = str(_strategy(roles).device)
    roles.actor.train_step(batch)
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        roles.actor.train_step(batch)
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return seconds, peak


def _estimated_gib(cfg: Any) -> float:
    """What ``trainer.memory`` says the actor's train step and the engine's weights take."""
    from trainer.memory import estimate

    plan = estimate(cfg)
    actor = sum(
        p.nbytes
        for p in plan.roles["actor_train"].parts
        if p.kind in ("params", "optimizer") or p.work == "train"
    )
    engine = sum(p.nbytes for p in plan.roles["actor_infer"].parts if p.kind in ("engine", "fixed"))
    return (actor + engine) / 2**30


def _close(roles: Any) -> None:
    import torch

    roles.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section_lora(s: Any) -> dict[str, Any]:
    cfg, roles = _start(s.smoke, ["model.lora.rank=16"])
    try:
        total, trained = _params(roles)
        if trained == total:
            return {
                "skipped": f"model.lora.rank=16 trains all {total:,} parameters: LoRA is not "
                "wired into the trainer yet"
            }
        width, vocab = _row_tokens(cfg)
        rows = 2 if s.smoke else 8
        seconds, peak = _timed_steps(roles, _batch([width] * rows, width, vocab), s.steps)
        tokens_per_s = rows * width / seconds
        figures = {
            "params": total,
            "trained_params": trained,
            "rows": rows,
            "row_tokens": width,
            "step_s": seconds,
            "tokens_per_s": tokens_per_s,
            "mfu_4n": 4 * total * tokens_per_s / PEAK_BF16,
            "peak_mem_gib": peak,
            "estimated_gib": _estimated_gib(cfg),
        }
        if peak:
            figures["estimate_over_peak"] = figures["estimated_gib"] / peak
        return figures
    finally:
        _close(roles)


def section_packed(s: Any) -> dict[str, Any]:
    width, vocab = _row_tokens(_config(s.smoke, []))
    # one longest row among 15 short ones (an agentic batch: most episodes end early)
    lengths = [width] + [max(8, width // d) for d in (4, 6, 8, 10, 12, 16, 20, 24) * 2][:15]
    batch = _batch(lengths, width, vocab)
    results: dict[str, Any] = {}
    for tag, packing in (("packed", "true"), ("padded", "false")):
        _, roles = _start(
            s.smoke, [f"train.packing={packing}", f"train.micro_batch_tokens={width}"]
        )
        try:
            if tag == "packed":
                columns = {k: batch[k] for k in ("input_ids", "attention_mask")}
                micros = _strategy(roles)._micro_batches(columns)
                if not any("_packed_ids" in m for m in micros):  # trainer.strategies.packing
                    return {
                        "skipped": "train.packing=true built the same padded micro-batches: "
                        "packing is not wired into the trainer yet"
                    }
            seconds, peak = _timed_steps(roles, batch, s.steps)
            total, _ = _params(roles)
            results[tag] = {
                "step_s": seconds,
                "real_tokens": sum(lengths),
                "padded_tokens": len(lengths) * width,
                "tokens_per_s": sum(lengths) / seconds,
                "mfu_6n": 6 * total * sum(lengths) / seconds / PEAK_BF16,
                "peak_mem_gib": peak,
            }
        finally:
            _close(roles)
    results["packed_over_padded"] = (
        results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    )
    return results


SECTIONS = {"lora": section_lora, "packed": section_packed}
"""These sections, for ``check.py``'s table."""

__all__ = ["SECTIONS"]
