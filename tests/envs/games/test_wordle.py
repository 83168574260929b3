"""Wordle: the word list, hand-checked feedback patterns, parsing, episodes and the expert."""

from __future__ import annotations

import pytest

import envhub
from envs.games.wordle import WordleEnv, best_guess, consistent_words, score_guess
from envs.games.words import WORDS

ENV_ID = "games/wordle-v0"


def make(**kwargs) -> WordleEnv:
    return envhub.make(ENV_ID, **kwargs)


def play(env: WordleEnv, seed: int, word: str | None = None) -> tuple[list, dict]:
    """Reset and let the expert play to the end; return the transcript and final info."""
    options = {"word": word} if word else None
    messages, info = env.reset(seed=seed, options=options)
    transcript = [messages]
    while not env.done:
        messages, reward, terminated, truncated, info = env.step(env.expert_action())
        transcript.append((messages, reward, terminated, truncated))
    return transcript, info


# ------------------------------------------------------------------ the word list
def test_word_list_is_clean():
    assert len(WORDS) >= 300
    assert len(set(WORDS)) == len(WORDS), "duplicate words"
    for word in WORDS:
        assert len(word) == 5 and word.isascii() and word.isalpha() and word.islower(), word


# ------------------------------------------------------------------ feedback, pinned by hand
@pytest.mark.parametrize(
    ("secret", "guess", "pattern"),
    [
        ("crane", "crane", "GGGGG"),
        ("crane", "react", "YYGY_"),  # a green; r, e, c each in another spot; no t
        ("abbey", "babes", "YYGG_"),  # greens b@2, e@3; one b and the a left for yellows
        ("crane", "eerie", "__Y_G"),  # the final e is green, so the other two e's are grey
        ("abbey", "bobby", "Y_G_G"),  # one b left unmatched: only the first extra b is yellow
        ("llama", "hello", "__YY_"),  # two l's in the secret, both guessed l's yellow
        ("geese", "eerie", "YG__G"),  # three e's: two green, one yellow
        ("eerie", "geese", "_GY_G"),  # three e's in the secret, two green, one yellow
        ("speed", "abide", "___YY"),
    ],
)
def test_score_guess_duplicate_letters(secret, guess, pattern):
    assert score_guess(secret, guess) == pattern


def test_consistent_words_keeps_the_secret():
    for secret in WORDS[::37]:
        pattern = score_guess(secret, "arise")
        assert secret in consistent_words(WORDS, "arise", pattern)


# ------------------------------------------------------------------ episodes
def test_reset_prompt_and_info():
    env = make()
    messages, info = env.reset(seed=0)
    assert messages[-1]["role"] == "user"
    assert "5-letter" in messages[-1]["content"] and "<answer>" in messages[-1]["content"]
    assert info["guesses_left"] == 6 and info["success"] is False and "answer" not in info


def test_feedback_observation_and_info():
    env = make()
    env.reset(seed=0, options={"word": "crane"})
    messages, reward, terminated, truncated, info = env.step("<answer>eerie</answer>")
    text = messages[0]["content"]
    assert text.splitlines()[0] == "EERIE -> _ _ Y _ G"
    assert "G = right letter" in text and "Y = " in text
    # e is in the word (green) even though two e's were grey: never listed as absent.
    assert "Letters not in the word: I" in text
    assert info["pattern"] == "__Y_G" and info["guess"] == "eerie" and info["guesses_left"] == 5
    assert (reward, terminated, truncated, info["invalid_action"]) == (0.0, False, False, False)


def test_solving_gives_reward_and_success():
    env = make()
    env.reset(seed=1, options={"word": "abbey"})
    env.step("<answer>babes</answer>")
    messages, reward, terminated, truncated, info = env.step("I'll go with <answer>ABBEY</answer>")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert "Solved" in messages[0]["content"] and info["pattern"] == "GGGGG"


