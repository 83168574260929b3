"""The embedded HF engine's generation speed: this tree's ``HFEngine`` vs a baseline's.

The baseline is ``trainer/strategies/hf_engine.py`` of another source tree (``--baseline-src``,
e.g. a ``git worktree`` of the commit before the change), loaded into this process under
another module name; both engines get the same model object and alternate runs (baseline,
current, baseline, ...), so both see the same share of the machine. Two workloads:

- ``burst`` - ``benchmarks/vllm_engine.py``'s setting: ``--requests`` chat prompts of
  different lengths submitted at once, temperature 1, up to ``--new-tokens`` each; new
  tokens per second of wall time, best of ``--repeats`` after one warm-up round.
- ``turns`` - what a rollout asks of it: ``--requests`` episodes, each sending its next turn
  as soon as its previous one returned (its prompt grown by the reply), ``--turns`` turns,
  each with its own budget (1 to ``--new-tokens``, a fixed seeded draw, the same for both
  engines), named ``episode/turn`` as rollouts name them. An engine that admits requests
  between decoding steps serves a new turn at once (one that runs whole batches makes it wait
  for the batch's longest row), and one that keeps an ended turn's KV cache prefills only the
  next turn's new tokens.

    git worktree add /tmp/hf-base <commit>
    python benchmarks/hf_engine.py --baseline-src /tmp/hf-base [--sizes tiny,small]

Last line: ``hf_engine_speedup: X x`` (burst workload, the largest model run: current
tokens/s over the baseline's, best over best).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_engine import SHAPES, build, requests


def load_baseline(src: Path) -> Any:
    """The baseline tree's ``hf_engine`` module (it imports the rest from this tree)."""
    path = src / "trainer" / "strategies" / "hf_engine.py"
    if not path.is_file():
        sys.exit(f"--baseline-src {src}: no {path.relative_to(src)} there")
    spec = importlib.util.spec_from_file_location("baseline_hf_engine", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def burst(engine: Any, tokenizer: Any, count: int, new_tokens: int, tag: str) -> float:
    """New tokens/s of ``count`` requests sent at once."""

    async def once() -> float:
        batch = requests(tokenizer, count, new_tokens, tag)
        started = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in batch))
        elapsed = time.perf_counter() - started
        await engine.close()
        return sum(len(r.token_ids) for r in results) / elapsed

    return asyncio.run(once())


def turns(engine: Any, tokenizer: Any, count: int, new_tokens: int, rounds: int, tag: str) -> float:
    """New tokens/s of ``count`` episodes of ``rounds`` turns with seeded budgets."""
    from trainer.strategies.base import GenerationRequest

    draw = random.Random(0)
    budgets = [[draw.randint(1, new_tokens) for _ in range(rounds)] for _ in range(count)]
    first = requests(tokenizer, count, new_tokens, tag)

    async def episode(i: int) -> int:
        prompt, made = list(first[i].prompt_ids), 0
        for k, budget in enumerate(budgets[i]):
            request = GenerationRequest(f"{tag}{i}/{k}", prompt, budget, temperature=1.0)
            result = await engine.generate(request)
            prompt += result.token_ids
            made += len(result.token_ids)
        return made

    async def once() -> float:
        started = time.perf_counter()
        made = sum(await asyncio.gather(*(episode(i) for i in range(count))))
        elapsed = time.perf_counter() - started
        await engine.close()
        return made / elapsed

    return asyncio.run(once())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True)
    parser.add_argument(
        "--sizes", default="tiny,small", help=f"comma-separated, of {sorted(SHAPES)}"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from trainer.models import count_parameters, load_policy
    from trainer.strategies.hf_engine import HFEngine

    baseline = load_baseline(args.baseline_src)
    print(
        f"torch threads: {torch.get_num_threads()}; {args.requests} requests x up to "
        f"{args.new_tokens} new tokens, temperature 1; baseline {args.baseline_src}"
    )
    speedup = None
    with tempfile.TemporaryDirectory(prefix="hf_engine_bench_") as tmp:
        for name in args.sizes.split(","):
            model, tokenizer = load_policy(build(name, Path(tmp)))
            ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
            engines = {
                "baseline": baseline.HFEngine(model, seed=0, **ids),
                "current": HFEngine(model, seed=0, **ids),
            }
            rates: dict[tuple[str, str], list[float]] = {}
            for k in range(args.repeats + 1):  # the first round warms up
                for key, engine in engines.items():
                    for workload in ("burst", "turns"):
                        tag = f"{key}{k}-"
                        rate = (
                            burst(engine, tokenizer, args.requests, args.new_tokens, tag)
                            if workload == "burst"
                            else turns(
                                engine, tokenizer, args.requests, args.new_tokens, args.turns, tag
                            )
                        )
                        if k:
                            rates.setdefault((workload, key), []).append(rate)
            engines["current"].shutdown()
            print(f"{name} ({count_parameters(model) / 1e6:.2f}M params), new tok/s best (median):")
            for workload in ("burst", "turns"):
                old, new = rates[(workload, "baseline")], rates[(workload, "current")]
                ratio = max(new) / max(old)
                print(
                    f"  {workload:5s}  baseline {max(old):8,.0f} ({statistics.median(old):,.0f})  "
                    f"current {max(new):8,.0f} ({statistics.median(new):,.0f})  {ratio:.2f} x",
                    flush=True,
                )
                if workload == "burst":
                    speedup = ratio
    print(f"hf_engine_speedup: {speedup:.2f} x")


if __name__ == "__main__":
    main()
