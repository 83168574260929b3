"""HFTrainStrategy: padding-independent log-probs, learning, and refusing NaN updates."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from trainer.errors import NonFiniteLossError
from trainer.strategies.hf import HFTrainStrategy
from trainer.workers.actor import sft_loss_fn


def batch_of(rows: list[list[int]], width: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "response_mask": mask.float()}


def test_forward_ignores_right_padding_and_micro_batching(policy) -> None:
    model, _ = policy
    rows = [[5, 6, 7, 8, 9], [5, 6, 7]]
    strategy = HFTrainStrategy(copy.deepcopy(model), micro_batch_size=1, trainable=False)
    padded = strategy.forward(batch_of(rows, 12), with_entropy=True)
    alone = HFTrainStrategy(copy.deepcopy(model), micro_batch_size=8, trainable=False).forward(
        batch_of(rows[1:], 3)
    )
    assert padded.logprobs.shape == (2, 12) and padded.entropy is not None
    torch.testing.assert_close(padded.logprobs[1, :3], alone.logprobs[0], atol=1e-5, rtol=0)
    assert padded.logprobs[0, 0].item() == 0.0  # no context for the first token


def test_sft_steps_lower_the_loss(policy) -> None:
    model, tokenizer = policy
    strategy = HFTrainStrategy(copy.deepcopy(model), lr=3e-3, micro_batch_size=4)
    ids = tokenizer.encode("<|im_start|>assistant\nup<|im_end|>", add_special_tokens=False)
    batch = batch_of([ids] * 4, len(ids))
    first = strategy.train_step(batch, sft_loss_fn)["sft/nll"]
    for _ in range(15):
        last = strategy.train_step(batch, sft_loss_fn)["sft/nll"]
    assert last < 0.7 * first


def test_nan_loss_raises_and_leaves_weights_untouched(policy) -> None:
    model, _ = policy
    strategy = HFTrainStrategy(copy.deepcopy(model), lr=1e-3)
    before = {k: v.clone() for k, v in strategy.model.state_dict().items()}

    def nan_loss(out, mb):
        return out.logprobs.sum() * float("nan"), {}

    with pytest.raises(NonFiniteLossError, match="the update was not applied"):
        strategy.train_step(batch_of([[5, 6, 7]], 3), nan_loss)
    after = strategy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
