"""Wordle: find a secret five-letter word from green/yellow/grey letter feedback.

A game of constraint tracking and information gathering: every guess is scored letter by
letter exactly as in Wordle (greens first, then yellows limited by how many copies of a
letter the secret still has unmatched), and a good player keeps only the words consistent
with every pattern seen so far. Reward: +1 for finding the word, ``invalid_action_penalty``
for text that is not a word of the right length (or, with ``require_known_word=True``, not
in the built-in list), 0 otherwise. When the guesses run out the word is revealed.

``reset(options={"word": "crane"})`` pins the secret (for evaluation on fixed words and for
tests); otherwise it is drawn from the built-in list with ``np_random``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from envhub.core import Turn
from envhub.errors import ActionParseError
from envs.games.base import GameEnv
from envs.games.words import WORDS, words_of_length

__all__ = ["LEGEND", "WordleEnv", "best_guess", "consistent_words", "score_guess"]

GREEN, YELLOW, GREY = "G", "Y", "_"
LEGEND = (
    "(G = right letter, right spot; Y = in the word but in another spot; "
    "_ = not in the word, or no more copies of it)"
)
_LETTERS = re.compile(r"[a-z]+")
_PUNCTUATION = "\"'`.,!?;:()[]{}*"


def score_guess(secret: str, guess: str) -> str:
    """Wordle feedback for ``guess`` against ``secret``, one symbol per letter (``"GY__G"``).

    Greens are marked first; the secret's other letters are then handed out as yellows to
    the guess's remaining letters from left to right, so a letter guessed twice is yellow
    at most as often as the secret holds unmatched copies of it.
    """
    if secret == guess:
        return GREEN * len(guess)
    pattern = [GREY] * len(guess)
    unmatched: list[str] = []  # the secret's letters not matched by a green
    for index, (secret_letter, guess_letter) in enumerate(zip(secret, guess)):
        if secret_letter == guess_letter:
            pattern[index] = GREEN
        else:
            unmatched.append(secret_letter)
    for index, letter in enumerate(guess):
        if pattern[index] == GREY and letter in unmatched:
            pattern[index] = YELLOW
            unmatched.remove(letter)
    return "".join(pattern)


def consistent_words(words: Sequence[str], guess: str, pattern: str) -> tuple[str, ...]:
    """The words that, were they the secret, would have scored ``guess`` as ``pattern``."""
    return tuple(word for word in words if score_guess(word, guess) == pattern)


@lru_cache(maxsize=512)
def best_guess(candidates: tuple[str, ...]) -> str:
    """The candidate that leaves the fewest candidates on average after its feedback.

    Each candidate is scored by ``sum(bucket_size ** 2)`` over the patterns it would split
    the candidates into (proportional to the expected number left); ties go to the earlier
    word, so the choice is deterministic. Cached: the opening guess is computed once.
    """
    if len(candidates) <= 2:
        return candidates[0]

    def expected_left(guess: str) -> int:
        buckets = Counter(score_guess(secret, guess) for secret in candidates)
        return sum(size * size for size in buckets.values())

    return min(candidates, key=expected_left)


def _spaced(pattern: str) -> str:
    return " ".join(pattern)


class WordleEnv(GameEnv):
    """Guess a secret word; each guess is answered with a green/yellow/grey pattern."""

    out_of_turns = "terminated"  # six guesses is Wordle's rule: out of guesses = lost

    def __init__(
        self,
        *,
        word_length: int = 5,
        max_turns: int | None = 6,
        require_known_word: bool = False,
        **game: Any,
    ) -> None:
        words = words_of_length(word_length) if isinstance(word_length, int) else ()
        if not words:
            lengths = sorted({len(word) for word in WORDS})
            raise ValueError(
                f"no built-in words of length {word_length!r}; the built-in list has "
                f"words of length {lengths}"
            )
        super().__init__(max_turns=max_turns, **game)
        self.word_length = word_length
        self.require_known_word = bool(require_known_word)
        self.words = words
        self._known = frozenset(words)
        self._secret = words[0]
        self._candidates = words
        self._present: set[str] = set()
        self._greyed: set[str] = set()

    # ----------------------------------------------------------------- episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._secret = self._pick_secret(options.get("word"))
        listed = self._secret in self._known
        self._candidates = self.words if listed else (*self.words, self._secret)
        self._present, self._greyed = set(), set()
        n = self.word_length
        turns = f" You have {self.max_turns} guesses." if self.max_turns else ""
        rule = " Every guess must be a common English word." if self.require_known_word else ""
        prompt = (
            f"Let's play Wordle. I have picked a secret {n}-letter English word.{turns} "
            f"Guess any {n}-letter word.{rule} After each guess I show one symbol per letter: "
            f"G = right letter in the right spot, Y = the letter is in the word but in another "
            f"spot, _ = the letter is not in the word (or the word has no more copies of it). "
            f"For example, if the word were CRANE, the guess CREPT would score G G Y _ _. "
            f"{self.parser.instructions} Your first guess?"
        )
        return prompt, {"word_length": n, "guesses_left": self._guesses_left()}

    def _pick_secret(self, word: Any) -> str:
        """``options["word"]`` when given (checked), else a word drawn from the list."""
        if word is None:
            return self.words[int(self.np_random.integers(len(self.words)))]
        n = self.word_length
        if not (isinstance(word, str) and _LETTERS.fullmatch(word.lower()) and len(word) == n):
            raise ValueError(f"options['word'] must be {n} letters a-z, e.g. 'crane'; got {word!r}")
        return word.lower()

    def on_step(self, action: str) -> Turn:
        turn = self._play(action)
        if not turn.terminated and self.max_turns is not None and self.turn >= self.max_turns:
            reveal = f"Out of guesses: the word was {self._secret.upper()}."
            turn.observation = f"{turn.observation}\n{reveal}"
            turn.info["answer"] = self._secret
        return turn

    def _play(self, action: str) -> Turn:
        """Score one guess (or explain why the text is not a guess)."""
        try:
            guess = self._parse_guess(action)
        except ActionParseError as error:
            left = self._guesses_left()
            suffix = "" if left is None else f" {left} guesses left."
            return self.invalid_action(self.feedback_for(error) + suffix, guesses_left=left)
        pattern = score_guess(self._secret, guess)
        self._remember(guess, pattern)
        info = {"guess": guess, "pattern": pattern, "guesses_left": self._guesses_left()}
        line = f"{guess.upper()} -> {_spaced(pattern)}"
        if pattern == GREEN * self.word_length:
            guesses = "guess" if self.turn == 1 else "guesses"
            return Turn(
                f"{line}\nSolved! The word was {guess.upper()} ({self.turn} {guesses}).",
                reward=1.0,
                terminated=True,
                success=True,
                info=info,
            )
        return Turn(self._describe(line), info=info)

    def _remember(self, guess: str, pattern: str) -> None:
        """Track letters seen present/absent and narrow the expert's candidate set."""
        for letter, symbol in zip(guess, pattern):
            (self._greyed if symbol == GREY else self._present).add(letter)
        self._candidates = consistent_words(self._candidates, guess, pattern)

    def _describe(self, line: str) -> str:
        """The reply to a wrong guess: its pattern, the legend, absent letters, guesses left."""
        parts = [line, LEGEND]
        absent = sorted(self._greyed - self._present)
        if absent:
            parts.append(f"Letters not in the word: {', '.join(absent).upper()}")
        left = self._guesses_left()
        if left:
            parts.append(f"{left} {'guess' if left == 1 else 'guesses'} left. Guess again.")
        return "\n".join(parts)

    def _guesses_left(self) -> int | None:
        return None if self.max_turns is None else max(self.max_turns - self.turn, 0)

    # ----------------------------------------------------------------- actions
    def _parse_guess(self, text: str) -> str:
        """The guessed word: the last word of the action, lower-cased, checked for form."""
        action = self.parse_action(text)
        word = action.split()[-1].strip(_PUNCTUATION).lower()
        n = self.word_length
        how = f"Guess a {n}-letter word. {self.parser.instructions}"
        if not word:
            raise ActionParseError("no word in the action", feedback=f"I found no word. {how}")
        if not _LETTERS.fullmatch(word):
            raise ActionParseError(
                f"{word!r} has non-letters",
                feedback=f"{word[:40]!r} is not a word: use only the letters a-z. {how}",
            )
        if len(word) != n:
            raise ActionParseError(
                f"{word!r} has {len(word)} letters",
                feedback=f"{word[:40].upper()} has {len(word)} letters, not {n}. {how}",
            )
        if self.require_known_word and word not in self._known:
            raise ActionParseError(
                f"{word!r} is not in the word list",
                feedback=f"{word.upper()} is not in my word list. Guess a common English "
                f"{n}-letter word. {self.parser.instructions}",
            )
        return word

    def sample_action(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        word = self.words[int(np_random.integers(len(self.words)))]
        if roll < 0.1:
            return "I am not sure what to guess."
        if roll < 0.2:
            wrong = word + word[:2] if roll < 0.15 else word[:-1] + "7"
            return f"Maybe {wrong}? {self.format_action(wrong)}"
        return f"Let me try {word}. {self.format_action(word)}"

    def expert_action(self) -> str | None:
        if self.done:
            return None
        return self.format_action(best_guess(self._candidates))
