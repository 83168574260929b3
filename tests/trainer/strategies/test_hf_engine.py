"""HFEngine: batched generation whose log-probs match a plain forward pass of the same model."""

from __future__ import annotations

import asyncio
from typing import Any

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


def assert_plain_forward_logprobs(model, prompt_ids: list[list[int]], results: list[Any]) -> None:
    """Each result's log-probs are what one unpadded forward of prompt + tokens gives."""
    for prompt, result in zip(prompt_ids, results, strict=True):
        full = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            expected, _ = token_logprobs(model(input_ids=full).logits, full)
        torch.testing.assert_close(
            torch.tensor(result.logprobs), expected[0, len(prompt) :], atol=1e-4, rtol=0
        )


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
    assert_plain_forward_logprobs(model, ids, results)
    for result in results:
        assert 1 <= len(result.token_ids) <= 5 and len(result.logprobs) == len(result.token_ids)
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


def test_rows_that_end_early_leave_the_batch_and_the_rest_stay_exact(policy) -> None:
    """Rows end at different steps (their own ``max_new_tokens``; the longest prompt first, so
    its padding columns go too); every row's log-probs still match a plain forward."""
    model, tokenizer = policy
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts(tokenizer)]
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    budgets = [9 if i != longest else 1 for i in range(len(ids))]
    requests = [
        GenerationRequest(f"r{i}", p, max_new_tokens=b, temperature=1.0)
        for i, (p, b) in enumerate(zip(ids, budgets, strict=True))
    ]
    engine = make_engine(policy, seed=1)
    rows_computed: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: rows_computed.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    try:
        results = engine.generate_batch(requests)
    finally:
        hook.remove()
    assert len(results[longest].token_ids) == 1
    # after the prefill, each step computes only the rows still generating
    assert sum(rows_computed[1:]) == sum(len(r.token_ids) - 1 for r in results)
    assert_plain_forward_logprobs(model, ids, results)


def test_sampling_follows_the_distribution_and_top_p_keeps_to_the_nucleus(policy) -> None:
    """The inverse-CDF sampler draws tokens at their softmax(z / T) frequencies, and with
    ``top_p`` only from the smallest set of tokens whose mass reaches it."""
    engine = make_engine(policy, seed=0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20_000, 1)
    ones = torch.ones(len(logits))
    tokens, logprobs = engine._sample(logits, ones, ones)
    frequencies = torch.bincount(tokens, minlength=4) / len(tokens)
    torch.testing.assert_close(
        frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0
    )
    torch.testing.assert_close(logprobs, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tokens])
    nucleus, _ = engine._sample(logits, ones, torch.full((len(logits),), 0.7))
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 never drawn
    share = (nucleus == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.015
    greedy, _ = engine._sample(logits[:3], torch.zeros(3), ones[:3])
    assert greedy.tolist() == [0, 0, 0]


def test_a_request_joins_a_running_batch_and_does_not_wait_for_it(policy) -> None:
    """Continuous admission: a short request submitted while a long one is decoding is
    prefilled and joined between two steps, ends first, and both match a plain forward."""
    model, tokenizer = policy
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts(tokenizer)]
    long_prompt, short_prompt = ids[0], ids[1]  # the joining prompt is the longer one
    assert len(short_prompt) > len(long_prompt)
    engine = make_engine(policy, seed=2)
    eos = tokenizer.eos_token_id  # no stop token ends these rows early
    engine.eos_token_id = -1
    finished: list[str] = []
    forwards: list[int] = []
    joined: list[Any] = []

    def on_forward(_m, _a, kwargs) -> None:
        forwards.append(len(kwargs["input_ids"]))
        if len(forwards) == 5:  # the 4th decoding step of the long request
            joined.extend(engine.submit_many([GenerationRequest("short", short_prompt, 3)]))
            joined[0].add_done_callback(lambda _: finished.append("short"))

    hook = model.register_forward_pre_hook(on_forward, with_kwargs=True)
    try:
        long = engine.submit(GenerationRequest("long", long_prompt, 12))
        long.add_done_callback(lambda _: finished.append("long"))
        results = [long.result(timeout=60), joined[0].result(timeout=60)]
    finally:
        hook.remove()
        engine.shutdown()
        engine.eos_token_id = eos
    assert finished == ["short", "long"]
    assert [len(r.token_ids) for r in results] == [12, 3]
    assert engine.stats["batches"] == 2  # the short request had a prefill of its own...
    assert 2 in forwards[5:]  # ...then decoded alongside the long one
    assert_plain_forward_logprobs(model, [long_prompt, short_prompt], results)


