"""Sokoban: seeded, always solvable levels; gym-sokoban rewards; robust action parsing."""

from __future__ import annotations

import pytest

import envhub
from envs.games.sokoban import SokobanEnv, parse_level, solve

VARIANTS = [
    "games/sokoban-5x5-v0",
    "games/sokoban-v0",
    "games/sokoban-8x8-v0",
    "games/sokoban-10x10-v0",
]

# Two boxes: one already on its target at (1, 2), one at (3, 2); targets at (1, 2) and (1, 4).
TWO_BOXES = """
# # # # # #
# P √ _ O #
# _ _ _ _ #
# _ X _ _ #
# _ _ _ _ #
# # # # # #
"""
# One push right solves it.
ONE_PUSH = """
#####
#PXO#
#___#
#___#
#####
"""


def grid(messages: list[dict]) -> str:
    """The board part of the last message (the lines made of legend characters)."""
    lines = messages[-1]["content"].splitlines()
    return "\n".join(line for line in lines if line.startswith("# "))


def play_expert(env, seed: int) -> tuple[list[dict], float, dict, int, int]:
    """Follow the expert to the end; returns the last messages, return, info, steps, start k."""
    messages, info = env.reset(seed=seed)
    on_target_at_start = info["boxes_on_target"]
    total, steps, terminated, truncated = 0.0, 0, False, False
    while not (terminated or truncated):
        action = env.expert_action()
        assert action is not None, f"seed {seed}: the expert found no plan"
        messages, reward, terminated, truncated, info = env.step(action)
        total += reward
        steps += 1
    return messages, total, info, steps, on_target_at_start


# ---------------------------------------------------------------------------- generation
def test_same_seed_gives_the_same_episode():
    first, second = envhub.make("games/sokoban-8x8-v0"), envhub.make("games/sokoban-8x8-v0")
    obs_a, _ = first.reset(seed=11)
    obs_b, _ = second.reset(seed=11)
    assert obs_a == obs_b
    for action in [
        "<answer>up</answer>",
        "<answer>left</answer>",
        "down",
        "R",
        "<answer>?</answer>",
    ]:
        assert first.step(action) == second.step(action)


def test_different_seeds_give_different_levels():
    env = envhub.make("games/sokoban-v0")
    levels = {grid(env.reset(seed=seed)[0]) for seed in range(10)}
    assert len(levels) == 10


@pytest.mark.parametrize("env_id", VARIANTS)
def test_expert_solves_every_level_within_the_turn_limit(env_id):
    env = envhub.make(env_id)
    for seed in range(30):
        messages, total, info, steps, start = play_expert(env, seed)
        last = messages[-1]["content"]
        assert info["success"] is True, f"{env_id} seed {seed} was not solved:\n{last}"
        assert info["boxes_on_target"] == info["num_boxes"] == env.num_boxes
        assert steps <= env.max_turns
        assert total == pytest.approx(10 + (env.num_boxes - start) - 0.1 * steps, abs=1e-6)
        assert "puzzle solved" in messages[-1]["content"]


@pytest.mark.parametrize("env_id", VARIANTS)
def test_levels_are_walled_nontrivial_and_have_the_right_box_count(env_id):
    env = envhub.make(env_id)
    for seed in range(10):
        messages, info = env.reset(seed=seed)
        rows = grid(messages).split("\n")
        assert len(rows) == env.size and all(len(r.split()) == env.size for r in rows)
        assert set(rows[0].split()) == {"#"} and set(rows[-1].split()) == {"#"}
        assert all(r.split()[0] == "#" and r.split()[-1] == "#" for r in rows)
        board = "".join(rows)
        assert board.count("X") + board.count("√") == env.num_boxes
        assert board.count("P") + board.count("S") == 1
        assert info["boxes_on_target"] < info["num_boxes"]
        assert len(env.level.solution) >= env.size - 2  # generator rejects too-easy levels


# its speed: benchmarks/speed_checks.py
def test_solver_finds_optimal_solutions_on_the_largest_variant():
    env = envhub.make("games/sokoban-10x10-v0")
    for seed in range(10):
        env.reset(seed=seed)
        moves = solve(env.level)
        assert moves is not None and len(moves) == len(env.level.solution)


def test_expert_replans_after_the_player_wanders_off():
    env = envhub.make("games/sokoban-8x8-v0")
    solved = 0
    for seed in range(10):
        env.reset(seed=seed)
        boxes = env.boxes
        for move in ["up", "left", "down", "right"]:
            env.step(f"<answer>{move}</answer>")
            if env.boxes != boxes:
                break  # a push may have made the level unsolvable; skip this seed
        else:
            while not env.done:
                env.step(env.expert_action())
            solved += env.solved
            assert env.solved or env.turn == env.max_turns
    assert solved >= 5


