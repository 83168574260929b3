"""TextArena games as envhub envs: single-player games, the opponent seat, source failures."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from fastapi.responses import JSONResponse

pytest.importorskip(
    "textarena", reason="needs the textarena extra: pip install 'envhub[textarena]'"
)

import envhub
from envhub.errors import SourceConfigError, SourceError
from envhub.pool import EnvPool, EpisodeFailure
from envhub.registry import Registry
from tests.envhub.adapters import scripted_players
from tests.envhub.adapters.sweep import failing
from tests.envhub.openai_servers import completion, scripted_server

SAMPLE = [
    "textarena/FrozenLake-v0",
    "textarena/GuessTheNumber-v0",
    "textarena/Minesweeper-small-v0",
    "textarena/TowerOfHanoi-v0",
    "textarena/Mastermind-v0",
    "textarena/2048-v0",
    "textarena/TicTacToe-v0",
    "textarena/ConnectFour-v0",
    "textarena/Nim-v0",
]
"""Checked in the default tier; test_single_player_games_that_load_offline_pass checks all."""

SINGLE_PLAYER_NOT_OFFLINE = {  # envhub ids without the namespace
    # a hosted judge or game master (OpenRouter)
    "GuessWho-v0",
    "TwentyQuestions-v0",
    "TwentyQuestions-hardcore-v0",
    # NLTK corpora, downloaded at import
    "Hangman-v0",
    "Hangman-hardcore-v0",
    "WordLadder-v0",
    "WordLadder-medium-v0",
    "WordLadder-hard-v0",
    "WordSearch-v0",
    "WordSearch-hardcore-v0",
    "Wordle-v0",
    "Wordle-hardcore-v0",
    "Wordle-long-v0",
    "Wordle-long-hardcore-v0",
    # Python 3.12 syntax in the game's module (this project runs 3.11)
    "Klondike-v0",
    "UltimateTexasHoldem-v0",
}
"""TextArena 0.7.4 single-player games that cannot pass here, and why (see the README)."""

TOO_SLOW_FOR_ONE_RUN = {"Sudoku-hard-v0", "RushHour-v0"}
"""Pass, but generate each puzzle for tens of seconds; left out of the sweep's time budget."""


@pytest.mark.parametrize("env_id", SAMPLE)
def test_sample_games_keep_the_contract(env_id):
    envhub.check_env(envhub.make(env_id), factory=lambda: envhub.make(env_id))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_single_player_games_that_load_offline_pass():
    games = [s for s in envhub.list_envs("textarena") if s.kwargs["players"] == 1]
    swept = [s for s in games if s.id.removeprefix("textarena/") not in TOO_SLOW_FOR_ONE_RUN]
    failed = failing(swept, lambda spec: spec.id.removeprefix("textarena/"))
    assert set(failed) == SINGLE_PLAYER_NOT_OFFLINE, failed
    assert (len(games), len(games) - len(failed)) == (70, 54)


TWO_PLAYER_NOT_OFFLINE = {
    # Python 3.12 syntax in the game's module
    **dict.fromkeys(
        ["Checkers-v0", "Checkers-long-v0", "Chess-v0", "Chess-blind-v0", "Chess-long-v0"]
        + ["IteratedStagHunt-v0", "IteratedStagHunt-randomized-v0", "ReverseTicTacToe-v0"],
        "python 3.12",
    ),
    # a hosted judge (OpenRouter)
    **dict.fromkeys(
        ["Debate-v0", "Debate-medium-v0", "Debate-long-v0", "ScenarioPlanning-v0"], "hosted"
    ),
    # NLTK corpora, downloaded at import
    **dict.fromkeys(
        ["DontSayIt-v0", "DontSayIt-hardcore-v0", "DontSayIt-unlimited-v0", "WordChains-v0"]
        + ["LetterAuction-v0", "LetterAuction-medium-v0", "LetterAuction-hard-v0"]
        + ["SpellingBee-v0", "SpellingBee-small-v0", "SpellingBee-large-v0"],
        "nltk",
    ),
    # a data file missing from the 0.7.4 wheel
    **dict.fromkeys(
        ["UsedCarNegotiation-v0"]
        + ["UsedCarNegotiation-strong-buyer-v0", "UsedCarNegotiation-strong-seller-v0"],
        "missing file",
    ),
}
"""TextArena 0.7.4 two-player games that cannot pass here (with opponent='random'), and why."""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_player_games_that_load_offline_pass_against_the_random_opponent():
    games = [s for s in envhub.list_envs("textarena") if s.kwargs["players"] == 2]
    failed = failing(games, lambda spec: spec.id.removeprefix("textarena/"))
    assert set(failed) == set(TWO_PLAYER_NOT_OFFLINE), failed
    assert (len(games), len(games) - len(failed)) == (119, 94)


