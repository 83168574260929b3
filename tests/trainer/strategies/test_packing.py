"""Sequence packing and token-budget micro-batches change the cost of a step, never its numbers.

Log-probs, entropies, critic values and the trained weights of a heavy-tailed batch are the
unpacked computation's within 1e-5, whether rows are packed, grouped by tokens, or both; a
sequence's log-probs do not move when another sequence in its packed row changes (attention never
crosses sequences); rows come back in the caller's order.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.strategies import dist_workers as W
from trainer.strategies.hf import HFTrainStrategy
from trainer.strategies.packing import pack_bins, plan_micro_batches

LENGTHS = [3, 40, 5, 7, 2, 18, 4, 33, 6, 3, 9, 25]
"""A heavy-tailed mix (10x spread): a few long episodes among many short ones."""


def ragged_batch(lengths: list[int] = LENGTHS, vocab: int = 61, seed: int = 3) -> dict[str, Any]:
    """Right-padded rows of ``lengths`` real tokens, half of each one's tail a "response"."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    response = torch.zeros(len(lengths), width)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        response[row, n // 2 : n] = 1
        ids[row, n:] = 0
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response}


def strategy(model: Any, **options: Any) -> HFTrainStrategy:
    return HFTrainStrategy(copy.deepcopy(model), lr=1e-2, micro_batch_size=4, **options)


SETTINGS = [
    {"packing": True},
    {"micro_batch_tokens": 64},
    {"micro_batch_tokens": 64, "packing": True},
    {"micro_batch_tokens": 10},  # smaller than the longest row: that row is its own micro-batch
]


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: ",".join(f"{k}={o[k]}" for k in o))
def test_forward_and_training_match_the_padded_computation(options: dict[str, Any]) -> None:
    model, batch = W.tiny_qwen2(), ragged_batch()
    mask = batch["attention_mask"].bool()
    padded, other = strategy(model), strategy(model, **options)
    expected = padded.forward(batch, with_entropy=True)
    got = other.forward(batch, with_entropy=True)
    torch.testing.assert_close(got.logprobs[mask], expected.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.entropy[mask], expected.entropy[mask], atol=1e-5, rtol=0)
    for _ in range(2):
        padded_metrics = padded.train_step(batch, W.nll_loss)
        other_metrics = other.train_step(batch, W.nll_loss)
    assert other_metrics["grad_norm"] == pytest.approx(padded_metrics["grad_norm"], rel=1e-4)
    for (name, a), (_, b) in zip(
        padded.model.named_parameters(), other.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)


def test_critic_values_unpack_to_the_padded_values(policy_dir: Any) -> None:
    from trainer.workers.critic import build_value_model

    model = build_value_model(str(policy_dir))
    torch.nn.init.normal_(model.value_head.weight)  # a head that says something per token
    batch = ragged_batch(vocab=int(model.lm.config.vocab_size))
    mask = batch["attention_mask"].bool()
    padded = HFTrainStrategy(copy.deepcopy(model), micro_batch_size=4, kind="value")
    packed = HFTrainStrategy(copy.deepcopy(model), micro_batch_size=4, kind="value", packing=True)
    expected, got = padded.forward(batch).values, packed.forward(batch).values
    assert expected[mask].abs().max() > 0
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("packing", [False, True])
def test_a_tokens_value_is_the_value_of_the_state_before_it(policy_dir: Any, packing) -> None:
    """GAE's baseline for action token t is V(state before t): read where the model has not
    seen token t (as its log-prob is). Read at t itself, the critic learns Q(s, a): every
    single-token decision then gets advantage 0 from a trained critic."""
    from trainer.workers.critic import build_value_model

    model = build_value_model(str(policy_dir))
    torch.nn.init.normal_(model.value_head.weight)
    critic = HFTrainStrategy(model, micro_batch_size=4, kind="value", packing=packing)
    prompt, good, bad = [7, 3, 9], 11, 13
    ids = torch.tensor([[*prompt, good], [*prompt, bad]])
    values = critic.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)}).values
    assert values[0, 3] == values[1, 3]  # same state before the action: same value
    assert values[0, 3] != values[0, 2] and values[0, 0] == 0  # (nothing is before token 0)


