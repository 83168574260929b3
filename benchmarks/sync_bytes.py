"""Bytes one full weight sync moves for a tied-embedding model, as the broadcast and gathered paths
pack them (``trainer.weights.buckets``), against the bytes of the model's ``state_dict``.

    python benchmarks/sync_bytes.py                   # Qwen2.5-0.5B's shape, bf16
    python benchmarks/sync_bytes.py --layers 2        # quick

A random model of Qwen2.5-0.5B's shape (``tie_word_embeddings``: ``lm_head.weight`` is the input
embedding) is built on the CPU; ``HFTrainStrategy.full_weights()`` is grouped into buckets as a
sync groups it and each bucket's buffer is sized (``packed_bytes``). A count, not a time: the
machine's load does not change it. Last line ``sync_bytes_saved: X %`` (the share of the
``state_dict``'s bytes a sync no longer moves).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (0.5B: 24)")
    parser.add_argument("--bucket-mb", type=int, default=512)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.strategies.hf import HFTrainStrategy
    from trainer.weights.buckets import group_tensors, packed_bytes

    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    strategy = HFTrainStrategy(model, trainable=False)
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    names = [name for name, _ in strategy.full_weights()]
    buckets = list(group_tensors(strategy.full_weights(), args.bucket_mb << 20))
    sent = sum(packed_bytes(bucket) for bucket in buckets)
    print(f"names delivered: {len(names)} (state_dict: {len(model.state_dict())})")
    print(f"state_dict bytes: {whole / 1e9:.3f} GB; a sync moves {sent / 1e9:.3f} GB")
    print(f"sync_bytes_saved: {(whole - sent) / whole * 100:.1f} %")


if __name__ == "__main__":
    main()
