"""``algorithm``: what a setting means is what runs. GSPO gets GSPO's clip and aggregation, a KL
loss term that would do nothing is refused, and Dr. GRPO is one key away."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from trainer.config import LossConfig, load_config
from trainer.errors import ConfigError

torch = pytest.importorskip("torch")


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return [str(p) for p in info.value.problems]


# --------------------------------------------------------------------------- GSPO


def test_gspo_runs_with_gspos_clip_and_per_sequence_mean_unless_told_otherwise() -> None:
    """GSPO's sequence ratio sits within about 1e-3 of 1: PPO's clip of 0.2 would never fire, and
    a token mean would weigh each sequence by its length (what GSPO's ratio undoes)."""
    loss = load_config(None, ["algorithm.loss.gspo=true"]).algorithm.loss
    assert (loss.clip_low, loss.clip_high, loss.agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    ppo = load_config(None, []).algorithm.loss
    assert (ppo.clip_low, ppo.clip_high, ppo.agg_mode) == (0.2, 0.2, "token-mean")
    assert LossConfig(gspo=True).clip_high == 4e-4  # built directly, as the workers' tests do
    # null is "the algorithm's default" too
    assert LossConfig(gspo=True, clip_low=None).clip_low == 3e-4


def test_gspo_with_a_ppo_sized_clip_or_a_token_mean_loads_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        loss = load_config(
            None,
            ["algorithm.loss.gspo=true", "algorithm.loss.clip_high=0.28"],
        ).algorithm.loss
    assert (loss.clip_low, loss.clip_high) == (3e-4, 0.28)  # the user's value is kept
    assert "algorithm.loss.clip_high=0.28 with algorithm.loss.gspo" in caplog.text
    assert "GSPO's sequence ratio" in caplog.text and "GSPO uses 0.0004" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        loss = load_config(
            None, ["algorithm.loss.gspo=true", "algorithm.loss.agg_mode=token-mean"]
        ).algorithm.loss
    assert loss.agg_mode == "token-mean"
    assert "algorithm.loss.agg_mode=token-mean with algorithm.loss.gspo" in caplog.text
    assert "seq-mean-token-mean" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # GSPO's own values, written out: nothing to say
        load_config(
            None,
            [
                "algorithm.loss.gspo=true",
                "algorithm.loss.clip_low=3e-4",
                "algorithm.loss.agg_mode=seq-mean-token-mean",
            ],
        )
    assert caplog.text == ""


# --------------------------------------------------------------------------- the KL term


def test_a_k1_kl_loss_term_is_refused_naming_the_fix() -> None:
    """k1 = log pi - log ref has zero expected gradient under pi: the KL the user turned on would
    pull nothing towards the reference."""
    [problem] = problems_of(
        [
            "algorithm.loss.kl_coef=0.1",
            "algorithm.loss.kl_estimator=k1",
            "algorithm.loss.kl_mode=loss",
        ]
    )
    assert problem.startswith("algorithm.loss.kl_estimator: k1 as a loss term")
    assert "gradient is zero in expectation" in problem
    assert "kl_estimator: k2" in problem and "k3" in problem and "kl_mode: penalty" in problem


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.loss.kl_estimator=k1", "algorithm.loss.kl_mode=penalty"],
        ["algorithm.loss.kl_estimator=k1", "algorithm.loss.kl_coef=0"],
        ["algorithm.loss.kl_estimator=k2", "algorithm.loss.kl_mode=loss"],
    ],
)
def test_k1_as_a_reward_penalty_or_without_a_kl_term_loads(overrides: list[str]) -> None:
    load_config(None, ["algorithm.loss.kl_coef=0.1", *overrides])


# --------------------------------------------------------------------------- Dr. GRPO


def grpo_advantages(overrides: list[str]) -> list[float]:
    """The pipeline's advantages of one group of three episodes scoring 3, 0 and 0."""
    from trainer.pipeline import AgenticPipeline

    cfg = load_config(None, overrides)
    batch = {
        "response_mask": torch.ones(3, 1),
        "token_rewards": torch.zeros(3, 1),
        "scores": torch.tensor([3.0, 0.0, 0.0]),
        "group_ids": torch.zeros(3, dtype=torch.long),
        "episode_ids": torch.arange(3),
    }
    AgenticPipeline.compute_advantages(SimpleNamespace(cfg=cfg), batch)  # type: ignore[arg-type]
    return batch["advantages"][:, 0].tolist()


def test_normalize_std_false_is_dr_grpo() -> None:
    """Dr. GRPO: the group mean is subtracted, the std is not divided by (mean 1, std sqrt 2)."""
    assert load_config(None, []).algorithm.normalize_std is True
    assert grpo_advantages([]) == pytest.approx([2 / 2**0.5, -1 / 2**0.5, -1 / 2**0.5], abs=1e-5)
    assert grpo_advantages(["algorithm.normalize_std=false"]) == pytest.approx([2.0, -1.0, -1.0])