def test_abort_and_shutdown_end_running_requests_from_a_thread(policy) -> None:
    """``abort_sync`` ends a running request at its next token and a waiting one with no
    tokens; ids the engine does not hold are not remembered; ``shutdown`` refuses new work."""
    model, tokenizer = policy
    prompt = tokenizer.encode(prompts(tokenizer)[0], add_special_tokens=False)
    engine = make_engine(policy)
    engine.eos_token_id = -1
    calls: list[int] = []
    waiting: list[Any] = []

    def on_forward(_m, _a, _k) -> None:
        calls.append(1)
        if len(calls) == 3:  # "a" is running; "w" waits for the next admission
            waiting.extend(engine.submit_many([GenerationRequest("w", prompt, 5)]))
            engine.abort_sync(["a", "w", "unknown"])

    hook = model.register_forward_pre_hook(on_forward, with_kwargs=True)
    try:
        aborted = engine.submit(GenerationRequest("a", prompt, 50)).result(timeout=60)
        queued = waiting[0].result(timeout=60)
    finally:
        hook.remove()
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 3
    assert queued.finish_reason == "abort" and queued.token_ids == []
    assert not engine._aborted and not engine._live  # nothing kept for ids that ended
    with pytest.raises(ValueError, match="no prompt tokens"):
        engine.submit(GenerationRequest("empty", [], 5))
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(GenerationRequest("late", prompt, 5))


def test_prompts_of_different_lengths_are_prefilled_in_groups_and_joined(policy) -> None:
    """No prompt is padded to more than twice its length (small groups aside); the groups'
    caches are joined into one decoding batch whose log-probs match a plain forward."""
    from trainer.strategies.decode_batch import length_groups

    lengths = [5, 200, 90, 110, 40, 6, 100]
    groups = length_groups(lengths, min_tokens=0)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(2 * lengths[i] >= lengths[g[0]] for g in groups for i in g)
    assert len(length_groups(lengths, min_tokens=10_000)) == 1  # too small to split
    model, tokenizer = policy
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts(tokenizer)]
    ids.append(ids[1] * 4)  # a prompt more than twice as long as the others
    engine = make_engine(policy, seed=4)
    engine.prefill_group_tokens = 0
    forwards: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: forwards.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    requests = [GenerationRequest(f"g{i}", p, 6, temperature=1.0) for i, p in enumerate(ids)]
    try:
        results = engine.generate_batch(requests)
    finally:
        hook.remove()
    assert len(length_groups([len(i) for i in ids], min_tokens=0)) > 1
    assert forwards[0] < len(ids)  # the first prefill held one group, not every prompt
    assert_plain_forward_logprobs(model, ids, results)


def test_larger_models_pad_fewer_prompt_tokens_rather_than_start_a_prefill() -> None:
    """Padding costs a model's per-token compute, another forward pass a fixed overhead: a
    0.1M-parameter model on CPU groups prompts up to ~2,000 padded tokens, a 30M one nearly never
    pads a short prompt to a long one, and a GPU, whose passes cost more, pads more."""
    import torch

    from trainer.strategies.decode_batch import prefill_split_tokens

    tiny, medium = torch.nn.Linear(350, 350), torch.nn.Linear(5000, 6000)  # ~0.12M, ~30M
    assert 1024 <= prefill_split_tokens(tiny, "cpu") <= 4096
    assert prefill_split_tokens(medium, "cpu") < 16
    assert prefill_split_tokens(medium, "cuda:0") > 100 * prefill_split_tokens(medium, "cpu")


