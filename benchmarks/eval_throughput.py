"""``envhub eval --model`` against vLLM's real OpenAI server: episodes/s at concurrency 1, 8, 64,
side by side with a minimal sequential loop written with the ``openai`` SDK.

    python benchmarks/eval_throughput.py                 # 64 episodes per setting
    python benchmarks/eval_throughput.py --episodes 128 --concurrency 1 8 64

Both play the same env (``games/frozen-lake-v0`` 3x3, one-word moves, up to 6 turns) with the
same seeds against the same server: ``python -m vllm.entrypoints.openai.api_server`` on a tiny
random Llama (head size 32, so vLLM's CPU kernels take it; max 4 new tokens per turn,
temperature 1). The sequential loop is what a user writes by hand: reset, then
``client.chat.completions.create`` and ``env.step`` until the episode ends, one episode after
another. ``envhub.evaluate`` adds worker threads (one env each), the JSONL writer and the
summary. Prints episodes/s and requests/s per setting; the last line is
``eval_vs_sequential_64: X x`` (episodes/s at concurrency 64 over the sequential loop).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAKE = "games/frozen-lake-v0"
LAKE_KWARGS = {"action_format": "raw", "size": 3, "hole_fraction": 0.4, "max_turns": 6}


def sequential(client, model: str, episodes: int, max_tokens: int) -> tuple[float, int]:
    """The hand-written loop: seconds and requests for ``episodes`` episodes."""
    import envhub

    env = envhub.make(LAKE, **LAKE_KWARGS)
    requests, start = 0, time.perf_counter()
    for seed in range(episodes):
        messages, _ = env.reset(seed=seed)
        while True:
            reply = client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=1.0
            )
            requests += 1
            action = reply.choices[0].message.content or ""
            messages = [*messages, {"role": "assistant", "content": action}]
            observation, _, terminated, truncated, _ = env.step(action)
            messages += observation
            if terminated or truncated:
                break
    env.close()
    return time.perf_counter() - start, requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()

    import openai

    from envhub.evaluation import evaluate
    from tests.envhub.openai_servers import vllm_openai_server
    from trainer.models import build_policy, env_corpus

    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(
            Path(tmp) / "policy",
            env_corpus(LAKE, LAKE_KWARGS, episodes=60),
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            intermediate_size=128,
            seed=0,
        )
        with vllm_openai_server(policy, tool_parser=None, log=Path(tmp) / "vllm.log") as url:
            client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=120)
            [model] = [m.id for m in client.models.list()]
            sequential(client, model, 4, args.max_tokens)  # warm-up: first requests, env caches
            seconds, requests = sequential(client, model, args.episodes, args.max_tokens)
            base = args.episodes / seconds
            print(
                f"sequential openai loop    {base:7.2f} episodes/s  "
                f"{requests / seconds:7.1f} requests/s  ({seconds:.1f} s)"
            )
            ratio = {}
            for concurrency in args.concurrency:
                start = time.perf_counter()
                [summary] = evaluate(
                    [LAKE],
                    client=client,
                    model=model,
                    episodes=args.episodes,
                    temperature=1.0,
                    max_tokens=args.max_tokens,
                    concurrency=concurrency,
                    env_kwargs=LAKE_KWARGS,
                    out=Path(tmp) / f"eval-{concurrency}",
                )
                seconds = time.perf_counter() - start
                calls = summary.mean_turns * summary.episodes
                ratio[concurrency] = args.episodes / seconds / base
                print(
                    f"envhub eval c={concurrency:<3}          {args.episodes / seconds:7.2f} "
                    f"episodes/s  {calls / seconds:7.1f} requests/s  ({seconds:.1f} s; "
                    f"latency p50 {summary.latency_p50_s * 1e3:.0f} ms, "
                    f"failures {summary.failures or 0}; {ratio[concurrency]:.2f} x sequential)"
                )
    last = max(ratio)
    print(f"eval_vs_sequential_{last}: {ratio[last]:.2f} x")


if __name__ == "__main__":
    main()
