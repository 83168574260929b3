"""Generation throughput: ``VLLMEngine`` (vLLM) vs ``HFEngine`` (torch), same model and requests.

For each model size a random Llama (head size 32 or 64, which vLLM's CPU attention supports)
and the Frozen Lake BPE tokenizer are built and saved once; both engines load that folder.
The workload is what a rollout step sends: ``--requests`` chat prompts of different lengths
submitted at once through the async ``generate`` (each engine batches them its own way:
``HFEngine`` one padded batch, vLLM continuous batching), sampled at temperature 1 up to
``--new-tokens`` tokens each (EOS may end a request early). Throughput is new tokens per
second of wall time, best of ``--repeats`` runs after one warm-up round; engine start-up
time is reported separately. Both engines live in this process and their runs alternate
(HF, vLLM, HF, vLLM, ...) so that both see the same share of the shared CPU.

    python benchmarks/vllm_engine.py                      # tiny and small models
    python benchmarks/vllm_engine.py --sizes tiny --repeats 1

The last line is ``vllm_vs_hf_gen: X x`` - vLLM tokens/s / HF tokens/s for the largest model.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = {  # name -> (hidden, layers, heads, intermediate)
    "tiny": (64, 2, 2, 128),  # ~0.1M parameters, like the quickstart's policy
    "small": (256, 4, 4, 1024),  # ~3.5M
    "medium": (512, 8, 8, 1536),  # ~20M
}
TEXTS = [
    "Your first move?",
    "You moved right.\n\nS F H\nF P F\nH F G\n\nYour next move?",
    "up",
    "You fell into a hole.\n\nS F H\nF F P\nH F G\n\nYour next move?",
]


def build(name: str, root: Path) -> Path:
    from trainer.models import build_policy, env_corpus

    hidden, layers, heads, inter = SHAPES[name]
    return build_policy(
        root / name,
        env_corpus("games/frozen-lake-v0", {"action_format": "raw", "size": 3}, episodes=60),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=inter,
        max_positions=1024,
        seed=0,
    )


def requests(tokenizer: Any, count: int, new_tokens: int, tag: str) -> list[Any]:
    from trainer.strategies.base import GenerationRequest

    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": TEXTS[i % len(TEXTS)] * (1 + i % 3)}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )
        for i in range(count)
    ]
    return [
        GenerationRequest(f"{tag}{i}", p, new_tokens, temperature=1.0)
        for i, p in enumerate(prompts)
    ]


def timed_run(
    engine: Any, tokenizer: Any, count: int, new_tokens: int, tag: str
) -> tuple[float, int]:
    """New tokens/s of one run of ``count`` concurrent requests, and the tokens it made."""

    async def once() -> tuple[float, int]:
        batch = requests(tokenizer, count, new_tokens, tag)
        started = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in batch))
        elapsed = time.perf_counter() - started
        if not hasattr(engine, "shutdown"):
            await engine.close()  # HFEngine's batching task belongs to this event loop
        tokens = sum(len(r.token_ids) for r in results)
        return tokens / elapsed, tokens

    return asyncio.run(once())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="tiny,small", help=f"comma-separated, of {sorted(SHAPES)}"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from trainer.models import count_parameters, load_policy
    from trainer.strategies.hf_engine import HFEngine
    from trainer.strategies.vllm_engine import VLLMEngine

    print(
        f"torch threads: {torch.get_num_threads()}; {args.requests} requests x up to "
        f"{args.new_tokens} new tokens, temperature 1"
    )
    ratio = None
    with tempfile.TemporaryDirectory(prefix="vllm_bench_") as tmp:
        for name in args.sizes.split(","):
            folder = build(name, Path(tmp))
            model, tokenizer = load_policy(folder)
            params = count_parameters(model)
            started = time.perf_counter()
            hf = HFEngine(
                model,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                seed=0,
            )
            hf_start = time.perf_counter() - started
            started = time.perf_counter()
            vllm = VLLMEngine(str(folder), seed=0, kv_cache_gib=1.0, max_model_len=1024)
            vllm_start = time.perf_counter() - started
            runs: dict[str, list[tuple[float, int]]] = {"hf": [], "vllm": []}
            try:
                for k in range(args.repeats + 1):  # interleaved, so both see the same machine load
                    for key, engine in (("hf", hf), ("vllm", vllm)):
                        run = timed_run(
                            engine, tokenizer, args.requests, args.new_tokens, f"{key}{k}-"
                        )
                        if k:  # the first round warms up
                            runs[key].append(run)
                steps = vllm.stats["steps"]
            finally:
                vllm.shutdown()
            (hf_rate, hf_tokens), (vllm_rate, vllm_tokens) = max(runs["hf"]), max(runs["vllm"])
            ratio = vllm_rate / hf_rate
            median = statistics.median(v[0] for v in runs["vllm"]) / statistics.median(
                h[0] for h in runs["hf"]
            )
            print(
                f"{name} ({params / 1e6:.2f}M params): HFEngine {hf_rate:,.0f} new tok/s "
                f"({hf_tokens} tokens, start {hf_start:.1f} s); VLLMEngine {vllm_rate:,.0f} new "
                f"tok/s ({vllm_tokens} tokens, start {vllm_start:.1f} s, {steps} engine steps in "
                f"all); best/best {ratio:.2f} x, median/median {median:.2f} x",
                flush=True,
            )
    print(f"vllm_vs_hf_gen: {ratio:.2f} x")


if __name__ == "__main__":
    main()