def test_rows_leaving_the_batch_keep_the_caches_spare_room(policy) -> None:
    """A row that ends leaves the KV cache by a row selection of the cache's buffers, spare room
    included, so the next step still writes its keys and values in place rather than copying
    the whole cache into a new buffer; the remaining rows stay exact."""
    from trainer.strategies.decode_batch import DecodeBatch

    model, tokenizer = policy
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts(tokenizer)]
    requests = [
        GenerationRequest(f"r{i}", p, max_new_tokens=3 if i == 0 else 8, temperature=1.0)
        for i, p in enumerate(ids)
    ]
    engine = make_engine(policy, seed=2)
    after_drop: list[Any] = []  # each layer-0 buffer pair a drop left (held: ids not reused)
    next_step: list[Any] = []  # the buffer pair after the step that followed it
    drop, step = DecodeBatch.drop, engine._step

    def watched_drop(batch: DecodeBatch, ended: list[int]) -> Any:
        out = drop(batch, ended)
        if batch.rows:
            after_drop.append(batch.cache.layers[0]._room)
        return out

    def watched_step(batch: DecodeBatch) -> Any:
        pending = len(after_drop) > len(next_step)
        out = step(batch)
        if pending:
            next_step.append(batch.cache.layers[0]._room)
        return out

    engine._step = watched_step  # type: ignore[method-assign]
    DecodeBatch.drop = watched_drop  # type: ignore[method-assign]
    try:
        results = engine.generate_batch(requests)
    finally:
        DecodeBatch.drop = drop  # type: ignore[method-assign]
    assert [len(r.token_ids) for r in results] == [3, 8, 8]
    assert after_drop and next_step
    assert all(a is b for a, b in zip(next_step, after_drop, strict=False))
    assert_plain_forward_logprobs(model, ids, results)


def test_an_episodes_next_turn_prefills_only_its_new_tokens_and_stays_exact(policy) -> None:
    """Turns named ``episode/turn``: the next turn of an episode whose prompt extends the last
    one's prompt and reply reuses its KV cache, so only the new tokens are computed; with
    other rows in the same admission (a longer cached prefix, a first turn) every row's
    log-probs still match a plain forward."""
    model, tokenizer = policy
    first = [tokenizer.encode(p, add_special_tokens=False) for p in prompts(tokenizer)]
    engine = make_engine(policy, seed=3)
    turn1 = engine.generate_batch(
        [GenerationRequest(f"ep{i}/0", first[i], 4 + 3 * i, temperature=1.0) for i in (0, 1)]
    )
    observation = tokenizer.encode("You moved right. Your next move?", add_special_tokens=False)
    second = [first[i] + turn1[i].token_ids + observation for i in (0, 1)] + [first[2]]
    widths: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        turn2 = engine.generate_batch(
            [GenerationRequest(f"ep{i}/1", second[i], 5, temperature=1.0) for i in (0, 1, 2)]
        )
    finally:
        hook.remove()
    cached = [len(first[i]) + len(turn1[i].token_ids) - 1 for i in (0, 1)]
    assert engine.stats["prefix_hit_tokens"] == sum(cached)
    # the two continued turns were prefilled together over only their new tokens
    assert sorted(widths[:2]) == sorted([len(observation) + 1, len(first[2])])
    assert_plain_forward_logprobs(model, second, turn2)


