"""Guess the number: find a hidden integer from "higher"/"lower" hints.

A short-horizon game that rewards systematic search (binary search solves a 1..100 game in
7 guesses). Reward: +1 for the right number, ``invalid_action_penalty`` for text that is not
an integer in range, 0 otherwise.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from envhub.core import Turn
from envhub.errors import ActionParseError
from envs.games.base import GameEnv

__all__ = ["GuessNumberEnv"]

_INT = re.compile(r"[-+]?\d+")


class GuessNumberEnv(GameEnv):
    """Find a secret integer in ``[low, high]``; each guess is answered higher/lower/correct."""

    out_of_turns = (
        "terminated"  # the guess budget is a rule the player is told: out of guesses = lost
    )

    def __init__(
        self, *, low: int = 1, high: int = 100, max_turns: int | None = 10, **game: Any
    ) -> None:
        if not (isinstance(low, int) and isinstance(high, int) and low < high):
            raise ValueError(f"need integers low < high, got low={low!r}, high={high!r}")
        super().__init__(max_turns=max_turns, **game)
        self.low, self.high = low, high
        self._secret = low
        self._bounds = (low, high)

    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._secret = int(self.np_random.integers(self.low, self.high + 1))
        self._bounds = (self.low, self.high)
        turns = f" You have {self.max_turns} guesses." if self.max_turns else ""
        prompt = (
            f"I am thinking of an integer between {self.low} and {self.high} (inclusive).{turns} "
            f"After each guess I will say whether the number is higher or lower. "
            f"{self.parser.instructions} Your first guess?"
        )
        return prompt, {}

    def on_step(self, action: str) -> Turn:
        try:
            guess = self._parse_guess(action)
        except ActionParseError as error:
            return self.invalid_action(self.feedback_for(error))
        if guess == self._secret:
            return Turn(
                f"Correct! The number was {guess}.", reward=1.0, terminated=True, success=True
            )
        low, high = self._bounds
        if guess < self._secret:
            self._bounds = (max(low, guess + 1), high)
            hint = "higher"
        else:
            self._bounds = (low, min(high, guess - 1))
            hint = "lower"
        return Turn(f"{guess} is wrong: the number is {hint}. Guess again.", info={"guess": guess})

    def _parse_guess(self, text: str) -> int:
        action = self.parse_action(text)
        numbers = _INT.findall(action)
        if not numbers:
            raise ActionParseError(
                f"no integer in {action!r}",
                feedback=f"{action[:60]!r} is not a number. Guess an integer between "
                f"{self.low} and {self.high}. {self.parser.instructions}",
            )
        guess = int(numbers[-1])
        if not self.low <= guess <= self.high:
            raise ActionParseError(
                f"{guess} out of range",
                feedback=f"{guess} is outside the range {self.low}..{self.high}. Guess again.",
            )
        return guess

    def sample_action(self, np_random: np.random.Generator) -> str:
        if np_random.random() < 0.2:
            return "I am not sure."
        guess = int(np_random.integers(self.low, self.high + 1))
        return f"Let me try {guess}. {self.format_action(str(guess))}"

    def expert_action(self) -> str | None:
        if self.done:
            return None
        low, high = self._bounds
        return self.format_action(str((low + high) // 2))