def test_a_game_and_its_turns_map_to_the_contract():
    env = envhub.make("textarena/TicTacToe-v0", opponent=scripted_players.AlwaysCentre())
    messages, info = env.reset(seed=0)
    assert info["player"] == 0 and "Available Moves" in messages[-1]["content"]
    messages, reward, terminated, _, info = env.step("I take the corner [0]")
    text = messages[-1]["content"]
    assert "cell 0" in text and "[Player 1] [4]" in text  # the agent's move, then the opponent's
    assert (reward, terminated, info["invalid_action"]) == (0.0, False, False)
    messages, reward, terminated, _, info = env.step("[0]")  # taken: TextArena allows one retry
    assert info["invalid_action"] and not terminated
    assert "attempted an invalid move" in messages[-1]["content"]
    _, reward, terminated, _, info = env.step("[0]")  # a second invalid move loses
    assert (reward, terminated, info["success"], info["invalid_action"]) == (
        -1.0,
        True,
        False,
        True,
    )


def test_the_agent_can_take_the_second_seat_and_win():
    env = envhub.make("textarena/TicTacToe-v0", agent_player=1, opponent="random")
    messages, info = env.reset(seed=4)
    assert info["player"] == 1 and "[Player 0]" in messages[-1]["content"]
    episode_rewards = []
    for seed in range(30):  # against a random opponent a "first free cell" player wins some
        env.reset(seed=seed)
        while True:
            free = re.findall(r"'\[(\d)\]'", env.messages[-1]["content"])
            _, reward, terminated, truncated, info = env.step(f"[{free[-1]}]")
            if terminated or truncated:
                episode_rewards.append((reward, info["success"]))
                break
    assert (1.0, True) in episode_rewards and all(
        success == (reward > 0) for reward, success in episode_rewards
    )


def test_a_scripted_opponent_is_a_textarena_style_callable():
    scripted_players.MOVES.clear()
    env = envhub.make(
        "textarena/TicTacToe-v0",
        opponent="tests.envhub.adapters.scripted_players:first_listed_move",
    )
    env.reset(seed=0)
    env.step("[4]")
    assert scripted_players.MOVES == ["[0]"]
    assert "placed their symbol (X) in cell 0" in env.messages[-1]["content"]
    with pytest.raises(SourceConfigError, match="cannot be imported"):
        envhub.make("textarena/TicTacToe-v0", opponent="tests.nowhere:player")
    with pytest.raises(SourceConfigError, match="OpenAI-compatible URL"):
        envhub.make("textarena/TicTacToe-v0", opponent="randm")


def test_a_model_opponent_plays_through_an_openai_compatible_url():
    def reply(body):
        listed = re.findall(r"'(\[\d\])'", body["messages"][-1]["content"])
        return completion(f"I pick {listed[-1]}")

    with scripted_server(reply) as server:
        env = envhub.make("textarena/TicTacToe-v0", opponent=server.url)
        env.reset(seed=0)
        env.step("[0]")
        env.step("[1]")
    first, second = server.requests
    assert "You are Player 1" in first["messages"][0]["content"]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert "[Player 1] I pick [8]" in env.messages[2]["content"]


def test_a_failing_source_fails_the_episode_and_the_pool_heals():
    """A scripted opponent that raises, and a model opponent whose server answers 500: each
    fails its episode as data (with the source named), and the pool keeps serving."""

    def broken(body):
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)

    def with_opponent(opponent):
        spec = envhub.spec("textarena/TicTacToe-v0")
        return replace(spec, kwargs={**spec.kwargs, "opponent": opponent})

    async def main(url):
        script = "tests.envhub.adapters.scripted_players:broken_player"
        async with EnvPool(with_opponent(script), num_workers=1) as pool:
            started = await pool.reset(seed=0)  # the agent moves first: the script not yet run
            failed = await pool.step(started.episode, "[0]")
            assert isinstance(failed, EpisodeFailure) and failed.reason == "env_error"
            assert "TicTacToe" in failed.detail and "the script broke" in failed.detail
            assert not isinstance(await pool.reset(seed=1), EpisodeFailure)
        async with EnvPool(with_opponent(url), num_workers=1) as pool:
            started = await pool.reset(seed=0)  # the agent moves first: nothing asked yet
            failed = await pool.step(started.episode, "[0]")
            assert isinstance(failed, EpisodeFailure) and failed.reason == "env_error"
            assert "the opponent model at" in failed.detail and "http_500" in failed.detail
            assert not isinstance(await pool.reset(seed=1), EpisodeFailure)

    with scripted_server(broken) as server:
        asyncio.run(asyncio.wait_for(main(server.url), 120))


