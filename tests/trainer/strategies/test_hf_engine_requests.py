"""HFEngine under requests it cannot serve, the model's context, aborts and races: a bad
request fails alone, naming the fix; every other request comes back whole and exact."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from trainer.strategies.base import GenerationRequest
from trainer.strategies.hf_engine import HFEngine


def make_engine(model: Any, tokenizer: Any, **options: Any) -> HFEngine:
    return HFEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **options
    )


def lake_prompt(tokenizer: Any) -> list[int]:
    return tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Your first move?"}],
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    )


def greedy_reference(model: Any, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens, one unpadded forward of the whole sequence per token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_a_bad_request_fails_alone_and_names_the_fix(policy) -> None:
    """Requests gathered into one batch with bad ones: each bad one fails with what to change
    (the engine never runs it: on a GPU an id outside the vocabulary is a device assert),
    the good ones are generated as if alone."""
    model, tokenizer = policy
    prompt = lake_prompt(tokenizer)
    vocab = model.get_input_embeddings().num_embeddings
    context = model.config.max_position_embeddings
    bad = {
        "empty": (GenerationRequest("empty", [], 4), "no prompt tokens"),
        "vocab": (GenerationRequest("vocab", [*prompt, vocab], 4), "outside the model's vocab"),
        "none": (GenerationRequest("none", prompt, 0), "max_new_tokens must be >= 1"),
        "top_p": (GenerationRequest("top_p", prompt, 4, top_p=0.0), r"top_p must be in \(0, 1\]"),
        "temp": (GenerationRequest("temp", prompt, 4, temperature=-1), "temperature must be"),
        "long": (GenerationRequest("long", [prompt[0]] * context, 4), "shorten the prompt"),
    }
    good = [GenerationRequest(f"good{i}", prompt, 6, temperature=0.0) for i in range(2)]

    async def run() -> list[Any]:
        engine = make_engine(model, tokenizer)
        requests = [good[0], *(r for r, _ in bad.values()), good[1]]
        results = await asyncio.gather(*map(engine.generate, requests), return_exceptions=True)
        await engine.close()
        engine.shutdown()
        return results

    first, *refused, last = asyncio.run(run())
    for (_, match), error in zip(bad.values(), refused, strict=True):
        assert isinstance(error, ValueError)
        assert error.args and re.search(match, error.args[0]), error
    expected = greedy_reference(model, prompt, 6)
    for result in (first, last):
        stop = (
            expected.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in expected else 6
        )
        assert result.token_ids == expected[:stop]


def test_a_row_ends_at_the_models_context_and_the_rows_beside_it_go_on(policy) -> None:
    """A row reaching the model's positions ends there with ``length`` (as vLLM's
    ``max_model_len`` ends it), instead of failing, or going on past what the model was built
    for, with every row of its batch."""
    model, tokenizer = policy
    prompt = lake_prompt(tokenizer)
    context = model.config.max_position_embeddings
    near = (prompt * (context // len(prompt) + 1))[: context - 3]
    engine = make_engine(model, tokenizer)
    engine.eos_token_id = -1  # no row ends early
    long, short = engine.generate_batch(
        [GenerationRequest("near", near, 10), GenerationRequest("short", prompt, 10)]
    )
    assert (len(long.token_ids), long.finish_reason) == (3, "length")
    assert (len(short.token_ids), short.finish_reason) == (10, "length")


def test_rows_ending_at_their_prefill_are_not_prefilled_again(policy) -> None:
    """The first length group's rows all end at their prefill (one token each): the next
    group's prompts are prefilled on their own, the first group's are never prefilled twice
    (each would get a second "first" token)."""
    model, tokenizer = policy
    prompt = lake_prompt(tokenizer)
    engine = make_engine(model, tokenizer)
    engine.prefill_group_tokens = 0  # groups of similar lengths only
    forwards: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: forwards.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        one, _ = engine.generate_batch(
            [
                GenerationRequest("one", prompt * 4, 1, temperature=0.0),
                GenerationRequest("more", prompt[:3], 3, temperature=0.0),
            ]
        )
    finally:
        hook.remove()
    assert one.token_ids == greedy_reference(model, prompt * 4, 1)
    assert forwards.count(len(prompt) * 4) == 1


def test_a_cache_that_cannot_be_joined_is_prefilled_in_one_group_and_stays_exact() -> None:
    """A model with sliding-window attention (its cache layers cannot be joined): prompts of
    different lengths are prefilled together, each row's greedy tokens those of a plain
    forward, none repeated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mistral",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=256,
        sliding_window=100,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    engine = HFEngine(model, eos_token_id=-1, pad_token_id=0)
    engine.prefill_group_tokens = 0
    prompts = [list(range(1, 41)), [5, 6, 7]]
    results = engine.generate_batch(
        [GenerationRequest(f"p{i}", p, 3, temperature=0.0) for i, p in enumerate(prompts)]
    )
    assert [r.token_ids for r in results] == [greedy_reference(model, p, 3) for p in prompts]