def test_flash_attention_gets_the_packed_rows_as_one_row_it_reads_as_packed() -> None:
    """transformers runs FlashAttention's varlen kernel from restarting position ids only for a
    batch of ONE row (``_is_packed_sequence``); given several packed rows it runs plain causal
    attention over each, across its sequences. (No flash kernel runs on a CPU: this checks what
    the model is given, with transformers' own test of it.)"""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    from trainer.strategies.packing import packed_model_inputs

    batch = ragged_batch([6, 2, 3, 5], seed=5)
    packed = strategy(W.tiny_qwen2(), packing=True, micro_batch_tokens=64)
    (micro,) = packed._micro_batches(batch)
    assert micro["_packed_ids"].shape[0] > 1
    packed.model.config._attn_implementation = "flash_attention_2"
    inputs = packed_model_inputs(packed.model, micro)
    assert "attention_mask" not in inputs and inputs["input_ids"].shape[0] == 1
    assert inputs["input_ids"].tolist()[0] == micro["_packed_ids"].reshape(-1).tolist()
    assert _is_packed_sequence(inputs["position_ids"], inputs["input_ids"].shape[0])


def test_attention_never_crosses_sequences_in_a_packed_row() -> None:
    batch = ragged_batch([6, 2, 3], seed=5)
    packed = strategy(W.tiny_qwen2(), packing=True, micro_batch_tokens=64)
    (micro,) = packed._micro_batches(batch)
    # first fit decreasing: [row 0] and [row 2, row 1] - row 1 sits after row 2 in one packed row
    assert micro["_packed_ids"].shape == (2, 6)
    assert micro["_packed_ids"][1, :5].tolist() == [
        *batch["input_ids"][2, :3].tolist(),
        *batch["input_ids"][1, :2].tolist(),
    ]
    before = packed.forward(batch).logprobs
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][2, :3] = torch.tensor([10, 11, 12])  # rewrite the earlier sequence only
    after = packed.forward(changed).logprobs
    torch.testing.assert_close(after[:2], before[:2], atol=0, rtol=0)  # row 1 saw nothing of it
    assert not torch.equal(after[2], before[2])


def test_plans_hold_every_row_once_within_their_budget() -> None:
    for budget in (8, 40, 64, 500):
        for packing in (False, True):
            plans = plan_micro_batches(
                LENGTHS, rows_per_micro=4, tokens_per_micro=budget, packing=packing
            )
            rows = sorted(r for p in plans for r in p.rows)
            assert rows == list(range(len(LENGTHS)))
            for plan in plans:
                width = max(LENGTHS[r] for r in plan.rows)
                cost = (len(plan.bins) if packing else len(plan.rows)) * width
                assert cost <= max(budget, width)  # a row over budget stands alone
    bins = pack_bins(LENGTHS, 40)
    assert sorted(i for b in bins for i in b) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in b) <= 40 for b in bins)
    assert len(bins) == -(-sum(LENGTHS) // 40)  # first fit decreasing fills them here


def sliding_model(kind: str, attn: str) -> Any:
    """A tiny model whose attention sees only the last 4 positions: Mistral (every layer), Qwen2
    with every layer sliding, or with full and sliding layers mixed (``layer_types``)."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    shape = {
        "vocab_size": 61,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "sliding_window": 4,
    }
    if kind == "mistral":
        config = MistralConfig(**shape)
    else:  # layers from max_window_layers on slide
        config = Qwen2Config(
            **shape, use_sliding_window=True, max_window_layers=0 if kind == "qwen2" else 1
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen2-mixed"])
def test_packed_rows_keep_the_models_sliding_window(kind: str, attn: str) -> None:
    """A sliding-window model's packed log-probs are its padded ones: each token attends to the
    window's last positions of its own sequence, as in its own row."""
    model = sliding_model(kind, attn)
    if kind == "qwen2-mixed":
        assert set(model.config.layer_types) == {"full_attention", "sliding_attention"}
    batch = ragged_batch([12, 3, 7, 5, 9, 2], seed=1)
    mask = batch["attention_mask"].bool()
    expected = strategy(model).forward(batch).logprobs
    got = strategy(model, packing=True).forward(batch).logprobs
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["flex_attention", "kernels-community/flash-attn"])
def test_packing_refuses_an_attention_implementation_it_does_not_know(attn: str) -> None:
    from trainer.errors import ModelError
    from trainer.strategies.packing import packed_model_inputs

    packed = strategy(W.tiny_qwen2(), packing=True)
    (micro, *_) = packed._micro_batches(ragged_batch([6, 2, 3, 5], seed=5))
    packed.model.config._attn_implementation = attn
    with pytest.raises(ModelError, match=f"train.packing.*{attn}.*eager, sdpa"):
        packed_model_inputs(packed.model, micro)


