"""Per-turn samples (``rollout.sample_unit: turn``) train what one row per episode trains.

The same episodes are collated twice: as one row per episode (the policy's tokens of every turn
in one sequence, env tokens between them) and as one row per turn (each turn's own prompt, then
its tokens). ``rollout.sample_unit: auto`` picks either from the chat template alone, so a run
must not learn something else because its template rewrites history: every policy token gets
the same advantage in both, whatever the estimator, ``algorithm.gamma`` or the KL penalty.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from trainer.config import load_config
from trainer.pipeline import AgenticPipeline
from trainer.rollout.collate import collate
from trainer.rollout.trajectory import Trajectory

KL_PER_TOKEN = {0: 1.0, 1: 0.25}
"""k1 KL to the reference on each policy token, per episode (nats)."""


def as_turns(group: int, rewards: list[float], tokens: list[int], final: float) -> Trajectory:
    """An episode with one sample per turn: turn k writes ``tokens[k]`` policy tokens."""
    episode = Trajectory("e", 0, group, final_reward=final)
    for k, (reward, n) in enumerate(zip(rewards, tokens, strict=True)):
        sample = episode.turn_sample([1, 2, 3 + k])
        sample.append_policy([7] * n, [-1.0] * n)
        sample.end_turn(reward)
        episode.end_turn(reward)
        episode.samples.append(sample)
    return episode


def as_one_row(group: int, rewards: list[float], tokens: list[int], final: float) -> Trajectory:
    """The same episode as one sequence: the prompt, then each turn with env tokens between."""
    episode = Trajectory("e", 0, group, final_reward=final)
    episode.append_context([1, 2, 3])
    for k, (reward, n) in enumerate(zip(rewards, tokens, strict=True)):
        if k:
            episode.append_context([5, 5])
        episode.append_policy([7] * n, [-1.0] * n)
        episode.end_turn(reward)
    return episode


EPISODES = [  # (group, turn rewards, policy tokens per turn, final reward)
    (0, [0.0, -1.0, 0.0, 1.0], [3, 2, 1, 3], 0.5),
    (0, [1.0], [3], 0.0),
    (1, [0.0, 2.0], [2, 4], 0.0),
    (1, [0.5, 0.0, 0.0], [1, 1, 2], 1.0),
]


def advantages_per_episode(
    sample_unit: str, estimator: str, gamma: float, kl_coef: float
) -> list[list[float]]:
    """Each episode's policy-token advantages in the order the policy wrote them, as the
    pipeline computes them from ``sample_unit`` rows, with ``kl_mode: penalty`` at ``kl_coef``
    (k1: the episodes' ``KL_PER_TOKEN``). The critic's value of a policy token is a fixed
    function of its position in the episode, so both layouts see the same values."""
    build = as_turns if sample_unit == "turn" else as_one_row
    batch = collate([build(*spec) for spec in EPISODES], pad_token_id=0)
    mask, episode_ids = batch["response_mask"], batch["episode_ids"]
    position = torch.zeros_like(mask)  # policy tokens of the episode written before this one
    written = [0.0] * len(EPISODES)
    for r, episode in enumerate(episode_ids.tolist()):
        position[r] = (mask[r].cumsum(-1) - 1 + written[episode]) * mask[r]
        written[episode] += float(mask[r].sum())
    kl = torch.tensor([KL_PER_TOKEN[e % 2] for e in episode_ids.tolist()])[:, None] * mask
    batch["ref_logprobs"] = batch["old_logprobs"] - kl
    batch["values"] = (0.1 * position + 0.3) * mask
    cfg = load_config(
        None,
        [
            f"algorithm.advantage_estimator={estimator}",
            f"algorithm.gamma={gamma}",
            "algorithm.lam=1.0",
            f"algorithm.loss.kl_coef={kl_coef}",
            "algorithm.loss.kl_mode=penalty",
            "algorithm.loss.kl_estimator=k1",
            *(["rollout.sample_unit=turn"] if estimator == "gigpo" else []),
        ],
    )
    if estimator == "gigpo":  # no state repeats: GiGPO's step advantages are all 0
        batch["state_ids"] = torch.arange(mask.shape[0])
        batch["step_returns"] = torch.zeros(mask.shape[0])
    AgenticPipeline.compute_advantages(SimpleNamespace(cfg=cfg), batch)  # type: ignore[arg-type]
    advantages = batch["advantages"]
    out: list[list[float]] = [[] for _ in EPISODES]
    for r, episode in enumerate(episode_ids.tolist()):
        out[episode] += advantages[r][mask[r] > 0].tolist()
    return out


def assert_same(turns: list[list[float]], episodes: list[list[float]]) -> None:
    assert [len(a) for a in turns] == [len(a) for a in episodes]
    for got, want in zip(turns, episodes, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gigpo"])
def test_a_kl_penalty_costs_an_episode_its_whole_kl_with_per_turn_rows(estimator: str) -> None:
    """Every row of an episode loses the KL of all the episode's turns: a 4-turn episode that
    drifted from the reference is penalised as much as in episode mode, not by one turn's KL,
    and all its rows get one advantage."""
    turns = advantages_per_episode("turn", estimator, 1.0, 0.1)
    # GiGPO needs per-turn rows; where no state repeats it is GRPO, which one row per episode runs
    episodes = advantages_per_episode("episode", estimator.replace("gigpo", "grpo"), 1.0, 0.1)
    assert_same(turns, episodes)
    assert all(len(set(a)) == 1 for a in turns)  # one advantage per episode


@pytest.mark.parametrize("estimator", ["reinforce_pp", "gae"])
def test_a_kl_penalty_on_later_turns_reaches_earlier_turn_rows(estimator: str) -> None:
    """Token-reward estimators: a turn's row is credited with the KL its episode pays in later
    turns, as one row per episode credits every token with the KL after it."""
    assert_same(
        advantages_per_episode("turn", estimator, 1.0, 0.1),
        advantages_per_episode("episode", estimator, 1.0, 0.1),
    )


@pytest.mark.parametrize("estimator", ["reinforce_pp", "gae"])
def test_gamma_discounts_later_turns_per_token_with_per_turn_rows(estimator: str) -> None:
    """``algorithm.gamma < 1``: a later turn's reward reaches an earlier turn's tokens discounted
    by the policy tokens between them, as in one row per episode (no KL here)."""
    assert_same(
        advantages_per_episode("turn", estimator, 0.5, 0.0),
        advantages_per_episode("episode", estimator, 0.5, 0.0),
    )


@pytest.mark.parametrize("estimator", ["reinforce_pp", "gae"])
def test_gamma_and_the_kl_penalty_together_with_per_turn_rows(estimator: str) -> None:
    assert_same(
        advantages_per_episode("turn", estimator, 0.8, 0.1),
        advantages_per_episode("episode", estimator, 0.8, 0.1),
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "gae"])
def test_without_a_penalty_or_a_discount_both_layouts_agree(estimator: str) -> None:
    """The harness itself: undiscounted rewards alone were always credited alike."""
    assert_same(
        advantages_per_episode("turn", estimator, 1.0, 0.0),
        advantages_per_episode("episode", estimator, 1.0, 0.0),
    )


def test_later_returns_by_hand() -> None:
    """Rows of episode 0 with a row of episode 1 between them and an empty row (no policy
    token) among them; gamma 0.5. Row C's reward 1 sits on its 2nd policy token, so from C's
    first token it is worth 0.5; the empty row passes that on; row A's last token gets
    gamma * 0.5 = 0.25 (one row per episode: 1 two policy tokens later, 0.5^2). Episode 1's
    row and the last row of episode 0 get nothing more."""
    from trainer.algos.advantages import later_returns

    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    out = later_returns(rewards, mask, torch.tensor([0, 1, 0, 0]), gamma=0.5)
    expected = rewards.clone()
    expected[0, 2] = 0.25
    torch.testing.assert_close(out, expected)
    assert rewards[0, 2] == 0.0  # a new tensor
