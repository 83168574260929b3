"""Frozen Lake: seeded maps with a safe path, Gymnasium's slippery dynamics, text actions."""

from __future__ import annotations

import pytest

import envhub
from envs.games.frozen_lake import FrozenLakeEnv, parse_map, shortest_path

OPEN_4 = ["SFFF", "FFFF", "FFFF", "FFFG"]


def grid(messages: list[dict]) -> str:
    """The board part of the last message (lines of single map letters)."""
    lines = messages[-1]["content"].splitlines()
    return "\n".join(line for line in lines if line and set(line) <= set("PSFHG "))


def board_for(env, seed: int) -> tuple[str, ...]:
    env.reset(seed=seed)
    return tuple(env.board)


# ---------------------------------------------------------------------------- generation
def test_same_seed_gives_the_same_episode():
    first = envhub.make("games/frozen-lake-slippery-v0")
    second = envhub.make("games/frozen-lake-slippery-v0")
    assert first.reset(seed=5) == second.reset(seed=5)
    for action in ["<answer>down</answer>", "<answer>right</answer>", "<answer>swim</answer>", "D"]:
        result_a, result_b = first.step(action), second.step(action)
        assert result_a == result_b
        if result_a[2] or result_a[3]:
            break


def test_different_seeds_give_different_maps():
    env = envhub.make("games/frozen-lake-v0")
    assert len({board_for(env, seed) for seed in range(10)}) >= 8
    env8 = envhub.make("games/frozen-lake-8x8-v0")
    assert len({board_for(env8, seed) for seed in range(10)}) == 10


@pytest.mark.parametrize("env_id", ["games/frozen-lake-v0", "games/frozen-lake-8x8-v0"])
def test_expert_reaches_the_goal_on_every_map(env_id):
    env = envhub.make(env_id)
    holes = 0
    for seed in range(30):
        messages, info = env.reset(seed=seed)
        board = grid(messages).replace(" ", "").split("\n")
        assert board[0][0] == "P" and board[-1][-1] == "G" and len(board) == env.size
        holes += "".join(board).count("H")
        shortest = len(shortest_path(env.board, (0, 0)))
        terminated = truncated = False
        while not (terminated or truncated):
            messages, reward, terminated, truncated, info = env.step(env.expert_action())
        assert terminated and info["success"] is True and reward == 1.0, f"seed {seed}"
        assert info["turn"] == shortest >= 2 * (env.size - 1)
        assert "reached the goal" in messages[-1]["content"]
    assert holes > 0


def test_hole_fraction_controls_the_holes():
    def hole_share(fraction: float) -> float:
        env = FrozenLakeEnv(size=8, hole_fraction=fraction)
        cells = "".join("".join(board_for(env, seed)) for seed in range(20))
        return cells.count("H") / len(cells)

    assert hole_share(0.0) == 0.0
    assert 0.1 < hole_share(0.2) < 0.3
    with pytest.raises(ValueError):
        FrozenLakeEnv(hole_fraction=1.0)


# ---------------------------------------------------------------------------- rules
def test_reaching_the_goal_pays_one_and_terminates():
    env = FrozenLakeEnv()
    env.reset(seed=0, options={"map": ["SH", "FG"]})
    _, reward, terminated, _, info = env.step("<answer>down</answer>")
    assert reward == 0.0 and not terminated and info["position"] == [1, 0]
    _, reward, terminated, truncated, info = env.step("<answer>right</answer>")
    assert reward == 1.0 and terminated and not truncated and info["success"] is True
    with pytest.raises(envhub.errors.EpisodeOverError):
        env.step("<answer>up</answer>")


def test_falling_into_a_hole_ends_the_game_without_reward():
    env = FrozenLakeEnv()
    env.reset(seed=0, options={"map": ["SH", "FG"]})
    messages, reward, terminated, truncated, info = env.step("<answer>right</answer>")
    assert reward == 0.0 and terminated and not truncated
    assert info["success"] is False and info["tile"] == "H"
    assert "hole" in messages[-1]["content"]


