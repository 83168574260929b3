"""2048: merge rules pinned by hand, spawns, rewards, endings, parsing and the expert."""

from __future__ import annotations

import math

import pytest

import envhub
from envhub.checker import check_env
from envs.games.game2048 import DIRECTIONS, Game2048Env, best_move, can_move, merge_line, slide

ENV_ID = "games/2048-v0"


def make(**kwargs) -> Game2048Env:
    return envhub.make(ENV_ID, **kwargs)


def tiles(board) -> list[int]:
    return sorted(value for row in board for value in row if value)


# ------------------------------------------------------------------ merge rules
@pytest.mark.parametrize(
    ("line", "expected", "gained"),
    [
        ([2, 2, 2, 2], [4, 4, 0, 0], 8),  # each tile merges at most once
        ([2, 2, 4, 0], [4, 4, 0, 0], 4),  # the new 4 does not merge again this move
        ([4, 0, 4, 8], [8, 8, 0, 0], 8),  # merges across a gap, then no chain with the 8
        ([2, 2, 2, 0], [4, 2, 0, 0], 4),  # the pair nearest the wall merges first
        ([4, 4, 8, 8], [8, 16, 0, 0], 24),
        ([8, 4, 2, 2], [8, 4, 4, 0], 4),
        ([2, 0, 0, 2], [4, 0, 0, 0], 4),
        ([0, 0, 0, 2], [2, 0, 0, 0], 0),
        ([2, 4, 8, 16], [2, 4, 8, 16], 0),
        ([0, 0, 0, 0], [0, 0, 0, 0], 0),
    ],
)
def test_merge_line(line, expected, gained):
    assert merge_line(line) == (expected, gained)


def test_slide_in_every_direction():
    board = ((2, 2, 0, 4), (0, 2, 0, 4), (2, 0, 0, 8), (2, 0, 0, 8))
    assert slide(board, "left") == (((4, 4, 0, 0), (2, 4, 0, 0), (2, 8, 0, 0), (2, 8, 0, 0)), 4)
    assert slide(board, "right") == (((0, 0, 4, 4), (0, 0, 2, 4), (0, 0, 2, 8), (0, 0, 2, 8)), 4)
    assert slide(board, "up") == (((4, 4, 0, 8), (2, 0, 0, 16), (0, 0, 0, 0), (0, 0, 0, 0)), 32)
    assert slide(board, "down") == (((0, 0, 0, 0), (0, 0, 0, 0), (2, 0, 0, 8), (4, 4, 0, 16)), 32)


def test_can_move():
    assert can_move(((2, 4), (4, 0)))
    assert can_move(((2, 2), (4, 8)))
    assert not can_move(((2, 4), (4, 2)))


# ------------------------------------------------------------------ the environment
def test_reset_places_two_tiles_and_shows_an_aligned_grid():
    env = make()
    messages, info = env.reset(seed=0)
    assert len(tiles(info["board"])) == 2 and set(tiles(info["board"])) <= {2, 4}
    text = messages[-1]["content"]
    grid = [line for line in text.splitlines() if line.strip() and set(line) <= set(" .0123456789")]
    assert len(grid) == 4 and len({len(line) for line in grid}) == 1
    assert "Target: 128" in text and "Score: 0" in text and "<answer>" in text


def test_spawned_tiles_are_mostly_twos():
    env = make()
    values = [v for seed in range(150) for v in tiles(env.reset(seed=seed)[1]["board"])]
    fours = values.count(4) / len(values)
    assert set(values) == {2, 4} and 0.03 < fours < 0.2


