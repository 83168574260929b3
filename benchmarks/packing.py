"""Training tokens/s on heavy-tailed batches: packed rows vs padded rows, same model, same run.

    python benchmarks/packing.py                 # both length mixes, 5 timed steps each way
    python benchmarks/packing.py --steps 10 --hidden 256

Two batches of 128 trajectories, trained by ``HFTrainStrategy`` with the quickstart's settings
(micro-batches of 32 rows, one optimiser step per batch, a token-mean NLL on the response
tokens):

* ``quickstart``: the quickstart's own length mix - Frozen Lake episodes of the sloppy
  demonstrator (60% "down"), rendered with the quickstart's tokenizer and chat template (1-6
  turns, so a 2-6x spread);
* ``10x``: random tokens with lengths log-uniform between 20 and 200 (a 10x spread, the shape
  of agentic batches: many short episodes, a few long ones).

``padded``: rows right-padded and trimmed per micro-batch to its longest row (what the trainer
did before packing). ``packed``: ``train.packing`` with ``train.micro_batch_tokens`` = 32 x the
longest row (the same memory budget per micro-batch as a padded one). Both start from the same
weights and alternate step by step; the figure is real (non-padding) tokens per second, the
median over ``--steps`` steps after a warm-up. Last line ``packing_speedup_10x: X x``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def nll(out: Any, mb: Any) -> tuple[Any, dict[str, float]]:
    from trainer.algos.losses import aggregate

    loss = aggregate(-out.logprobs, mb["response_mask"], "token-mean")
    return loss, {}


def quickstart_batch(policy: Path, rows: int) -> dict[str, Any]:
    """``rows`` quickstart demonstrations (the sloppy expert) as a padded training batch."""
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.rollout.collate import collate
    from trainer.rollout.trajectory import ChatRenderer
    from trainer.sft import expert_trajectories

    cfg = load_config(ROOT / "examples" / "quickstart.yaml")
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(policy))
    data = expert_trajectories(
        cfg.env.ids,
        cfg.env.kwargs_for,
        renderer,
        episodes=rows,
        max_turns=cfg.rollout.max_turns,
        noise=cfg.sft.expert_noise,
        noise_action=cfg.sft.noise_action,
        seed=1,
    )
    batch = collate(data, renderer.tokenizer.pad_token_id)
    return {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}


def spread_batch(rows: int, vocab: int, low: int = 20, high: int = 200) -> dict[str, Any]:
    """Random tokens, lengths log-uniform in [low, high], the second half of each a response."""
    import torch

    rng = random.Random(0)
    lengths = [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(rows)]
    width = max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    response = torch.zeros(rows, width)
    generator = torch.Generator().manual_seed(0)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, vocab, (n,), generator=generator)
        mask[row, :n] = 1
        response[row, n // 2 : n] = 1
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response}


def compare(model: Any, batch: dict[str, Any], steps: int) -> dict[str, float]:
    """Median real tokens/s of a train step, padded vs packed (alternating, after a warm-up)."""
    from trainer.strategies.hf import HFTrainStrategy

    lengths = batch["attention_mask"].sum(-1)
    real, longest = int(lengths.sum()), int(lengths.max())
    strategies = {
        "padded": HFTrainStrategy(copy.deepcopy(model), lr=1e-4, micro_batch_size=32),
        "packed": HFTrainStrategy(
            copy.deepcopy(model),
            lr=1e-4,
            micro_batch_size=32,
            packing=True,
            micro_batch_tokens=32 * longest,
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in strategies}
    for step in range(steps + 1):
        for name, strategy in strategies.items():
            started = time.perf_counter()
            strategy.train_step(batch, nll)
            if step:  # the first step of each is a warm-up
                seconds[name].append(time.perf_counter() - started)
    padded_tokens = len(lengths) * longest
    rates = {name: real / statistics.median(times) for name, times in seconds.items()}
    return {
        **rates,
        "speedup": rates["packed"] / rates["padded"],
        "fill": real / padded_tokens,
        "rows": float(len(lengths)),
        "mean_len": real / len(lengths),
        "max_len": float(longest),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy and mix")
    parser.add_argument("--rows", type=int, default=128, help="trajectories per batch")
    parser.add_argument("--hidden", type=int, default=64, help="model width (quickstart: 64)")
    args = parser.parse_args(argv)

    from trainer.config import load_config
    from trainer.models import load_policy
    from trainer.roles import prepare_policy

    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="packing-bench-") as tmp:
        cfg = load_config(
            ROOT / "examples" / "quickstart.yaml",
            [f"output_dir={tmp}", f"model.tiny.hidden_size={args.hidden}"],
        )
        policy = prepare_policy(cfg)
        model, tokenizer = load_policy(policy)
        mixes = {
            "quickstart": quickstart_batch(policy, args.rows),
            "10x": spread_batch(args.rows, len(tokenizer)),
        }
        print(
            f"{'mix':>10} {'rows':>5} {'mean len':>8} {'max len':>7} {'fill':>6} | "
            f"{'padded tok/s':>12} {'packed tok/s':>12} | speedup",
            flush=True,
        )
        results = {}
        for name, batch in mixes.items():
            r = results[name] = compare(model, batch, args.steps)
            print(
                f"{name:>10} {int(r['rows']):>5} {r['mean_len']:>8.1f} {int(r['max_len']):>7} "
                f"{r['fill']:>6.2f} | {r['padded']:>12.0f} {r['packed']:>12.0f} | "
                f"{r['speedup']:.2f} x",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"packing_speedup_10x: {results['10x']['speedup']:.2f} x")


if __name__ == "__main__":
    main()
