"""The quickstart's knobs: a sloppy demonstrator for the warm start, and the RL lr schedule."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.conftest import LAKE, LAKE_KWARGS
from trainer.config import TrainConfig, load_config
from trainer.errors import ConfigError, TrainerError
from trainer.rollout.trajectory import ChatRenderer
from trainer.sft import expert_trajectories

MAPS = {**LAKE_KWARGS, "hole_fraction": 0.4, "max_turns": 6}


def moves(demos) -> list[str]:
    return [m["content"] for t in demos for m in t.messages if m["role"] == "assistant"]


def test_a_habitual_demonstrator_mostly_plays_its_habit_and_wins_less(policy) -> None:
    renderer = ChatRenderer(policy[1])
    expert = expert_trajectories([LAKE], MAPS, renderer, episodes=60, max_turns=6)
    sloppy = expert_trajectories(
        [LAKE], MAPS, renderer, episodes=60, max_turns=6, noise=0.6, noise_action="down"
    )
    assert all(t.success for t in expert)
    share = moves(sloppy).count("down") / len(moves(sloppy))
    assert share > 0.7  # 60% habit plus the expert's own downs
    # some play, far from the expert
    assert 0.1 < sum(t.success for t in sloppy) / len(sloppy) < 0.7
    again = expert_trajectories(
        [LAKE], MAPS, renderer, episodes=60, max_turns=6, noise=0.6, noise_action="down"
    )
    # seeded: the same demos every run
    assert [t.messages for t in again] == [t.messages for t in sloppy]


def test_epsilon_greedy_noise_draws_moves_the_expert_made(policy) -> None:
    renderer = ChatRenderer(policy[1])
    demos = expert_trajectories([LAKE], MAPS, renderer, episodes=40, max_turns=6, noise=1.0, seed=3)
    assert set(moves(demos)) <= {"up", "down", "left", "right"}
    assert {"up", "left"} & set(moves(demos)) or len(
        set(moves(demos))
    ) >= 2  # not only the expert's route


def test_noise_out_of_range_is_rejected(policy) -> None:
    with pytest.raises(TrainerError, match=r"sft.expert_noise must be in \[0, 1\]"):
        expert_trajectories(
            [LAKE], MAPS, ChatRenderer(policy[1]), episodes=1, max_turns=6, noise=1.5
        )
    with pytest.raises(ConfigError, match="sft.expert_noise"):
        load_config(None, ["sft.expert_noise=2"])


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [1.0, 0.775, 0.55, 0.325, 0.1]),
        (
            "cosine",
            [
                1.0,
                0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2,
                0.55,
                0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2,
                0.1,
            ],
        ),
    ],
)
def test_lr_schedule_by_hand(schedule: str, expected: list[float]) -> None:
    train = TrainConfig(lr=1.0, steps=5, lr_schedule=schedule, min_lr_ratio=0.1)
    assert [train.lr_at(step) for step in range(1, 6)] == pytest.approx(expected)


def test_lr_warmup_then_decay() -> None:
    train = TrainConfig(lr=2.0, steps=6, lr_schedule="linear", warmup_steps=2)
    # warm-up: 2/3, 4/3; then linear from 2.0 (step 3) to 0 (step 6)
    assert [train.lr_at(step) for step in range(1, 7)] == pytest.approx(
        [2 / 3, 4 / 3, 2.0, 4 / 3, 2 / 3, 0.0]
    )


def test_the_warm_start_follows_its_own_schedule(tmp_path, monkeypatch) -> None:
    """``sft.lr_schedule``/``warmup_steps``/``min_lr_ratio`` set every warm-start step's rate."""
    import trainer.pipeline
    from tests.trainer.test_cli import QUICKSTART, TINY
    from trainer.config import scheduled_lr
    from trainer.pipeline import AgenticPipeline

    seen: list[float] = []

    def recorded(*args, **kwargs) -> float:
        seen.append(scheduled_lr(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(trainer.pipeline, "scheduled_lr", recorded)  # each step's rate, as sent
    overrides = ["train.steps=0", "sft.lr=0.01", "sft.lr_schedule=cosine", "sft.warmup_steps=1"]
    cfg = load_config(
        QUICKSTART, [*TINY, *overrides, "sft.min_lr_ratio=0.1", f"output_dir={tmp_path}"]
    )
    AgenticPipeline(cfg).fit()
    steps = 4 * 2  # 4 epochs of 16 demonstrations in batches of 8
    rates = [scheduled_lr(s, steps, 0.01, "cosine", min_ratio=0.1, warmup=1) for s in range(1, 9)]
    assert rates[0] == pytest.approx(0.005) and rates[-1] == pytest.approx(0.001)
    assert seen == pytest.approx(rates)
