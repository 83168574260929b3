"""TextArena games as envhub envs: single-player games, the opponent seat, source failures."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

import pytest
from fastapi.responses import JSONResponse

pytest.importorskip(
    "textarena", reason="needs the textarena extra: pip install 'envhub[textarena]'"
)

import envhub
from envhub.errors import SourceConfigError
from envhub.pool import EnvPool, EpisodeFailure
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
    # the game reports a text as the final reward after a malformed move
    "Countdown-v0",
    "Cryptarithm-v0",
    "Slitherlink-v0",
    "ThreeCardMonte-v0",
}
"""TextArena 0.7.4 single-player games that cannot pass here, and why (see the README)."""

TOO_SLOW_FOR_ONE_RUN = {"Sokoban-medium-v0", "Sudoku-hard-v0", "RushHour-v0"}
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
    assert (len(games), len(games) - len(failed)) == (73, 53)


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
    # deals cards before seeding, so a reset seed does not fix the episode
    **dict.fromkeys(
        ["KuhnPoker-v0", "KuhnPoker-short-v0", "KuhnPoker-medium-v0"]
        + ["KuhnPoker-long-v0", "KuhnPoker-extreme-v0"],
        "unseeded",
    ),
    "SpiteAndMalice-v0": "AttributeError in its reset",
}
"""TextArena 0.7.4 two-player games that cannot pass here (with opponent='random'), and why."""

HANGS = {"Stratego-v0"}
"""Its random setup does not finish (left out of the sweep)."""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_player_games_that_load_offline_pass_against_the_random_opponent():
    games = [s for s in envhub.list_envs("textarena") if s.kwargs["players"] == 2]
    swept = [s for s in games if s.name + f"-v{s.version}" not in HANGS]
    failed = failing(swept, lambda spec: spec.id.removeprefix("textarena/"))
    assert set(failed) == set(TWO_PLAYER_NOT_OFFLINE), failed
    assert (len(games), len(games) - len(failed) - len(HANGS)) == (119, 87)


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
    """A game that raises on a malformed move, and a model opponent whose server answers 500:
    each fails its episode as data (with the source named), and the pool keeps serving."""

    def broken(body):
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)

    async def main(url):
        async with EnvPool("textarena/ThreeCardMonte-v0", num_workers=1) as pool:
            started = await pool.reset(seed=0)
            await pool.step(started.episode, "")  # invalid: one retry allowed
            failed = await pool.step(started.episode, "   ")
            assert isinstance(failed, EpisodeFailure) and failed.reason == "env_error"
            assert "ThreeCardMonte" in failed.detail and "not a number" in failed.detail
            assert not isinstance(await pool.reset(seed=1), EpisodeFailure)
        spec = envhub.spec("textarena/TicTacToe-v0")
        spec = replace(spec, kwargs={**spec.kwargs, "opponent": url})
        async with EnvPool(spec, num_workers=1) as pool:
            started = await pool.reset(seed=0)  # the agent moves first: nothing asked yet
            failed = await pool.step(started.episode, "[0]")
            assert isinstance(failed, EpisodeFailure) and failed.reason == "env_error"
            assert "the opponent model at" in failed.detail and "http_500" in failed.detail
            assert not isinstance(await pool.reset(seed=1), EpisodeFailure)

    with scripted_server(broken) as server:
        asyncio.run(asyncio.wait_for(main(server.url), 120))


def test_unknown_games_say_what_exists():
    with pytest.raises(envhub.errors.UnknownEnvError, match="'textarena/TicTacToe-v0'"):
        envhub.make("textarena/TicTacToo-v0")
    with pytest.raises(SourceConfigError, match="Did you mean 'TicTacToe-v0'"):
        envhub.make("textarena/TicTacToe-v0", game="TicTacToo-v0")
