"""How close is ``trainer.memory``'s estimate? Estimated vs measured train-step memory on CPU.

For each case the actor's training strategy (``hf``, as ``envhub train`` builds it from the
config) loads the policy and trains one PPO micro-batch of the rows the estimate assumes (one
padded token, so the attention mask exists as in training); the measured figure is the peak of
tensor bytes allocated from loading the model to the end of the step (torch's profiler,
``tests/trainer/memory_meter.py``), the estimate is the actor's weights, gradients, AdamW
moments, activations and logits for the same config. Cases:

``quickstart``  ``examples/quickstart.yaml`` (0.1M-parameter Llama, fp32, 32 rows)
``llama-bf16``  a 30M-parameter Llama (512 wide, 8 layers, 32k vocabulary) in bf16, 4 rows
``llama-lora``  the same with peft LoRA (rank 16, all linear layers) put on by hand, as
                ``model.lora`` describes it (the trainer's LoRA is not wired yet)

Also printed: the H200 peaks the GPU check recorded (``benchmarks/gpu/results``) against the
estimate. The last line is ``memory_estimate_over_measured: X x``, the largest ratio of the CPU
cases (above 1: the estimate is the larger).

    python benchmarks/memory_estimate.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(cfg: Any, policy: Path, lora_rank: int | None) -> tuple[int, int]:
    """(estimated, measured) bytes of one PPO micro-batch of the actor's training."""
    import torch

    from tests.trainer.memory_meter import peak_allocated_bytes
    from trainer.memory import estimate
    from trainer.models import load_policy
    from trainer.strategies.registry import make_train_strategy
    from trainer.workers.actor import ppo_loss_fn

    plan = estimate(cfg)
    estimated = sum(
        p.nbytes
        for p in plan.roles["actor_train"].parts
        if p.kind in ("params", "optimizer") or p.work == "train"
    )
    rows, width = cfg.train.micro_batch_size, plan.sequence_tokens
    batch = {
        "input_ids": torch.randint(0, plan.shape.vocab_size, (rows, width)),
        "attention_mask": torch.ones(rows, width, dtype=torch.long),
        "response_mask": torch.ones(rows, width, dtype=torch.long),
        "old_logprobs": torch.zeros(rows, width),
        "advantages": torch.randn(rows, width),
    }
    batch["attention_mask"][0, -1] = 0

    def step() -> None:
        model, _ = load_policy(policy, dtype=cfg.model.dtype)
        if lora_rank is not None:
            import peft

            config = peft.LoraConfig(r=lora_rank, target_modules="all-linear")
            model = peft.get_peft_model(model, config)
        strategy = make_train_strategy("hf", model, **cfg.train.options())
        strategy.train_step(batch, ppo_loss_fn(cfg.algorithm.loss), with_entropy=True)

    torch.manual_seed(0)
    return estimated, peak_allocated_bytes(step)


def llama_policy(folder: Path) -> Path:
    """A 30M-parameter Llama (32k vocabulary, more rows than its small tokenizer has tokens, as
    Qwen's checkpoints have), saved with a tokenizer of Frozen Lake's texts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models import build_tokenizer, env_corpus

    tokenizer = build_tokenizer(env_corpus("games/frozen-lake-v0", {}, episodes=50), "bpe")
    config = AutoConfig.for_model(
        "llama",
        vocab_size=32000,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        intermediate_size=1408,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    from trainer.config import load_config
    from trainer.memory import estimate
    from trainer.memory_roles import GIB
    from trainer.roles import prepare_policy

    work = Path(tempfile.mkdtemp(prefix="memory-estimate-"))
    quickstart = load_config(ROOT / "examples/quickstart.yaml", [f"output_dir={work / 'qs'}"])
    big = llama_policy(work / "llama")
    common = [f"model.path={big}", "model.dtype=bfloat16", "train.micro_batch_size=4"]
    rows = 1  # 512 prompt + 1 x (448 + 64) = 1,024 tokens per row
    common += [f"rollout.max_turns={rows}", "rollout.max_new_tokens=448"]
    cases = {
        "quickstart": (quickstart, prepare_policy(quickstart), None),
        "llama-bf16": (load_config(None, common), big, None),
        "llama-lora": (load_config(None, [*common, "model.lora.rank=16"]), big, 16),
    }
    ratios = []
    for name, (cfg, policy, rank) in cases.items():
        estimated, measured = measure(cfg, policy, rank)
        ratios.append(estimated / measured)
        print(
            f"{name:12s} estimate {estimated / 2**20:9.1f} MiB  measured {measured / 2**20:9.1f} "
            f"MiB  ratio {estimated / measured:.3f}",
            flush=True,
        )
    recorded = json.loads((ROOT / "benchmarks/gpu/results/2026-11-29-h200-full.json").read_text())
    shape = work / "qwen05b"
    shape.mkdir()
    from tests.gpu.recipe_models import QWEN2_5_0_5B, config_json

    config_json(shape, QWEN2_5_0_5B)
    for section, checkpointing in (("plain", False), ("activation_checkpointing", True)):
        cfg = load_config(
            None,
            [
                f"model.path={shape}",
                "model.dtype=float32",
                "roles.actor_train.strategy=fsdp2",
                f"roles.actor_train.strategy_args.activation_checkpointing={checkpointing}",
                "train.micro_batch_size=4",
                "rollout.max_turns=1",
                "rollout.max_new_tokens=448",
                "cluster.device_memory_gib=141",
            ],
        )
        parts = estimate(cfg).roles["actor_train"].parts
        estimated = sum(p.nbytes for p in parts if p.kind != "work" or p.work == "sft")
        peak = recorded["fsdp2"][section]["peak_mem_gib"]
        print(
            f"h200 fsdp2 {section}: estimate {estimated / GIB:.2f} GiB, recorded peak {peak:.2f} "
            f"GiB, ratio {estimated / GIB / peak:.3f}"
        )
    print(f"memory_estimate_over_measured: {max(ratios):.2f} x")


if __name__ == "__main__":
    main()