def test_walking_off_the_edge_stays_in_place():
    env = FrozenLakeEnv()
    env.reset(seed=0, options={"map": OPEN_4})
    for move in ["up", "left"]:
        messages, reward, terminated, _, info = env.step(f"<answer>{move}</answer>")
        assert info["position"] == [0, 0] and reward == 0.0 and not terminated
        assert "stayed" in messages[-1]["content"]


def test_truncated_at_max_turns():
    env = envhub.make("games/frozen-lake-v0", max_turns=3)
    env.reset(seed=0, options={"map": OPEN_4})
    for turn in range(1, 4):
        _, _, terminated, truncated, info = env.step("<answer>up</answer>")
        assert not terminated and truncated == (turn == 3)
    assert env.done and info["success"] is False


def test_expert_avoids_holes_and_recomputes_from_the_current_cell():
    board = parse_map("S F F\nH H F\nG F F")
    assert shortest_path(board, (0, 0)) == ["right", "right", "down", "down", "left", "left"]
    env = FrozenLakeEnv(size=3)
    env.reset(seed=0, options={"map": board})
    env.step("<answer>right</answer>")
    assert env.expert_action() == "<answer>right</answer>"


# ---------------------------------------------------------------------------- slippery
def test_slippery_ice_slips_about_two_thirds_of_the_time_and_never_backwards():
    env = FrozenLakeEnv(slippery=True, max_turns=None)
    slips, moves = 0, 0
    for seed in range(40):
        env.reset(seed=seed, options={"map": ["SFFFF", "FFFFF", "FFFFF", "FFFFF", "FFFFG"]})
        for _ in range(10):
            messages, _, terminated, _, info = env.step("<answer>down</answer>")
            assert info["moved"] in ("down", "left", "right")
            slips += info["slipped"]
            moves += 1
            if info["slipped"]:
                assert "slipped" in messages[-1]["content"]
            if terminated:
                break
    assert 0.55 < slips / moves < 0.78


def test_non_slippery_ice_never_slips():
    env = envhub.make("games/frozen-lake-8x8-v0")
    env.reset(seed=1)
    for _ in range(10):
        _, _, terminated, truncated, info = env.step("<answer>right</answer>")
        assert info["slipped"] is False and info["moved"] == "right"
        if terminated or truncated:
            break


def test_slippery_prompt_warns_about_the_ice():
    text = envhub.make("games/frozen-lake-slippery-v0").reset(seed=0)[0][-1]["content"]
    assert "slippery" in text and "1/3" in text


# ---------------------------------------------------------------------------- actions
@pytest.mark.parametrize(
    "text",
    [
        "Let me think... I'll move <answer>Right</answer>",
        "<answer>R</answer>",
        "<answer>move right</answer>",
        "<answer>RIGHT!</answer>",
        "go right",
        "right",
    ],
)
def test_chatty_and_abbreviated_actions_are_understood(text):
    env = FrozenLakeEnv()
    env.reset(seed=0, options={"map": OPEN_4})
    _, reward, _, _, info = env.step(text)
    assert info["invalid_action"] is False and info["position"] == [0, 1] and reward == 0.0


@pytest.mark.parametrize(
    "text", ["<answer>jump</answer>", "", "hmm", "<answer>up, left</answer>", "y" * 5000]
)
def test_invalid_actions_are_penalised_and_explained(text):
    env = envhub.make("games/frozen-lake-v0")
    env.reset(seed=0)
    messages, reward, terminated, truncated, info = env.step(text)
    assert info["invalid_action"] is True and reward < 0 and not terminated and not truncated
    assert info["position"] == [0, 0] and info["turn"] == 1
    feedback = messages[-1]["content"]
    assert "up, down, left, right" in feedback and "<answer>" in feedback


def test_first_message_explains_the_legend():
    text = envhub.make("games/frozen-lake-v0").reset(seed=0)[0][-1]["content"]
    for needle in ["P you", "F frozen", "H hole", "G goal", "up, down, left, right", "<answer>"]:
        assert needle in text


def test_bad_maps_are_refused():
    for bad in [["SF", "F"], ["SX", "FG"], ["FF", "FG"], ["SS", "FG"]]:
        with pytest.raises(ValueError):
            parse_map(bad)
