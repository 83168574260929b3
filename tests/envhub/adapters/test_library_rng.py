"""TextArena and GEM draw from Python's (and NumPy's) global RNG; each env of theirs keeps its
own, so an episode follows its seed whatever else runs in the process: another env of the same
kind interleaved with it, the same in other threads, or the caller's own draws."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

import envhub

GAMES = {
    "textarena/2048-v0": ["[Up]", "[Left]", "[Down]", "[Right]"] * 4,
    "textarena/Minesweeper-small-v0": [f"[{r} {c}]" for r in range(5) for c in range(0, 5, 2)],
    "gem/game.Game2048-easy-v0": ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}"] * 4,
    "gem/game.Minesweeper-easy-v0": [
        f"\\boxed{{reveal {r} {c}}}" for r in range(5) for c in (1, 3)
    ],
}


def _needs(env_id: str) -> None:
    pytest.importorskip(env_id.split("/")[0], reason=f"needs the {env_id.split('/')[0]} extra")


def _play(env, seed: int, moves: list[str], between=lambda: None) -> list[str]:
    """The observations of one episode; ``between`` runs after the reset and each step."""
    seen = [env.reset(seed=seed)[0][-1]["content"]]
    between()
    for move in moves:
        observation, _, terminated, truncated, _ = env.step(move)
        seen.append(observation[-1]["content"])
        between()
        if terminated or truncated:
            break
    return seen


@pytest.mark.parametrize("env_id", sorted(GAMES))
def test_an_episode_is_the_same_with_another_env_of_its_kind_interleaved(env_id):
    _needs(env_id)
    moves = GAMES[env_id]
    alone = _play(envhub.make(env_id), 7, moves)
    other = envhub.make(env_id)
    other.reset(seed=8)
    other_moves = iter(moves * 10)

    def other_step() -> None:
        if other.step(next(other_moves))[2:4] != (False, False):
            other.reset(seed=8)

    assert _play(envhub.make(env_id), 7, moves, between=other_step) == alone


@pytest.mark.parametrize("env_id", sorted(GAMES))
def test_an_episode_is_the_same_when_envs_of_its_kind_play_in_other_threads(env_id):
    _needs(env_id)
    moves = GAMES[env_id]
    alone = _play(envhub.make(env_id), 7, moves)
    envs = [envhub.make(env_id) for _ in range(4)]
    barrier = threading.Barrier(len(envs), timeout=60)
    results: dict[int, list[str]] = {}

    def play(index: int) -> None:
        # each step of each thread waits for the others: the episodes interleave step by step
        met = []
        results[index] = _play(
            envs[index], 7 + index % 2, moves, between=lambda: met.append(barrier.wait())
        )
        for _ in range(len(moves) + 1 - len(met)):  # an episode that ended early keeps meeting
            barrier.wait()

    threads = [threading.Thread(target=play, args=(i,)) for i in range(len(envs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results[0] == alone and results[2] == alone


@pytest.mark.parametrize("env_id", sorted(GAMES))
def test_the_callers_random_streams_are_left_as_they_were(env_id):
    _needs(env_id)
    random.seed(1)
    np.random.seed(1)
    expected = (random.random(), float(np.random.random()))
    random.seed(1)
    np.random.seed(1)
    env = envhub.make(env_id)
    _play(env, 3, GAMES[env_id][:3])
    env.action_space.sample()
    env.close()
    assert (random.random(), float(np.random.random())) == expected


def test_gems_first_observation_shows_the_starting_board_and_the_prompt_to_move():
    _needs("gem/")
    sudoku = envhub.make("gem/game.Sudoku-easy-v0")
    first = sudoku.reset(seed=3)[0][-1]["content"]
    assert "current board layout" in first and "R1" in first
    guess = envhub.make("gem/game.GuessTheNumber-easy-v0")
    assert guess.reset(seed=3)[0][-1]["content"].rstrip().endswith("Enter your next guess.")


def test_an_env_entered_again_inside_another_keeps_its_stream() -> None:
    """A -> B -> A nested (allowed): every draw of A comes from A's one stream, in order."""
    import random

    from envhub.adapters.global_rng import GlobalRNG

    a, b = GlobalRNG(1), GlobalRNG(2)
    reference = random.Random(1)
    expected = [reference.random() for _ in range(3)]
    drawn = []
    with a.active():
        drawn.append(random.random())
        with b.active(), a.active():
            drawn.append(random.random())
    with a.active():
        drawn.append(random.random())
    assert drawn == expected