def test_normalize_std_with_an_estimator_it_does_not_change_is_refused() -> None:
    [problem] = problems_of(["algorithm.advantage_estimator=rloo", "algorithm.normalize_std=false"])
    assert problem.startswith("algorithm.normalize_std: false (Dr. GRPO) changes grpo and gigpo")
    assert "algorithm.advantage_estimator=rloo" in problem


# --------------------------------------------------------------------------- truncated episodes


def cut_group(truncated: tuple[bool, ...]) -> list:
    """One group of episodes of one policy token each, scoring 3, 0, 0, ...; some cut short."""
    from trainer.rollout.trajectory import Trajectory

    episodes = []
    for i, cut in enumerate(truncated):
        episode = Trajectory("e", i, group_id=0)
        episode.append_context([10])
        episode.append_policy([11], [-0.5])
        episode.end_turn(3.0 if i == 0 else 0.0)
        episode.truncated = cut
        episodes.append(episode)
    return episodes


def advantages_of(episodes: list, overrides: list[str]) -> tuple[list[float], list[float]]:
    """(the advantage of each episode's policy token, its response mask) as the pipeline
    collates and scores them."""
    from trainer.pipeline import AgenticPipeline

    cfg = load_config(None, overrides)
    fake = SimpleNamespace(
        cfg=cfg, renderer=SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
    )
    batch = AgenticPipeline.to_batch(fake, episodes)  # type: ignore[arg-type]
    AgenticPipeline.compute_advantages(fake, batch)  # type: ignore[arg-type]
    return batch["advantages"][:, 1].tolist(), batch["response_mask"][:, 1].tolist()


def test_mask_truncated_trains_nothing_of_a_cut_episode_and_keeps_its_score_in_the_baseline() -> (
    None
):
    """DAPO's overlong filtering: an episode cut short (here the second) gives no loss tokens;
    the others' advantages are what they were, the cut one still in their group's mean."""
    episodes = cut_group((False, True, False))
    plain, plain_mask = advantages_of(episodes, [])
    masked, mask = advantages_of(episodes, ["algorithm.mask_truncated=true"])
    assert plain_mask == [1.0, 1.0, 1.0] and plain[1] != 0  # by default it trains as ended
    assert mask == [1.0, 0.0, 1.0] and masked[1] == 0.0
    assert masked[0] == pytest.approx(plain[0]) and masked[2] == pytest.approx(plain[2])


# --------------------------------------------------------------------------- a NaN step's advice


def refusal_of(policy, loss_fn) -> str:
    """The message of the step a NaN loss or gradient stops (HFTrainStrategy, tiny policy)."""
    import copy
    import re

    from trainer.errors import NonFiniteLossError
    from trainer.strategies.hf import HFTrainStrategy

    model, _ = policy
    strategy = HFTrainStrategy(copy.deepcopy(model), lr=1e-3, max_grad_norm=0.5)
    ids = torch.tensor([[5, 6, 7]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["response_mask"] = torch.ones(1, 3)
    with pytest.raises(NonFiniteLossError) as info:
        strategy.train_step(batch, loss_fn)
    return re.sub(r"\s+", " ", str(info.value))


def nan_loss(out, mb):
    return out.logprobs.sum() * float("nan"), {}


def nan_gradient(out, mb):
    """A finite loss (0) whose gradient is NaN."""
    out.logprobs.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    return out.logprobs.sum() * 0.0, {}


@pytest.mark.parametrize("loss_fn", [nan_loss, nan_gradient])
def test_a_nan_step_names_config_keys_that_exist_and_says_which_way_to_turn_them(
    policy, loss_fn
) -> None:
    """The advice names only keys the config loads, each to be lowered (a wider clip range or a
    higher gradient clip lets an update move further, not less)."""
    import re

    message = refusal_of(policy, loss_fn)
    keys = re.findall(r"\b(?:train|algorithm|model|rollout)\.[a-z_]+(?:\.[a-z_]+)*", message)
    assert keys and "train.lr" in keys, message
    defaults = load_config(None, [])
    for key in keys:
        value = defaults
        for part in key.split("."):
            value = getattr(value, part, None)
        load_config(None, [f"{key}={value}"])  # an unknown key would be a ConfigError
    assert "raise" not in message.lower() and "Lower train.lr" in message
    assert "train.max_grad_norm (now 0.5)" in message  # the value to lower from
    if loss_fn is nan_loss:
        assert "algorithm.loss.clip_low" in keys and "algorithm.loss.clip_high" in keys
        assert "check the rewards" in message