def test_packing_refuses_layers_whose_mask_it_cannot_build() -> None:
    from trainer.errors import ModelError
    from trainer.strategies.packing import packed_model_inputs

    packed = strategy(W.tiny_qwen2(), packing=True)
    (micro, *_) = packed._micro_batches(ragged_batch([6, 2, 3, 5], seed=5))
    packed.model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ModelError, match="train.packing.*chunked_attention"):
        packed_model_inputs(packed.model, micro)


@pytest.mark.parametrize("kind", ["bloom", "falcon-alibi"])
def test_packing_refuses_alibi_position_biases(kind: str) -> None:
    """ALiBi biases attention by key position (Bloom, Falcon with ``alibi``): packed rows would
    need them per sequence, which the models cannot take; refused naming the setting, while the
    padded rows still run."""
    import transformers

    from trainer.errors import ModelError

    if kind == "bloom":
        config: Any = transformers.BloomConfig(vocab_size=61, hidden_size=32, n_layer=2, n_head=4)
    else:
        config = transformers.FalconConfig(
            vocab_size=61,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            alibi=True,
            new_decoder_architecture=False,
        )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    batch = ragged_batch([4, 2, 3], seed=5)
    assert strategy(model).forward(batch).logprobs.shape == (3, 4)
    with pytest.raises(ModelError, match="train.packing.*ALiBi.*set train.packing: false"):
        strategy(model, packing=True).forward(batch)


def test_row_micro_batches_take_rows_of_like_length_within_each_optimizer_step() -> None:
    """``micro_batch_size`` rows per micro-batch, each trimmed to its longest row: rows are
    grouped by length (longest first) within the rows of one optimiser step, so a short row
    is not padded to a long one's width, while each step still trains the rows it would in
    batch order (its gradient is unchanged) and forward returns rows in the caller's order."""
    batch = ragged_batch()
    padded_tokens = {}
    for accumulation in (None, 1, 2):
        cut = strategy(W.tiny_qwen2(), grad_accumulation=accumulation)
        micros = cut._micro_batches(batch)
        padded_tokens[accumulation] = sum(m["input_ids"].numel() for m in micros)
        per_step = accumulation or len(micros)
        for k, first in enumerate(range(0, len(micros), per_step)):
            rows = sorted(int(r) for m in micros[first : first + per_step] for r in m["_rows"])
            assert rows == list(range(4 * per_step * k, min(4 * per_step * (k + 1), 12)))
    # whole batch one step: widths 40, 9, 4 (in batch order 40, 33, 25); a step per micro-batch:
    # batch order; two micro-batches a step: sorted within rows 0-7 and within rows 8-11
    assert padded_tokens == {None: 4 * (40 + 9 + 4), 1: 4 * (40 + 33 + 25), 2: 4 * (40 + 5 + 25)}
    cut = strategy(W.tiny_qwen2())
    alone = HFTrainStrategy(copy.deepcopy(cut.model), micro_batch_size=1)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(
        cut.forward(batch).logprobs[mask], alone.forward(batch).logprobs[mask], atol=1e-5, rtol=0
    )