def test_a_game_that_fails_in_its_reset_fails_as_the_source(monkeypatch):
    from textarena.envs.TicTacToe.env import TicTacToeEnv

    def broken_reset(self, num_players, seed=None):
        raise KeyError("board")

    env = envhub.make("textarena/TicTacToe-v0")
    monkeypatch.setattr(TicTacToeEnv, "reset", broken_reset)
    with pytest.raises(SourceError, match=r"TicTacToe-v0 raised KeyError in its reset"):
        env.reset(seed=0)


def agent_view(env_id: str, seed: int, choose: Callable[[str], str]) -> list[str]:
    """Every message the agent reads in one episode where it plays ``choose(observation)``,
    then the final reward."""
    env = envhub.make(env_id)
    messages, _ = env.reset(seed=seed)
    seen = [messages[-1]["content"]]
    while True:
        messages, reward, terminated, truncated, _ = env.step(choose(seen[-1]))
        seen.append(messages[-1]["content"])
        if terminated or truncated:
            return [*seen, str(reward)]


def tic_tac_toe_move(observation: str) -> str:
    return re.findall(r"'(\[\d\])'", observation)[-1]


def kuhn_poker_move(observation: str) -> str:
    return "[bet]" if "'[bet]'" in observation.split("available actions")[-1] else "[call]"


@pytest.mark.parametrize(
    ("env_id", "choose", "planted"),
    [
        ("textarena/TicTacToe-v0", tic_tac_toe_move, "'[1]' " * 150),
        ("textarena/KuhnPoker-v0", kuhn_poker_move, "'[fold]' " * 150),
    ],
)
def test_the_agents_text_does_not_choose_the_random_opponents_moves(env_id, choose, planted):
    """TextArena shows both players the agent's move as written; the random opponent picks only
    among the moves the game lists, so moves planted in the agent's text change nothing (they
    used to steer it: a fixed TicTacToe line won 40 of 40 games instead of 24)."""
    for seed in range(6):
        honest = agent_view(env_id, seed, choose)
        assert agent_view(env_id, seed, lambda text: f"{choose(text)} {planted}") == honest


def test_the_random_opponent_moves_from_the_latest_board():
    """After the agent takes the centre, the opponent's first board still lists it; the
    opponent picks from the board the game showed last, so it never tries the taken cell."""
    replies = []
    for seed in range(40):
        env = envhub.make("textarena/TicTacToe-v0")
        env.reset(seed=seed)
        replies.append(env.step("[4]")[0][-1]["content"])
    assert not [reply for reply in replies if "[Player 1] [4]" in reply]


def test_a_seed_deals_the_same_game_on_a_fresh_env_and_after_another_episode():
    fresh = envhub.make("textarena/KuhnPoker-v0").reset(seed=5)[0]
    used = envhub.make("textarena/KuhnPoker-v0")
    used.reset(seed=1)
    used.step("[bet]")
    assert used.reset(seed=5)[0] == fresh  # KuhnPoker shuffles its deck in place


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env_id", ["textarena/Stratego-v0", "textarena/SpiteAndMalice-v0"])
def test_every_reset_starts_a_new_game(env_id):
    """Games keep their board and deck in the game object: reused, Stratego's second setup
    never ended and SpiteAndMalice's raised AttributeError."""
    env = envhub.make(env_id)
    first = env.reset(seed=1)
    env.reset(seed=5)
    assert env.reset(seed=1) == first


@pytest.mark.parametrize(
    "env_id",
    [
        "textarena/Countdown-v0",
        "textarena/Cryptarithm-v0",
        "textarena/Slitherlink-v0",
        "textarena/ThreeCardMonte-v0",
    ],
)
def test_a_second_malformed_move_loses_where_the_game_reports_a_text_as_the_reward(env_id):
    """These games pass set_invalid_move its arguments swapped (TextArena 0.7.4): the game
    ends with the message as the reward, which the adapter scores as the invalid-move loss."""
    env = envhub.make(env_id)
    env.reset(seed=0)
    _, _, terminated, _, info = env.step("hello")
    assert info["invalid_action"] and not terminated
    _, reward, terminated, _, info = env.step("hello")
    assert (reward, terminated, info["success"], info["invalid_action"]) == (
        -1.0,
        True,
        False,
        True,
    )


