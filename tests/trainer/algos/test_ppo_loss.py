"""``ppo_loss_fn`` as a whole and the KL penalty in the rewards, against numbers worked by hand.

A 2x3 batch, the last column padding. Per response token (ratio = exp(logp - old), clip 0.2/0.28,
d = logp - ref, so k1 = d and k2 = d^2 / 2):

======  =====  ====  ======  ==============================  =========  ====  =====  =======
token   ratio  A     IS w    PPO term                        clipped?   d     k2     entropy
======  =====  ====  ======  ==============================  =========  ====  =====  =======
(0,0)   1.0    1.0   1.0     -1.0                            no         0.5   0.125  1
(0,1)   1.5    1.0   1.0     -1.28  (= -A * 1.28)            yes        0.2   0.02   2
(1,0)   0.5    -2.0  1.0     1.6    (= -A * 0.8)             yes        -0.1  0.005  3
(1,1)   1.0    0.5   0.5     -0.25  (= -A * 1 * w)           no         0.3   0.045  4
======  =====  ====  ======  ==============================  =========  ====  =====  =======

token-mean: pg = -0.93 / 4 = -0.2325; KL (k2) = 0.195 / 4 = 0.04875; entropy = 10 / 4 = 2.5;
with kl_coef 0.1 and entropy_coef 0.01: total = -0.2325 + 0.004875 - 0.025 = -0.252625.
d total / d logp: -A * ratio * w / 4 where unclipped, 0 where clipped, plus kl_coef * d / 4 (k2):
[[-0.25 + 0.0125, 0 + 0.005, 0], [0 - 0.0025, -0.0625 + 0.0075, 0]].
(As a penalty, k1: KL = 0.9 / 4 = 0.225.)
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from trainer.algos.advantages import kl_penalised_rewards
from trainer.config import LossConfig
from trainer.strategies.base import ForwardOutput
from trainer.workers.actor import ppo_loss_fn

LOSS = {
    "clip_low": 0.2,
    "clip_high": 0.28,
    "kl_coef": 0.1,
    "kl_estimator": "k2",
    "kl_mode": "loss",
    "entropy_coef": 0.01,
    "agg_mode": "token-mean",
}


def hand_batch() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    logprobs = torch.tensor(
        [[-1.0, -1.0 + math.log(1.5), -2.0], [-1.0, -1.0, -2.0]],
        dtype=torch.float64,
        requires_grad=True,
    )
    log_ratio = torch.tensor(
        [[0.0, math.log(1.5), 0.3], [math.log(0.5), 0.0, 0.0]], dtype=torch.float64
    )
    kl = torch.tensor([[0.5, 0.2, 0.0], [-0.1, 0.3, 0.0]], dtype=torch.float64)
    micro = {
        "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64),
        "old_logprobs": logprobs.detach() - log_ratio,
        "ref_logprobs": logprobs.detach() - kl,
        "advantages": torch.tensor([[1.0, 1.0, 5.0], [-2.0, 0.5, 0.0]], dtype=torch.float64),
        "is_weights": torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.5, 0.0]], dtype=torch.float64),
    }
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0]], dtype=torch.float64)
    return logprobs, micro, entropy


def test_ppo_loss_fn_adds_policy_kl_and_entropy_terms_as_worked_by_hand() -> None:
    logprobs, micro, entropy = hand_batch()
    total, metrics = ppo_loss_fn(LossConfig(**LOSS))(
        ForwardOutput(logprobs=logprobs, entropy=entropy), micro
    )
    assert total.item() == pytest.approx(-0.252625, abs=1e-12)
    assert metrics["actor/pg_loss"] == pytest.approx(-0.2325, abs=1e-12)
    assert metrics["actor/kl_ref"] == pytest.approx(0.04875, abs=1e-12)
    assert metrics["actor/entropy"] == pytest.approx(2.5, abs=1e-12)
    assert metrics["actor/clipfrac"] == pytest.approx(0.5, abs=1e-12)  # (0,1) and (1,0)


def test_clipped_and_padding_tokens_get_only_the_kl_gradient() -> None:
    logprobs, micro, entropy = hand_batch()
    total, _ = ppo_loss_fn(LossConfig(**LOSS))(
        ForwardOutput(logprobs=logprobs, entropy=entropy), micro
    )
    total.backward()
    want = torch.tensor([[-0.2375, 0.005, 0.0], [-0.0025, -0.055, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("gspo", [False, True])
def test_padding_far_from_the_old_and_reference_log_probs_changes_nothing(gspo) -> None:
    """Log-probs at masked positions are whatever the forward left there (a pad token's real
    log-prob, or 0 in a packed row): 1000 nats from the old or reference ones, exp() of the
    difference is inf, and inf * mask 0 is NaN. Masked tokens must contribute exactly 0."""
    logprobs, micro, entropy = hand_batch()
    config = LossConfig(**{**LOSS, "gspo": gspo, "kl_estimator": "k3"})
    total, metrics = ppo_loss_fn(config)(ForwardOutput(logprobs=logprobs, entropy=entropy), micro)
    total.backward()
    want, want_grad = total.item(), logprobs.grad.clone()
    logprobs.grad = None
    far = {k: v.clone() for k, v in micro.items()}
    far["old_logprobs"][:, 2] = -1000.0  # padding column: exp(998) overflows
    far["ref_logprobs"][:, 2] = 1000.0
    total, metrics = ppo_loss_fn(config)(ForwardOutput(logprobs=logprobs, entropy=entropy), far)
    total.backward()
    assert total.item() == pytest.approx(want, abs=1e-12)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    torch.testing.assert_close(logprobs.grad, want_grad, atol=1e-12, rtol=0)
    rewards, _, _ = kl_penalised_rewards(
        torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(2, dtype=torch.float64),
        logprobs.detach(),
        far["ref_logprobs"],
        far["response_mask"],
        0.1,
        "k3",
    )
    assert torch.isfinite(rewards).all() and (rewards[:, 2] == 0).all()


def test_without_kl_and_entropy_the_loss_is_the_policy_term_alone() -> None:
    logprobs, micro, _ = hand_batch()
    loss = {**LOSS, "kl_coef": 0.0, "entropy_coef": 0.0, "agg_mode": "seq-mean-token-sum"}
    total, metrics = ppo_loss_fn(LossConfig(**loss))(ForwardOutput(logprobs=logprobs), micro)
    # per-episode sums, averaged
    assert total.item() == pytest.approx((-2.28 + 1.35) / 2, abs=1e-12)
    assert "actor/kl_ref" not in metrics and "actor/entropy" not in metrics


def test_kl_penalty_mode_leaves_the_loss_and_folds_kl_into_the_rewards() -> None:
    logprobs, micro, entropy = hand_batch()
    total, metrics = ppo_loss_fn(
        LossConfig(**{**LOSS, "kl_mode": "penalty", "kl_estimator": "k1"})
    )(ForwardOutput(logprobs=logprobs, entropy=entropy), micro)
    assert total.item() == pytest.approx(-0.2325 - 0.025, abs=1e-12) and metrics[
        "actor/kl_ref"
    ] == pytest.approx(0.225)
    token_rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    scores = torch.tensor([1.0, 0.0], dtype=torch.float64)
    rewards, new_scores, _ = kl_penalised_rewards(
        token_rewards,
        scores,
        logprobs.detach(),
        micro["ref_logprobs"],
        micro["response_mask"],
        0.1,
        "k1",
    )
    torch.testing.assert_close(
        rewards, torch.tensor([[-0.05, 0.98, 0.0], [0.01, -0.03, 0.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        new_scores, torch.tensor([1.0 - 0.07, 0.0 - 0.02], dtype=torch.float64)
    )