def test_aborts_of_ids_the_engine_does_not_hold_leave_nothing_for_a_later_request(
    policy,
) -> None:
    """Aborting an unknown id, or one still in the front's queue, is forgotten once answered:
    a later request that reuses the id is generated, not ended at once."""
    model, tokenizer = policy
    prompt = lake_prompt(tokenizer)

    async def run() -> tuple[str, str, str]:
        engine = make_engine(model, tokenizer)
        await engine.abort("never-sent")
        queued = asyncio.ensure_future(engine.generate(GenerationRequest("again", prompt, 4)))
        await asyncio.sleep(0)  # (one loop turn: the request reaches the front's queue)
        await engine.abort("again")  # still in the front's queue: answered there
        first = (await queued).finish_reason
        later = await engine.generate(GenerationRequest("again", prompt, 4))
        unknown = await engine.generate(GenerationRequest("never-sent", prompt, 4))
        await engine.close()
        engine.shutdown()
        return first, later.finish_reason, unknown.finish_reason

    first, later, unknown = asyncio.run(run())
    assert first == "abort" and later != "abort" and unknown != "abort"


def test_an_aborted_request_waiting_behind_a_full_batch_is_answered_at_once(policy) -> None:
    """``max_batch_size`` rows run; a request waiting for room that is aborted is answered at
    the next step, not once a running row ends."""
    model, tokenizer = policy
    prompt = lake_prompt(tokenizer)
    engine = make_engine(model, tokenizer, max_batch_size=1)
    engine.eos_token_id = -1
    answered: list[str] = []
    waiting: list[Any] = []

    def on_forward(_m: Any, _a: Any, _k: Any) -> None:
        if not waiting:  # the running row's prefill: "w" waits for room, then is aborted
            waiting.extend(engine.submit_many([GenerationRequest("w", prompt, 5)]))
            waiting[0].add_done_callback(lambda _: answered.append("w"))
            engine.abort_sync(["w"])

    hook = model.register_forward_pre_hook(on_forward, with_kwargs=True)
    try:
        running = engine.submit(GenerationRequest("r", prompt, 100))
        running.add_done_callback(lambda _: answered.append("r"))
        assert running.result(timeout=120).finish_reason == "length"
        assert waiting[0].result(timeout=120).finish_reason == "abort"
    finally:
        hook.remove()
        engine.shutdown()
    assert answered == ["w", "r"]


def test_a_submitted_request_is_aborted_not_cancelled_and_its_answer_always_comes(policy) -> None:
    """The future ``submit`` returns is already running: ``cancel()`` declines (use
    ``abort_sync``), so the decoding thread never finds it cancelled as it answers."""
    model, tokenizer = policy
    engine = make_engine(model, tokenizer)
    future = engine.submit(GenerationRequest("x", lake_prompt(tokenizer), 8))
    assert not future.cancel()
    assert future.result(timeout=120).token_ids
    engine.shutdown()


def test_the_version_advances_while_no_generation_can_run(policy) -> None:
    """A weight update (or adapter load) bumps the version before any forward can use the new
    weights, so no row reports the old version for tokens of the new ones."""
    model, tokenizer = policy
    engine = make_engine(model, tokenizer)
    held: list[bool] = []

    class Watched:
        def __init__(self, policy: Any) -> None:
            self.policy = policy

        def __getattr__(self, name: str) -> Any:
            return getattr(self.policy, name)

        def advance(self) -> Any:
            held.append(engine._compute.locked())
            return self.policy.advance()

    engine.policy = Watched(engine.policy)  # type: ignore[assignment]
    engine.update_weights({name: p.detach().clone() for name, p in model.named_parameters()})
    assert held == [True] and engine.version == 1
