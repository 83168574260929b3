"""Losses pinned against values worked out by hand (arithmetic in comments)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from trainer.algos.losses import (
    aggregate,
    entropy_from_logits,
    gspo_loss,
    kl_estimate,
    policy_loss,
    ppo_clip_loss,
    value_loss,
)


def test_aggregation_modes_by_hand() -> None:
    # row 0: losses [1, 2, 3] all masked in ; row 1: [4, x, x] only first in
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token-mean: (1+2+3+4)/4 = 2.5
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: mean(6/3, 4/1) = 3
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum: mean(6, 4) = 5
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregate(loss, mask, "mean")  # type: ignore[arg-type]


def test_ppo_clip_asymmetric_bounds_by_hand() -> None:
    # ratios e^{log r}: [1.5, 0.5, 1.1] ; advantages [+1, -1, +1]; clip_low 0.2, clip_high 0.28
    # tok0: A>0, r=1.5 -> clip to 1.28: max(-1.5, -1.28) = -1.28 (clipped)
    # tok1: A<0, r=0.5 -> clip to 0.8 : max(0.5, 0.8) = 0.8 (clipped)
    # tok2: A>0, r=1.1 inside -> -1.1
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, clipped = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8, -1.1]]))
    torch.testing.assert_close(clipped, torch.tensor([[1.0, 1.0, 0.0]]))


def test_ppo_dual_clip_caps_negative_advantage_by_hand() -> None:
    # A = -2, ratio = 10: plain PPO loss = max(20, 2*1.2=2.4) = 20 ; dual clip c=3 caps at -A*c = 6
    # A = -2, ratio = 2: loss = max(4, 2.4) = 4 < 6 -> unchanged ; A = +1 is never dual-clipped
    logp = torch.log(torch.tensor([[10.0, 2.0, 10.0]]))
    adv = torch.tensor([[-2.0, -2.0, 1.0]])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 3), adv, 0.2, 0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[6.0, 4.0, -1.2]]))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(logp, torch.zeros(1, 3), adv, dual_clip=0.5)


def test_gspo_sequence_ratio_by_hand() -> None:
    # row: token log-ratios [0.2, 0.0, (env, masked) 5.0] -> mean over policy tokens = 0.1
    # s = e^0.1 = 1.10517 ; A = +1, clip_high = 0.05 -> clipped to 1.05 -> loss = -1.05 per token
    logp = torch.tensor([[0.2, 0.0, 5.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.ones(1, 3)
    loss, clipped = gspo_loss(logp, old, adv, mask, clip_low=0.05, clip_high=0.05)
    torch.testing.assert_close(loss[0, :2], torch.tensor([-1.05, -1.05]))
    assert clipped[0, :2].tolist() == [1.0, 1.0]
    # inside the bounds the per-token gradient is -A * s (the sequence ratio): with wide bounds
    loss, _ = gspo_loss(logp, old, adv, mask, clip_low=0.5, clip_high=0.5)
    aggregate(loss, mask, "seq-mean-token-mean").backward()
    # d/dlogp_t of mean_t(-s * e^{logp_t - sg}) = -s/2 for each of the 2 policy tokens
    torch.testing.assert_close(logp.grad[0, :2], torch.full((2,), -math.exp(0.1) / 2))
    assert logp.grad[0, 2].item() == 0.0
    with pytest.raises(ValueError, match="use 'ppo' or 'gspo'"):
        policy_loss("trpo", logp, old, adv, mask, 0.2, 0.2)  # type: ignore[arg-type]


def test_gspo_dual_clip_caps_negative_advantage_by_hand() -> None:
    # one sequence, log-ratio ln 5 on both tokens -> s = 5 ; A = -1: plain loss = max(5, 1.0004)
    # = 5 ; dual clip c = 3 caps it at -A * c = 3, as PPO's does (and GSPO's own settings)
    logp = torch.full((1, 2), math.log(5.0), requires_grad=True)
    mask, adv = torch.ones(1, 2), -torch.ones(1, 2)
    loss, _ = policy_loss("gspo", logp, torch.zeros(1, 2), adv, mask, 3e-4, 4e-4, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 3.0]]))
    loss.sum().backward()  # capped: a constant, no gradient pushing the bad action further
    assert logp.grad.abs().max().item() == 0.0
    ppo, _ = policy_loss("ppo", logp, torch.zeros(1, 2), adv, mask, 0.2, 0.2, dual_clip=3.0)
    torch.testing.assert_close(ppo, loss)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        gspo_loss(logp, torch.zeros(1, 2), adv, mask, dual_clip=0.5)


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
@pytest.mark.parametrize("advantage", [0.0, -1.0, 1.0])
def test_an_overflowing_ratio_gives_a_finite_loss_and_gradient(kind: str, advantage: float) -> None:
    """A log-ratio of 100 nats (exp overflows float32): a token of a zero-variance GRPO group
    (A = 0) must add 0, not 0 * inf = NaN, which would stop the run; the log-ratio is clamped
    to [-20, 20] before exp, as verl does."""
    logp = torch.zeros(2, 2, requires_grad=True)
    old = torch.tensor([[-100.0, -100.0], [100.0, 100.0]])  # ratios e^100 and e^-100
    mask, adv = torch.ones(2, 2), torch.full((2, 2), advantage)
    loss, _ = policy_loss(kind, logp, old, adv, mask, 0.2, 0.2)  # type: ignore[arg-type]
    assert torch.isfinite(loss).all(), loss
    aggregate(loss, mask).backward()
    assert torch.isfinite(logp.grad).all(), logp.grad
    if advantage == 0.0:
        assert loss.abs().max().item() == 0.0


def test_kl_estimators_by_hand() -> None:
    # logp - ref = d = [0.5, -0.5]
    logp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([-0.5, -0.5])
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -0.5]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.125]))
    # k3 = e^{-d} + d - 1: e^-0.5 + 0.5 - 1 = 0.106531 ; e^0.5 - 0.5 - 1 = 0.148721
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k3"), torch.tensor([0.106531, 0.148721]), atol=1e-6, rtol=0
    )
    with pytest.raises(ValueError, match="use 'k1', 'k2' or 'k3'"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_entropy_by_hand() -> None:
    # uniform over 4 -> ln 4 = 1.386294 ; one-hot (huge logit) -> ~0
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([math.log(4), 0.0]), atol=1e-5, rtol=0
    )


def test_value_loss_clipped_by_hand() -> None:
    # V=2, old=1, R=0, clip 0.5: V_clip = 1.5 ; 0.5*max(4, 2.25) = 2
    # V=0.2, old=1, R=1: V_clip = 0.5 ; 0.5*max(0.64, 0.25) = 0.32
    v = torch.tensor([2.0, 0.2])
    out = value_loss(v, torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]), clip=0.5)
    torch.testing.assert_close(out, torch.tensor([2.0, 0.32]))
    torch.testing.assert_close(
        value_loss(v, v, torch.zeros(2), clip=None), torch.tensor([2.0, 0.02])
    )


def test_k3_is_bounded_where_policy_and_reference_are_far_apart() -> None:
    """``exp`` of a gap of tens of nats overflows: k3 is clamped (as verl clamps it to 10), so
    a token the policy has moved far from the reference cannot make the loss inf and stop a
    run."""
    logprobs = torch.tensor([-0.1, -30.0, -100.0, -0.1], requires_grad=True)
    ref = torch.tensor([-0.2, -0.1, -0.1, -90.0])
    kl = kl_estimate(logprobs, ref, "k3")
    assert torch.isfinite(kl).all() and kl.max() <= 10.0
    assert float(kl[0]) == pytest.approx(float(torch.exp(torch.tensor(-0.1)) + 0.1 - 1), rel=1e-5)
    kl.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
