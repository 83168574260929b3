"""``algorithm.loss.agg_mode`` is a property of the whole step, not of a micro-batch.

A ragged batch (rows of very different response lengths) must give the same gradient, to
1e-6, however the strategy cuts it: one full batch, micro-batches of 1 or 2 rows, or two
FSDP2 ranks with uneven shares. Before the fix each micro-batch's own mean was averaged,
so a 2-token row weighed as much as a 12-token one under ``token-mean``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.strategies import dist_workers as W
from tests.trainer.strategies import grad_workers as G
from tests.trainer.strategies.ranks import run_ranks
from trainer.config import LossConfig
from trainer.strategies.hf import HFTrainStrategy
from trainer.workers.actor import ppo_loss_fn

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LENGTHS = [12, 3, 8, 5, 2]
"""Real tokens per row (right padding to 12); the first token of each row is the prompt."""


def ragged_batch() -> dict[str, torch.Tensor]:
    """Five right-padded rows with PPO columns; old log-probs from the model itself (ratio 1)."""
    g = torch.Generator().manual_seed(3)
    rows, width = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(1, 61, (rows, width), generator=g)
    attention = torch.zeros(rows, width, dtype=torch.long)
    for i, length in enumerate(LENGTHS):
        attention[i, :length] = 1
    ids = ids * attention
    response = attention.clone().float()
    response[:, 0] = 0
    batch = {"input_ids": ids, "attention_mask": attention, "response_mask": response}
    logprobs = HFTrainStrategy(W.tiny_qwen2(), trainable=False).forward(batch).logprobs
    batch["old_logprobs"] = logprobs + 0.05 * torch.randn(rows, width, generator=g) * response
    batch["ref_logprobs"] = logprobs + 0.3 * torch.randn(rows, width, generator=g) * response
    batch["advantages"] = torch.randn(rows, width, generator=g) * response
    return batch


def hf_grads(
    batch: dict[str, torch.Tensor], mode: str, micro_batch_size: int
) -> dict[str, torch.Tensor]:
    strategy = HFTrainStrategy(
        W.tiny_qwen2(), lr=0.0, max_grad_norm=None, micro_batch_size=micro_batch_size
    )
    strategy.train_step(batch, ppo_loss_fn(LossConfig(**G.LOSS, agg_mode=mode)), with_entropy=True)
    return G.gradients(strategy.model)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, expected in want.items():
        torch.testing.assert_close(
            got[name], expected, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return ragged_batch()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_hf_micro_batches_give_the_full_batch_gradient(
    batch, mode: str, micro_batch_size: int
) -> None:
    assert_same(hf_grads(batch, mode, micro_batch_size), hf_grads(batch, mode, len(LENGTHS)))


@pytest.mark.parametrize("mode", MODES)
def test_the_logged_losses_do_not_depend_on_how_the_batch_is_cut(batch, mode: str) -> None:
    """``actor/pg_loss`` and the other metrics describe the step, weighed like its loss: a
    2-token micro-batch does not count as much as a 12-token one. ``clipfrac`` and
    ``approx_kl_old`` are shares and means of the step's response tokens under every mode."""
    shifted = dict(batch)  # rows 0 and 2 (12 and 8 tokens) far from their old policy: clipped
    shifted["old_logprobs"] = batch["old_logprobs"] - 0.5 * batch["response_mask"] * torch.tensor(
        [[1.0], [0.0], [1.0], [0.0], [0.0]]
    )

    def metrics(micro_batch_size: int) -> dict[str, float]:
        strategy = HFTrainStrategy(
            W.tiny_qwen2(), lr=0.0, max_grad_norm=None, micro_batch_size=micro_batch_size
        )
        loss = ppo_loss_fn(LossConfig(**G.LOSS, agg_mode=mode))
        return strategy.train_step(shifted, loss, with_entropy=True)

    whole = metrics(len(LENGTHS))
    assert whole["actor/clipfrac"] > 0.1
    for size in (1, 2):
        cut = metrics(size)
        keys = ["actor/pg_loss", "actor/kl_ref", "actor/entropy"]
        for key in keys + ["actor/clipfrac", "actor/approx_kl_old"]:
            assert cut[key] == pytest.approx(whole[key], abs=1e-5), (size, key)


def two_ranks(fn, batch: dict[str, torch.Tensor]) -> dict:
    """Run ``fn`` on 2 gloo ranks, rank 0 given rows 0-2 and rank 1 rows 3-4 (a ragged split)."""
    return run_ranks(fn, 2, batch, [3, 2], MODES)


def test_fsdp2_two_ragged_ranks_give_the_full_batch_gradient(batch) -> None:
    out = two_ranks(G.fsdp2_grads_rank, batch)
    for mode in MODES:
        want = hf_grads(batch, mode, len(LENGTHS))
        assert_same(out[(mode, 0)], want)
        assert_same(out[(mode, 1)], want)


def test_megatron_tp2_and_dp2_give_the_full_batch_gradient(batch) -> None:
    pytest.importorskip("megatron.core")
    out = two_ranks(G.megatron_grads_rank, batch)
    for mode in MODES:
        want = hf_grads(batch, mode, len(LENGTHS))
        for tp in (2, 1) if mode == MODES[0] else (2,):
            for rank in (0, 1):
                got = out[(tp, mode, rank)]
                assert_same({k: got[k] for k in want}, want)
