"""HFEngine: batched generation whose log-probs match a plain forward pass of the same model."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from trainer.strategies.base import GenerationRequest, InferenceEngine
from trainer.strategies.hf import token_logprobs
from trainer.strategies.hf_engine import HFEngine


def make_engine(policy, seed: int = 0) -> HFEngine:
    model, tokenizer = policy
    return HFEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=seed
    )


def prompts(tokenizer) -> list[list[int]]:
    texts = ["Your first move?", "You moved right.\n\nS F H\nF P F\nH F G\n\nYour next move?", "up"]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in texts
    ]


def test_engine_satisfies_the_protocol(policy) -> None:
    assert isinstance(make_engine(policy), InferenceEngine)


def test_left_padded_batch_logprobs_match_a_plain_forward(policy) -> None:
    model, tokenizer = policy
    engine = make_engine(policy)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts(tokenizer)]
    assert len({len(i) for i in ids}) == 3  # different lengths: the batch really is padded
    requests = [
        GenerationRequest(f"r{i}", p, max_new_tokens=5, temperature=1.0) for i, p in enumerate(ids)
    ]
    results = engine.generate_batch(requests)
    for prompt, result in zip(ids, results, strict=True):
        assert 1 <= len(result.token_ids) <= 5 and len(result.logprobs) == len(result.token_ids)
        full = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            expected, _ = token_logprobs(model(input_ids=full).logits, full)
        torch.testing.assert_close(
            torch.tensor(result.logprobs), expected[0, len(prompt) :], atol=1e-4, rtol=0
        )
        if result.finish_reason == "stop":
            assert result.token_ids[-1] == tokenizer.eos_token_id


def test_concurrent_requests_are_batched_and_sampling_is_reproducible(policy) -> None:
    _, tokenizer = policy
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts(tokenizer)]

    async def run(engine: HFEngine) -> list[list[int]]:
        results = await asyncio.gather(
            *(engine.generate(GenerationRequest(f"q{i}", p, 6)) for i, p in enumerate(ids))
        )
        await engine.close()
        return [r.token_ids for r in results]

    engine = make_engine(policy, seed=3)
    state = engine.get_state()
    first = asyncio.run(run(engine))
    # one forward batch for all three
    assert engine.stats["batches"] == 1 and engine.stats["requests"] == 3
    engine.set_state(state)
    # same RNG state -> same samples (what --resume relies on)
    assert asyncio.run(run(engine)) == first


def test_update_weights_changes_generation_and_bumps_version(policy) -> None:
    model, tokenizer = policy
    engine = make_engine(policy)
    prompt = tokenizer.encode(prompts(tokenizer)[0], add_special_tokens=False)
    greedy = GenerationRequest("g", prompt, 4, temperature=0.0)
    before = engine.generate_batch([greedy])[0]
    weights = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    weights["lm_head.weight"] = torch.zeros_like(model.lm_head.weight)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        engine.update_weights(weights)
        after = engine.generate_batch([greedy])[0]
        assert engine.version == 1 and after.policy_version == 1
        assert after.token_ids != before.token_ids or after.logprobs != before.logprobs
        with pytest.raises(KeyError, match="does not have"):
            engine.update_weights({"not.a.weight": torch.zeros(1)})
    finally:
        engine.update_weights(original)


def test_abort_of_a_queued_request_returns_abort(policy) -> None:
    _, tokenizer = policy
    prompt = tokenizer.encode(prompts(tokenizer)[0], add_special_tokens=False)

    async def run() -> str:
        engine = make_engine(policy)
        task = asyncio.ensure_future(engine.generate(GenerationRequest("x", prompt, 4)))
        await asyncio.sleep(0)
        await engine.abort("x")
        result = await task
        await engine.close()
        return result.finish_reason

    assert asyncio.run(run()) == "abort"


def test_prefill_keeps_only_the_last_positions_logits() -> None:
    """A generation batch's memory does not grow with prompt length x vocabulary: the prefill
    asks the model for the last position's logits only (64 Sokoban episodes of 5,000 tokens on
    Qwen2.5's 152k vocabulary would otherwise hold a 97 GiB logits tensor)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.trainer.memory_meter import peak_allocated_bytes

    vocab, rows, width = 8192, 8, 256
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    engine = HFEngine(AutoModelForCausalLM.from_config(config), eos_token_id=-1, pad_token_id=0)
    requests = [
        GenerationRequest(f"r{i}", list(range(1, width + 1)), max_new_tokens=1, temperature=0.0)
        for i in range(rows)
    ]
    full_logits = rows * width * vocab * 4
    peak = peak_allocated_bytes(lambda: engine.generate_batch(requests))
    assert peak < full_logits / 8, f"generation peaked at {peak:,} bytes"
