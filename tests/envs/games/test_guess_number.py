"""Guess the number: hints, invalid actions, truncation, variants and the binary-search expert."""

from __future__ import annotations

import pytest

import envhub
from envs.games.guess_number import GuessNumberEnv

ENV_ID = "games/guess-number-v0"


def make(env_id: str = ENV_ID, **kwargs) -> GuessNumberEnv:
    return envhub.make(env_id, **kwargs)


def solve(env: GuessNumberEnv, seed: int) -> tuple[int, dict, list]:
    """Play a seed with the expert; return its last guess (the secret if it won), info, trace."""
    trace: list = [env.reset(seed=seed)]
    guess = -1
    while not env.done:
        action = env.expert_action()
        guess = int(action.removeprefix("<answer>").removesuffix("</answer>"))
        trace.append(env.step(action))
    return guess, trace[-1][4], trace


def test_expert_always_wins_within_ten_turns():
    env = make()
    for seed in range(50):
        secret, info, _ = solve(env, seed)
        assert info["success"] and info["turn"] <= 10, seed
        assert env.low <= secret <= env.high


def test_hints_point_at_the_secret():
    env = make()
    secret, _, _ = solve(env, seed=3)
    env.reset(seed=3)
    guesses = [g for g in (1, secret - 7, secret - 1, secret + 1, secret + 9, 100) if 1 <= g <= 100]
    for guess in guesses:
        if guess == secret:
            continue
        messages, reward, terminated, _, info = env.step(f"<answer>{guess}</answer>")
        expected = "higher" if guess < secret else "lower"
        assert expected in messages[0]["content"] and f"{guess} is wrong" in messages[0]["content"]
        assert (reward, terminated, info["guess"]) == (0.0, False, guess)
        if env.done:
            break
    env.reset(seed=3)
    messages, reward, terminated, truncated, info = env.step(f"I'm sure: <answer>{secret}</answer>")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert f"The number was {secret}" in messages[0]["content"]


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("<answer>0</answer>", "outside the range 1..100"),
        ("<answer>101</answer>", "outside the range 1..100"),
        ("<answer>-5</answer>", "outside the range 1..100"),
        ("<answer>fifty</answer>", "is not a number"),
        ("I am not sure.", "is not a number"),
        ("<answer></answer>", "no action"),
        ("", "empty"),
        ("<answer>" + "9" * 2000 + "</answer>", "too long"),
        ("<answer>½</answer>", "is not a number"),
    ],
)
def test_invalid_actions_give_feedback_and_never_raise(text, phrase):
    env = make()
    env.reset(seed=0)
    messages, reward, terminated, truncated, info = env.step(text)
    assert info["invalid_action"] is True and reward == pytest.approx(-0.1)
    assert not terminated and not truncated and not info["success"]
    assert phrase in messages[0]["content"]


def test_chatty_number_is_parsed():
    env = make()
    env.reset(seed=0)
    _, _, _, _, info = env.step("Between 40 and 60 I'd pick... <answer>guess: 50</answer>")
    assert info["invalid_action"] is False and info.get("guess", 50) == 50


def test_out_of_guesses_ends_the_game_as_lost():
    env = make()
    env.reset(seed=1)
    for turn in range(1, 11):
        _, _, terminated, truncated, info = env.step("no idea")
        # the guess budget is a rule
        assert terminated is (turn == 10) and truncated is False and info["turn"] == turn
    assert info["success"] is False
    with pytest.raises(envhub.errors.EpisodeOverError):
        env.step("<answer>50</answer>")
    assert make(max_turns=3).max_turns == 3


def test_variants_change_the_range():
    easy, hard = make("games/guess-number-easy-v0"), make("games/guess-number-hard-v0")
    assert (easy.low, easy.high, easy.max_turns) == (1, 20, 10)
    assert (hard.low, hard.high, hard.max_turns) == (1, 1000, 12)
    assert "between 1 and 20" in easy.reset(seed=0)[0][-1]["content"]
    assert "between 1 and 1000" in hard.reset(seed=0)[0][-1]["content"]
    assert "outside the range 1..20" in easy.step("<answer>21</answer>")[0][0]["content"]
    assert hard.step("<answer>999</answer>")[4]["invalid_action"] is False
    for seed in range(10):
        _, info, _ = solve(hard, seed)
        assert info["success"] and info["turn"] <= 10
        secret, info, _ = solve(easy, seed)
        assert info["success"] and 1 <= secret <= 20


def test_bad_range_is_refused():
    with pytest.raises(ValueError, match="low < high"):
        make(low=5, high=5)


def test_same_seed_same_episode_different_seeds_differ():
    assert solve(make(), 42)[2] == solve(make(), 42)[2]
    secrets = {solve(make(), seed)[0] for seed in range(10)}
    assert len(secrets) > 1