def test_move_merges_scores_and_spawns_one_tile():
    env = make()
    start = [[2, 2, 2, 2], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 4]]
    env.reset(seed=0, options={"board": start})
    messages, reward, terminated, truncated, info = env.step("<answer>left</answer>")
    board = info["board"]
    assert board[0] == [4, 4, 0, 0]
    # the best tile stays 4: merging pays only as far as it makes a larger best tile
    assert reward == 0.0 and info["merged"] == 8 and info["score"] == 8
    assert (terminated, truncated, info["moved"]) == (False, False, True)
    old = {(0, 0), (0, 1), (3, 0)}
    new = [(r, c) for r in range(4) for c in range(4) if board[r][c] and (r, c) not in old]
    assert len(new) == 1 and board[new[0][0]][new[0][1]] in (2, 4) and board[3][0] == 4
    text = messages[0]["content"]
    assert "merging tiles worth 8" in text and "Score: 8" in text


def test_move_that_changes_nothing_is_legal_but_wasted():
    env = make()
    start = [[2, 4, 0, 0], [8, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    env.reset(seed=0, options={"board": start})
    messages, reward, terminated, truncated, info = env.step("left")
    assert info["board"] == start and reward == 0.0 and info["invalid_action"] is False
    assert info["moved"] is False and "changes nothing" in messages[0]["content"]
    assert not terminated and not truncated and env.turn == 1


def test_reaching_the_target_wins():
    env = make()
    env.reset(seed=0, options={"board": [[64, 64, 0, 0], [0] * 4, [0] * 4, [2, 0, 0, 0]]})
    messages, reward, terminated, truncated, info = env.step("<answer>LEFT</answer>")
    assert (terminated, truncated, info["success"]) == (True, False, True)
    assert reward == pytest.approx(1 / 7 + 1.0) and info["max_tile"] == 128  # 64 -> 128, won
    assert "won" in messages[0]["content"]


def test_full_board_with_no_merges_is_a_loss():
    env = make(target=2048)
    start = [[0, 32, 64, 32], [8, 16, 8, 16], [16, 8, 16, 8], [8, 16, 8, 16]]
    env.reset(seed=0, options={"board": start})
    messages, reward, terminated, truncated, info = env.step("<answer>left</answer>")
    assert info["board"][0][:3] == [32, 64, 32] and info["board"][0][3] in (2, 4)
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert "game over" in messages[0]["content"]


@pytest.mark.parametrize(
    ("text", "direction"),
    [
        ("<answer>up</answer>", "up"),
        ("<answer>D</answer>", "down"),
        ("l", "left"),
        ("I'll go with <answer>Right</answer>", "right"),
        ("Let me think.\nslide left", "left"),  # no tag: the last line, filler words allowed
        ("<answer>UP!</answer>", "up"),
    ],
)
def test_actions_are_parsed(text, direction):
    env = make()
    env.reset(seed=3)
    _, _, _, _, info = env.step(text)
    assert info["invalid_action"] is False and info["direction"] == direction


@pytest.mark.parametrize(
    "text",
    [
        "<answer>diagonal</answer>",
        "<answer></answer>",
        "",
        "no idea",
        "<answer>x</answer>",
        "I give up",
    ],
)
def test_invalid_moves_give_feedback_and_change_nothing(text):
    env = make()
    _, start = env.reset(seed=4)
    messages, reward, terminated, truncated, info = env.step(text)
    assert info["invalid_action"] is True and reward < 0 and not terminated and not truncated
    assert info["board"] == start["board"]
    content = messages[0]["content"]
    assert (
        "Valid actions: up, down, left, right" in content
        or "no action" in content
        or "empty" in content
    )


def test_truncates_at_max_turns():
    env = make(max_turns=3)
    env.reset(seed=5)
    results = [env.step(move)[2:4] for move in ("left", "right", "left")]
    assert results == [(False, False), (False, False), (False, True)]
    with pytest.raises(envhub.errors.EpisodeOverError):
        env.step("up")


def test_board_option_is_checked():
    env = make()
    with pytest.raises(ValueError, match="power of two"):
        env.reset(seed=0, options={"board": [[3, 0, 0, 0]] * 4})
    with pytest.raises(ValueError, match="4 rows"):
        env.reset(seed=0, options={"board": [[2, 0], [0, 0]]})


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="power of two"):
        make(target=100)
    with pytest.raises(ValueError, match="size"):
        make(size=1)


def test_variants():
    small = envhub.make("games/2048-3x3-v0")
    _, info = small.reset(seed=0)
    assert len(info["board"]) == 3 and small.target == 64
    big = envhub.make("games/2048-256-v0")
    assert big.target == 256 and big.max_turns == 400


# ------------------------------------------------------------------ determinism and the expert
def run(env: Game2048Env, seed: int, moves: list[str]) -> list:
    trace = [env.reset(seed=seed)]
    for move in moves:
        if env.done:
            break
        trace.append(env.step(move))
    return trace


def test_same_seed_same_episode_different_seeds_differ():
    moves = ["left", "up", "right", "down"] * 5
    assert run(make(), 7, moves) == run(make(), 7, moves)
    starts = {str(make().reset(seed=seed)[1]["board"]) for seed in range(10)}
    assert len(starts) > 1


def test_expert_reaches_the_target():
    env = make()
    wins = 0
    for seed in range(20):
        env.reset(seed=seed)
        total = 0.0
        while not env.done:
            _, reward, _, _, info = env.step(env.expert_action())
            total += reward
        wins += info["success"] and info["turn"] <= 200
        assert total <= 2  # the shaping adds up to at most 1, plus 1 for the win
    assert wins >= 16


# ------------------------------------------------------------------ the return points at the win
def avoider(env: Game2048Env) -> str:
    """A player that makes the target tile only when no other move is legal: it keeps merging
    smaller tiles (largest merge first) and keeps a non-winning move in reserve for the next turn
    for as long as the game allows."""
    board, target = env.board, env.target
    legal = [(d, after) for d in DIRECTIONS if (after := slide(board, d)[0]) != board]
    safe = [(d, after) for d, after in legal if max(map(max, after)) < target]

    def room(after) -> int:  # non-winning moves left after this one (spawns ignored)
        return sum(
            1
            for d in DIRECTIONS
            if (nxt := slide(after, d)[0]) != after and max(map(max, nxt)) < target
        )

    if not safe:
        return best_move(board) or "up"
    return max(safe, key=lambda move: (min(room(move[1]), 2), slide(board, move[0])[1]))[0]


def play(env: Game2048Env, seed: int, policy) -> tuple[float, bool, int]:
    """One episode: its return, whether it won, and the largest tile it started with."""
    _, info = env.reset(seed=seed)
    start, total = info["max_tile"], 0.0
    while not env.done:
        _, reward, _, _, info = env.step(policy(env))
        total += reward
    return total, info["success"], start


def test_winning_returns_more_than_any_play_that_does_not_win():
    """Putting off the last merge to keep merging smaller tiles must not pay: RL maximises the
    return, so the return has to rank a win above every episode that does not win."""
    env = make()
    wins, losses, starts = [], [], []
    for seed in range(6):
        for policy in (lambda e: e.expert_action(), avoider):
            total, won, start = play(env, seed, policy)
            (wins if won else losses).append(total)
            starts += [start] if won else []
    assert wins and losses
    assert min(wins) > 1 > max(losses), (wins, losses)
    # a win's shaping adds up to the progress from the first board's best tile, plus the bonus
    assert wins == pytest.approx([2 - math.log2(start) / math.log2(128) for start in starts])


def test_a_move_pays_for_the_larger_best_tile_not_for_merging():
    env = make()
    env.reset(seed=0, options={"board": [[8, 8, 0, 0], [2, 2, 0, 0], [0] * 4, [0] * 4]})
    _, reward, _, _, info = env.step("left")  # best tile 8 -> 16
    assert info["merged"] == 20 and reward == pytest.approx(1 / 7)
    _, reward, _, _, info = env.step("right")  # 16 stays the best tile
    assert info["max_tile"] == 16 and reward == 0.0


def test_envhub_check_passes():
    check_env(make(), factory=make)  # raises EnvCheckError listing what failed (the expert wins)