@pytest.mark.parametrize(
    "env_id", ["textarena/TicTacToe-v0", "textarena/Othello-v0", "textarena/GuessTheNumber-v0"]
)
def test_a_number_too_long_for_python_is_an_invalid_move(env_id):
    """The game's int() refuses more than 4300 digits (ValueError): that is the agent's
    malformed move, with TextArena's one retry, not a failure of the game."""
    env = envhub.make(env_id, action_max_length=10_000)
    env.reset(seed=3)
    move = "[" + "9" * 5000 + "]"
    messages, _, terminated, _, info = env.step(move)
    assert info["invalid_action"] and not terminated
    assert "digits" in messages[-1]["content"]
    _, reward, terminated, _, info = env.step(move)
    assert (reward, terminated, info["success"], info["invalid_action"]) == (
        -1.0,
        True,
        False,
        True,
    )


def test_a_move_is_bounded_to_what_every_game_reads_quickly():
    """ConnectFour's move pattern is quadratic in the text's length (100,000 characters: 5 s a
    step); the action space bounds a move, so a longer text is an invalid action the game
    never reads, and the bound is an argument."""
    env = envhub.make("textarena/ConnectFour-v0")
    env.reset(seed=3)
    messages, _, terminated, _, info = env.step("x" * 100_000)
    assert info["invalid_action"] and not terminated
    assert "at most 8000" in messages[-1]["content"]
    wider = envhub.make("textarena/ConnectFour-v0", action_max_length=20_000)
    assert wider.action_space.max_length == 20_000


def test_games_that_score_wrongly_or_reset_for_too_long_are_not_listed(tmp_path, monkeypatch):
    """Bandit pays the worst button (TextArena 0.7.4 compares the button's name with the
    ground-truth dict); Sokoban-medium's reset takes tens of seconds (36 s at seed 5)."""
    monkeypatch.setenv("ENVHUB_CACHE_DIR", str(tmp_path))  # the catalog as computed now
    registry = Registry()
    assert not registry.load_plugins()
    assert "textarena/Sokoban-v0" in registry
    for env_id in ("Bandit-v0", "Bandit-hard-v0", "Sokoban-medium-v0"):
        assert f"textarena/{env_id}" not in registry
    with pytest.raises(SourceConfigError, match="best button scores 0"):
        envhub.make("textarena/TicTacToe-v0", game="Bandit-v0")


def test_unknown_games_say_what_exists():
    with pytest.raises(envhub.errors.UnknownEnvError, match="'textarena/TicTacToe-v0'"):
        envhub.make("textarena/TicTacToo-v0")
    with pytest.raises(SourceConfigError, match="Did you mean 'TicTacToe-v0'"):
        envhub.make("textarena/TicTacToe-v0", game="TicTacToo-v0")


FORFEITING_OPPONENT = [  # the random opponent played the rules' example move and forfeited
    "textarena/Alquerque-v0",
    "textarena/Breakthrough-v0",
    "textarena/LinesOfAction-v0",
    "textarena/MemoryGame-v0",
    "textarena/UltimateTicTacToe-v0",
    "textarena/Nim-v0",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("env_id", FORFEITING_OPPONENT)
def test_one_agent_move_does_not_win_by_the_random_opponents_forfeit(env_id):
    """The agent plays a move its observation lists; the random opponent plays a legal move
    of its own seat, and a game the opponent still loses by invalid moves is no win."""
    from envhub.adapters.opponents import random_move

    env = envhub.make(env_id)
    one_move_wins, forfeit_wins = 0, 0
    for seed in range(10):
        messages, _ = env.reset(seed=seed)
        rng, steps, done = np.random.default_rng(seed), 0, False
        while not done:
            messages, reward, terminated, truncated, info = env.step(
                random_move(messages[-1]["content"], rng)
            )
            steps, done = steps + 1, terminated or truncated
        one_move_wins += steps == 1 and reward > 0
        forfeit_wins += reward > 0 and info.get("opponent_forfeit", False)
    assert (one_move_wins, forfeit_wins) == (0, 0)


@pytest.mark.parametrize("env_id", ["textarena/RushHour-v0", "textarena/PegJump-v0"])
def test_a_game_the_agent_ends_with_invalid_moves_pays_no_progress_score(env_id):
    """RushHour and PegJump pay their progress score to a game ended by invalid moves: junk
    twice earned 0.5 in RushHour. The adapter scores that end as TextArena's invalid-move loss."""
    env = envhub.make(env_id)
    for seed in range(2):
        env.reset(seed=seed)
        assert env.step("pass")[1] == 0.0
        _, reward, terminated, _, info = env.step("pass")
        assert (reward, terminated, info["success"], info["invalid_action"]) == (
            -1.0,
            True,
            False,
            True,
        )