# ---------------------------------------------------------------------------- rewards
def test_rewards_for_pushing_on_and_off_targets_and_walls():
    env = SokobanEnv(size=6, num_boxes=2)
    messages, info = env.reset(seed=0, options={"level": TWO_BOXES})
    assert info["boxes_on_target"] == 1 and info["num_boxes"] == 2
    assert "Boxes on target: 1/2" in messages[-1]["content"]

    _, reward, terminated, _, info = env.step("<answer>up</answer>")  # wall
    assert reward == pytest.approx(-0.1) and not terminated
    assert env.player == (1, 1) and info["blocked_moves"] == 1
    _, reward, _, _, info = env.step("<answer>right</answer>")  # box pushed off its target
    assert reward == pytest.approx(-1.1) and info["boxes_on_target"] == 0
    _, reward, _, _, info = env.step("<answer>right</answer>")  # pushed onto the other target
    assert reward == pytest.approx(0.9) and info["boxes_on_target"] == 1
    messages, reward, terminated, _, info = env.step("<answer>right</answer>")  # box at the wall
    assert reward == pytest.approx(-0.1) and not terminated and env.boxes == [(1, 4), (3, 2)]
    assert "nothing moved" in messages[-1]["content"]


def test_solving_gives_the_bonus_and_terminates():
    env = SokobanEnv(size=5)
    env.reset(seed=0, options={"level": ONE_PUSH})
    messages, reward, terminated, truncated, info = env.step("I'll push it <answer>right</answer>")
    assert reward == pytest.approx(-0.1 + 1 + 10)
    assert terminated and not truncated and info["success"] is True
    assert "S" not in grid(messages) and "√" in grid(messages)
    with pytest.raises(envhub.errors.EpisodeOverError):
        env.step("<answer>left</answer>")


def test_several_moves_per_turn_when_allowed():
    env = SokobanEnv(size=6, num_boxes=2, max_moves_per_turn=3)
    env.reset(seed=0, options={"level": TWO_BOXES})
    messages, reward, _, _, info = env.step("<answer>right, right</answer>")
    assert reward == pytest.approx(-1.1 + 0.9) and info["moves"] == ["right", "right"]
    assert "Move 2:" in messages[-1]["content"]
    _, reward, _, _, info = env.step("<answer>up up up up</answer>")
    assert info["invalid_action"] is True and reward < 0
    expert = env.expert_action()  # up to three moves of a plan that solves the rest
    assert expert is not None and 1 <= len(expert.split(",")) <= 3
    while not env.done:
        env.step(env.expert_action())
    assert env.solved


def test_truncated_at_max_turns():
    env = SokobanEnv(size=5, max_turns=3)
    env.reset(seed=0, options={"level": ONE_PUSH})
    for turn in range(1, 4):
        _, _, terminated, truncated, info = env.step("<answer>up</answer>")
        assert not terminated and truncated == (turn == 3) and info["turn"] == turn
    assert env.done and info["success"] is False


# ---------------------------------------------------------------------------- actions
@pytest.mark.parametrize(
    "text",
    [
        "Let me think... I'll move <answer>Left</answer>",
        "<answer>L</answer>",
        "<answer>move left</answer>",
        "<answer>LEFT.</answer>",
        "go left",
        "left",
    ],
)
def test_chatty_and_abbreviated_actions_are_understood(text):
    env = SokobanEnv(size=6, num_boxes=2)
    env.reset(seed=0, options={"level": TWO_BOXES})
    env.step("<answer>down</answer>")
    assert env.player == (2, 1)
    _, reward, _, _, info = env.step(text)
    assert info["invalid_action"] is False and reward == pytest.approx(-0.1)
    assert env.player == (2, 1)  # left of (2, 1) is a wall: legal, but nothing happens
    env.step("<answer>right</answer>")
    env.step(text)
    assert env.player == (2, 1)


INVALID = [
    "<answer>jump</answer>",
    "",
    "no idea",
    "<answer>up, left</answer>",
    "x" * 5000,
    "<answer></answer>",
]


@pytest.mark.parametrize("text", INVALID)
def test_invalid_actions_are_penalised_and_explained(text):
    env = envhub.make("games/sokoban-v0")
    env.reset(seed=3)
    before = env.render_grid()
    messages, reward, terminated, truncated, info = env.step(text)
    assert info["invalid_action"] is True and reward < 0 and not terminated and not truncated
    assert env.render_grid() == before and info["turn"] == 1
    assert "boxes_on_target" in info and "num_boxes" in info
    feedback = messages[-1]["content"]
    assert "up, down, left, right" in feedback and "<answer>" in feedback


def test_first_message_explains_legend_actions_and_rewards():
    messages, _ = envhub.make("games/sokoban-v0").reset(seed=0)
    text = messages[-1]["content"]
    needles = ["# wall", "X box", "O target", "√ box on a target", "P you", "up, down, left, right"]
    for needle in [*needles, "Boxes on target: 0/1", "<answer>"]:
        assert needle in text


def test_bad_constructor_arguments_and_levels_are_refused():
    with pytest.raises(ValueError):
        SokobanEnv(size=4)
    with pytest.raises(ValueError):
        SokobanEnv(size=5, num_boxes=9)
    with pytest.raises(ValueError):
        parse_level("#####\n#PXO_\n#___#\n#___#\n#####")  # open border
    with pytest.raises(ValueError):
        parse_level("#####\n#PXX#\n#_O_#\n#___#\n#####")  # two boxes, one target
