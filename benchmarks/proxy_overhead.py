"""The training proxy's overhead per call: an ``openai`` SDK chat completion through
``trainer.rollout.proxy`` versus the same generation asked of the engine directly.

    python benchmarks/proxy_overhead.py               # 300 calls each way
    python benchmarks/proxy_overhead.py --calls 1000

Both ask the real embedded engine (``HFEngine`` on a ~0.1M-parameter Llama built here, 4 new
tokens, temperature 1) for a turn of the same Frozen Lake prompt, one call at a time, from a
client thread, with the engine on the rollout event loop (as in a run). The direct call submits
the prompt ids to the loop; the proxy call is ``client.chat.completions.create`` (one client,
loopback HTTP), which the proxy renders with the chat template, generates, records and answers.
Overhead = p50 through the proxy - p50 direct (the medians of interleaved calls). Also prints the
proxy's p50 with an engine that answers at once (the proxy and SDK alone). Last line
``proxy_overhead_p50: X ms``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAKE = "games/frozen-lake-v0"
LAKE_KWARGS = {"action_format": "raw", "size": 3}


class Instant:
    """An engine that answers every request with the same four tokens at once."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    async def generate(self, request: Any) -> Any:
        from trainer.strategies.base import GenerationResult

        ids = self.token_ids[: request.max_new_tokens]
        return GenerationResult(request.request_id, ids, [-1.0] * len(ids), "length")


def measure(engine: Any, policy: Any, calls: int) -> tuple[list[float], list[float]]:
    """Seconds per direct call and per proxy call (interleaved), ``calls`` of each."""
    import openai

    from trainer.rollout.env_manager import LocalEnvSource, Sampling
    from trainer.rollout.proxy import AgentProxy
    from trainer.rollout.scheduler import LoopThread
    from trainer.rollout.trajectory import ChatRenderer, Trajectory
    from trainer.strategies.base import GenerationRequest

    renderer = ChatRenderer(policy[1])
    thread = LoopThread()
    proxy = AgentProxy(engine, renderer, max_turns=10 * calls, max_context_tokens=1024)
    thread.run(proxy.start())
    session = thread.run(LocalEnvSource(LAKE_KWARGS).session(LAKE))
    messages, info = thread.run(session.reset(0))
    sampling = Sampling(max_new_tokens=4)
    episode = proxy.open("bench", Trajectory(LAKE, 0), session, sampling, messages, info)
    prompt = renderer.prompt(messages)
    client = openai.OpenAI(base_url=proxy.base_url, api_key=episode.api_key, max_retries=0)
    direct, proxied = [], []
    for i in range(calls + 10):
        start = time.perf_counter()
        thread.run(engine.generate(GenerationRequest(f"direct/{i}", prompt, 4)))
        middle = time.perf_counter()
        client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        end = time.perf_counter()
        if i >= 10:  # warm-up
            direct.append(middle - start)
            proxied.append(end - middle)
    episode.rows.clear()
    thread.run(proxy.aclose())
    thread.run(session.close())
    thread.close()
    return direct, proxied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()

    from transformers.utils import logging

    from trainer.models import build_policy, env_corpus, load_policy
    from trainer.strategies.hf_engine import HFEngine

    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        policy = load_policy(
            build_policy(
                Path(folder),
                env_corpus(LAKE, LAKE_KWARGS, episodes=60),
                tokenizer_kind="bpe",
                hidden_size=32,
                num_layers=2,
                num_heads=2,
                intermediate_size=64,
                seed=0,
            )
        )
    model, tokenizer = policy
    hf = HFEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=0
    )
    ms = 1000.0
    direct, proxied = measure(hf, policy, args.calls)
    _, alone = measure(Instant([5, 6, 7, 8]), policy, args.calls)
    p50 = {name: statistics.median(v) * ms for name, v in (("d", direct), ("p", proxied))}
    print(f"calls each way:            {args.calls}")
    print(f"direct engine call  p50:   {p50['d']:.2f} ms")
    print(f"through the proxy   p50:   {p50['p']:.2f} ms")
    print(f"proxy + SDK alone   p50:   {statistics.median(alone) * ms:.2f} ms (instant engine)")
    print(f"proxy_overhead_p50: {p50['p'] - p50['d']:.2f} ms")


if __name__ == "__main__":
    main()
