"""Advantage estimators pinned against values worked out by hand (arithmetic in comments)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from trainer.algos.advantages import (
    compute_advantages,
    gae,
    gigpo,
    grpo,
    kl_penalised_rewards,
    masked_whiten,
    reinforce_plus_plus,
    rloo,
)


def test_grpo_group_normalised_by_hand() -> None:
    # group 0: scores [1, 0, 0, 1] -> mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    # group 1: scores [2, 2]       -> std 0 -> advantage 0 (no learning signal)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.tensor([[0, 1, 1]] * 6, dtype=torch.float32)
    adv = grpo(scores, groups, mask, eps=0.0 + 1e-12)
    expected = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0])[:, None] * mask
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    # Dr. GRPO: mean only -> [0.5, -0.5, -0.5, 0.5, 0, 0]
    adv = grpo(scores, groups, mask, normalize_std=False)
    torch.testing.assert_close(adv[:, 1], torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))


def test_rloo_leave_one_out_by_hand() -> None:
    # group of 3: scores [3, 0, 0]: A_0 = 3 - (0+0)/2 = 3 ; A_1 = 0 - (3+0)/2 = -1.5 ; A_2 = -1.5
    # a group of one has no baseline -> 0
    scores = torch.tensor([3.0, 0.0, 0.0, 5.0])
    groups = torch.tensor([7, 7, 7, 9])
    mask = torch.ones(4, 2)
    adv = rloo(scores, groups, mask)
    torch.testing.assert_close(adv[:, 0], torch.tensor([3.0, -1.5, -1.5, 0.0]))


def test_gae_skips_env_tokens_by_hand() -> None:
    # one row: tokens [prompt, a1, env, a2]; policy tokens at t=1 and t=3.
    # rewards: r(a1)=0, r(a2)=1 ; values: V(a1)=0.5, V(a2)=0.8 ; gamma=0.9, lam=0.5
    # t=3 (last): delta = 1 + 0.9*0 - 0.8 = 0.2 ; A = 0.2
    # t=1: next policy value is V(a2)=0.8: delta = 0 + 0.9*0.8 - 0.5 = 0.22 ;
    #      A = 0.22 + 0.9*0.5*0.2 = 0.31
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 9.0, 0.8]])  # 9.0 on non-policy tokens must be ignored
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.31, 0.0, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.81, 0.0, 1.0]]))


def test_reinforce_plus_plus_returns_then_whitened_by_hand() -> None:
    # row 0 policy tokens t=0,1 rewards [0, 1], gamma 0.5: G = [0 + 0.5*1, 1] = [0.5, 1]
    # row 1 policy token t=1 reward -1: G = [-1]
    rewards = torch.tensor([[0.0, 1.0], [0.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    ret = reinforce_plus_plus(rewards, mask, gamma=0.5, whiten=False)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0], [0.0, -1.0]]))
    # whitened over the 3 policy tokens: mean = (0.5+1-1)/3 = 1/6 ;
    # var = ((1/3)^2 + (5/6)^2 + (7/6)^2)/3 = (4+25+49)/36/3 = 78/108 ; std = sqrt(0.7222) = 0.84984
    adv = reinforce_plus_plus(rewards, mask, gamma=0.5)
    std = math.sqrt(78 / 108)
    expected = torch.tensor([[(0.5 - 1 / 6) / std, (1 - 1 / 6) / std], [0.0, (-1 - 1 / 6) / std]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_masked_whiten_ignores_masked_entries() -> None:
    values = torch.tensor([1.0, 3.0, 100.0])
    out = masked_whiten(values, torch.tensor([1.0, 1.0, 0.0]))  # mean 2, std 1
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, 0.0]), atol=1e-4, rtol=0)


def test_compute_advantages_errors_name_the_fix() -> None:
    mask = torch.ones(1, 1)
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(
            "gae", response_mask=mask, token_rewards=mask, scores=mask[0], group_ids=mask[0].long()
        )
    with pytest.raises(ValueError, match="use one of 'gae'"):
        compute_advantages(
            "ppo", response_mask=mask, token_rewards=mask, scores=mask[0], group_ids=mask[0].long()
        )  # type: ignore[arg-type]


def test_gigpo_adds_a_step_advantage_among_turns_that_answered_the_same_state() -> None:
    # one group, two episodes of two turns each (rows: ep0 t0, ep0 t1, ep1 t0, ep1 t1);
    # episode returns [1, 0] -> GRPO over episodes: mean 0.5, std 0.5 -> +1 for ep0, -1 for ep1.
    # Both first turns answered state 0; the second turns answered states 1 and 2 (distinct).
    # Step returns [1, 1, 0, 0]: anchor {ep0 t0, ep1 t0} has mean 0.5, std 0.5 -> +1 / -1;
    # states 1 and 2 were each seen once -> 0. With step_weight 0.5:
    #   ep0 t0: 1 + 0.5 * 1 = 1.5 ; ep0 t1: 1 + 0 = 1 ; ep1 t0: -1 - 0.5 = -1.5 ; ep1 t1: -1
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([3, 3, 3, 3])
    episodes = torch.tensor([0, 0, 1, 1])
    states = torch.tensor([0, 1, 0, 2])
    returns = torch.tensor([1.0, 1.0, 0.0, 0.0])
    mask = torch.ones(4, 2)
    adv = gigpo(scores, groups, mask, states, returns, episodes, step_weight=0.5, eps=1e-12)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.5, 1.0, -1.5, -1.0]), atol=1e-6, rtol=0)
    # the same state id in another group is another anchor: no comparison across groups
    other = gigpo(
        scores, torch.tensor([3, 3, 4, 4]), mask, states, returns, episodes, step_weight=0.5
    )
    torch.testing.assert_close(other, torch.zeros(4, 2), atol=1e-6, rtol=0)
    # through the dispatcher; without per-turn inputs it says what to set
    via, _ = compute_advantages(
        "gigpo",
        response_mask=mask,
        token_rewards=torch.zeros(4, 2),
        scores=scores,
        group_ids=groups,
        episode_ids=episodes,
        state_ids=states,
        step_returns=returns,
        step_weight=0.5,
    )
    torch.testing.assert_close(via, adv, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="rollout.sample_unit: turn"):
        compute_advantages(
            "gigpo", response_mask=mask, token_rewards=torch.zeros(4, 2), scores=scores,
            group_ids=groups,
        )  # fmt: skip


def test_under_a_kl_penalty_gigpo_turns_pay_the_kl_of_their_turn_and_the_later_ones() -> None:
    # rows: ep0 t0, ep0 t1, ep1 t0, ep1 t1, one policy token each; k1 KL = old - ref per token:
    # [0.5, 2, 0, 1]. With gamma 0.5 each turn's KL to go is [0.5 + 0.5*2, 2, 0 + 0.5*1, 1]
    # = [1.5, 2, 0.5, 1]; kl_coef 0.1 takes a tenth of it off each step return [1, 1, 0, 0].
    # (Both first turns answered one state: without it, ep0 t0's step advantage ignored the
    # 2.0 its episode paid later.)
    kl = torch.tensor([[0.5], [2.0], [0.0], [1.0]], dtype=torch.float64)
    penalised = kl_penalised_rewards(
        torch.zeros(4, 1, dtype=torch.float64),
        torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64),
        torch.zeros(4, 1, dtype=torch.float64),
        -kl,
        torch.ones(4, 1, dtype=torch.float64),
        0.1,
        "k1",
        episode_ids=torch.tensor([0, 0, 1, 1]),
        step_returns=torch.tensor([1.0, 1.0, 0.0, 0.0]),
        gamma=0.5,
    )
    torch.testing.assert_close(
        penalised.step_returns, torch.tensor([0.85, 0.8, -0.05, -0.1]), atol=1e-6, rtol=0
    )
    # each row's score loses its episode's whole KL (2.5 and 1.0), as before
    torch.testing.assert_close(
        penalised.scores, torch.tensor([0.75, 0.75, -0.1, -0.1], dtype=torch.float64)
    )