def test_a_rewritten_history_or_a_weight_update_prefills_the_prompt_whole(policy) -> None:
    """A prompt that does not extend the cached turn (a template that rewrote history) and any
    turn after a weight update (the cached keys and values are the old weights') are
    prefilled whole, and stay exact."""
    model, tokenizer = policy
    prompt = tokenizer.encode(prompts(tokenizer)[1], add_special_tokens=False)
    engine = make_engine(policy, seed=4)
    (turn1,) = engine.generate_batch([GenerationRequest("ep/0", prompt, 4, temperature=1.0)])
    rewritten = [prompt[0], *prompt[2:], *turn1.token_ids, prompt[1]]
    (turn2,) = engine.generate_batch([GenerationRequest("ep/1", rewritten, 4, temperature=1.0)])
    assert engine.stats["prefix_hit_tokens"] == 0
    assert_plain_forward_logprobs(model, [rewritten], [turn2])

    extended = rewritten + turn2.token_ids + prompt[:3]
    engine.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()})
    (turn3,) = engine.generate_batch([GenerationRequest("ep/2", extended, 4, temperature=1.0)])
    assert engine.stats["prefix_hit_tokens"] == 0
    assert_plain_forward_logprobs(model, [extended], [turn3])
    assert len(engine.prefixes) == 1  # turn 3's, until the engine sleeps (training's memory)
    engine.sleep()
    assert not engine.prefixes and engine.prefixes.bytes == 0


def test_episodes_whose_turns_end_and_join_at_every_step_stay_exact(policy) -> None:
    """What a rollout asks: episodes that each send their next turn (its prompt grown by the
    reply and an observation) as soon as the last one returns, with budgets that end rows at
    many different steps, so rows leave the batch and join it (into the rows they left, from
    cached prefixes and whole prompts) all the time; every turn still matches a plain
    forward."""
    model, tokenizer = policy
    first = [tokenizer.encode(p, add_special_tokens=False) for p in prompts(tokenizer)]
    observation = tokenizer.encode("You moved up.", add_special_tokens=False)
    engine = make_engine(policy, seed=5)
    engine.eos_token_id = -1  # budgets alone end the turns
    seen: list[tuple[list[int], Any]] = []

    async def episode(i: int) -> None:
        prompt = list(first[i % len(first)])
        for turn in range(3):
            budget = 1 + (5 * i + 3 * turn) % 7
            request = GenerationRequest(f"ep{i}/{turn}", prompt, budget, temperature=1.0)
            result = await engine.generate(request)
            assert len(result.token_ids) == budget
            seen.append((prompt, result))
            prompt = prompt + result.token_ids + observation

    async def main() -> None:
        await asyncio.gather(*(episode(i) for i in range(6)))
        await engine.close()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(seen) == 18 and engine.stats["prefix_hit_tokens"] > 0
    assert_plain_forward_logprobs(model, [p for p, _ in seen], [r for _, r in seen])


def test_the_registry_engine_takes_its_prefix_cache_size_and_refuses_other_options(
    policy_dir,
) -> None:
    """``strategy_args.prefix_cache_gib`` sizes (0: turns off) the ended turns' KV caches;
    anything else, or a negative size, is a clear error that names the option."""
    assert HFEngine.from_pretrained(str(policy_dir)).prefixes is not None
    assert HFEngine.from_pretrained(str(policy_dir), prefix_cache_gib=0).prefixes is None
    with pytest.raises(ValueError, match=r"\['max_num_seqs'\].*its one option is prefix_cache_gib"):
        HFEngine.from_pretrained(str(policy_dir), max_num_seqs=8)
    with pytest.raises(ValueError, match="prefix_cache_gib must be a number >= 0"):
        HFEngine.from_pretrained(str(policy_dir), prefix_cache_gib=-1)


def test_a_tensor_of_another_shape_is_refused_naming_it_and_both_shapes(policy) -> None:
    """``copy_`` would broadcast a (1, cols) row into every row of the weight and serve that."""
    from trainer.weights.errors import StaleWeightsError
    from trainer.weights.versioned import VersionedEngine

    model, _ = policy
    name, weight = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    before = weight.detach().clone()
    engine = VersionedEngine(make_engine(policy))
    engine.begin(1)
    engine.load_part([(name, torch.randn(1, weight.shape[1]))])
    with pytest.raises(StaleWeightsError, match=name) as caught:
        engine.finish(1, [name])
    assert f"(1, {weight.shape[1]})" in str(caught.value)
    assert str(tuple(weight.shape)) in str(caught.value)
    assert torch.equal(weight.detach(), before) and engine.weights_version is None