@pytest.mark.parametrize(
    ("text", "word"),
    [
        ("I'll go with <answer>crane</answer>", "crane"),
        ("Thinking... <answer> CRANE </answer>", "crane"),
        ("My guess is crane.", "crane"),  # no tag: the last word of the last line
        ("<answer>```\nslate\n```</answer>", "slate"),
    ],
)
def test_chatty_actions_are_parsed(text, word):
    env = make()
    env.reset(seed=2)
    _, _, _, _, info = env.step(text)
    assert info["invalid_action"] is False and info["guess"] == word


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("<answer>cranes</answer>", "has 6 letters, not 5"),
        ("<answer>cat</answer>", "has 3 letters, not 5"),
        ("<answer>cr4ne</answer>", "use only the letters a-z"),
        ("<answer>12345</answer>", "use only the letters a-z"),
        ("<answer>crâne</answer>", "use only the letters a-z"),
        ("<answer></answer>", "no action"),
        ("<answer>...</answer>", "no word"),
        ("", "empty"),
    ],
)
def test_invalid_guesses_give_feedback(text, phrase):
    env = make()
    env.reset(seed=3)
    messages, reward, terminated, truncated, info = env.step(text)
    assert info["invalid_action"] is True and reward < 0 and not terminated and not truncated
    assert phrase in messages[0]["content"]
    assert "5 guesses left" in messages[0]["content"] and info["guesses_left"] == 5


def test_require_known_word():
    env = make(require_known_word=True)
    env.reset(seed=4, options={"word": "crane"})
    messages, _, _, _, info = env.step("<answer>zzzzz</answer>")
    assert info["invalid_action"] is True and "not in my word list" in messages[0]["content"]
    _, _, _, _, info = env.step(f"<answer>{WORDS[0]}</answer>")
    assert info["invalid_action"] is False
    # Without the flag any five letters count as a guess.
    loose = make()
    loose.reset(seed=4)
    assert loose.step("<answer>zzzzz</answer>")[4]["invalid_action"] is False


def test_out_of_guesses_is_a_lost_game_that_reveals_the_word():
    env = make()
    env.reset(seed=5, options={"word": "crane"})
    for turn in range(1, 7):
        text = "<answer>zzzzz</answer>" if turn % 2 else "oops"  # wrong and invalid both count
        messages, _, terminated, truncated, info = env.step(text)
        # six guesses is the game's rule, not a time limit
        assert terminated is (turn == 6) and truncated is False
        assert ("the word was CRANE" in messages[0]["content"]) is (turn == 6)
    assert info["answer"] == "crane" and info["success"] is False and info["guesses_left"] == 0
    with pytest.raises(envhub.errors.EpisodeOverError):
        env.step("<answer>crane</answer>")


def test_reset_word_option_is_checked():
    env = make()
    with pytest.raises(ValueError, match="5 letters"):
        env.reset(seed=0, options={"word": "toolong"})
    env.reset(seed=0, options={"word": "QUBIT"})  # not in the list, still playable
    _, reward, terminated, _, _ = env.step("<answer>qubit</answer>")
    assert reward == 1.0 and terminated


def test_unsupported_word_length():
    with pytest.raises(ValueError, match="length"):
        make(word_length=7)


# ------------------------------------------------------------------ determinism and the expert
def test_same_seed_same_episode_different_seeds_differ():
    env, other = make(), make()
    assert play(env, seed=11) == play(other, seed=11)
    secrets = {play(env, seed)[1]["guess"] for seed in range(8)}
    assert len(secrets) > 1


def test_expert_solves_most_games_within_six_guesses():
    env = make()
    solved = 0
    for seed in range(50):
        _, info = play(env, seed)
        solved += info["success"] and info["turn"] <= 6
    assert solved >= 45


def test_expert_is_first_the_most_informative_word():
    assert best_guess(WORDS) in WORDS
    assert best_guess(("crane", "crank")) == "crane"  # two left: guess the first


def test_expert_works_with_raw_format_and_solves_pinned_words():
    env = make(action_format="raw")
    for word in ("abbey", "eerie", "geese", "llama"):
        _, info = play(env, seed=0, word=word)
        assert info["success"], word
