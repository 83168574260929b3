"""What every built-in game shares: the action parser, its instructions, and word actions.

A game is a ``TextEnv`` whose action is one word (or a short phrase) picked out of the
model's text by an ``ActionParser``. Subclasses implement ``on_reset``/``on_step`` and use
``parse_action`` to turn model text into an action or into feedback for an invalid one.
"""

from __future__ import annotations

from typing import Any

from envhub.core import TextEnv
from envhub.errors import ActionParseError
from envhub.parsing import ActionFormat, ActionParser

__all__ = ["GameEnv"]


class GameEnv(TextEnv):
    """A ``TextEnv`` that reads its action through a configurable ``ActionParser``."""

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        action_format: ActionFormat = "tag",
        action_tag: str = "answer",
        invalid_action_penalty: float = -0.1,
        render_mode: Any = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.parser = ActionParser(format=action_format, tag=action_tag)
        self.invalid_action_penalty = invalid_action_penalty

    def parse_action(self, text: str) -> str:
        """The action in ``text``; raises ``ActionParseError`` carrying model feedback."""
        return self.parser.parse(text)

    def format_action(self, action: str) -> str:
        """Wrap a bare action the way a model should write it (used by experts and docs)."""
        return self.parser.wrap(action)

    def feedback_for(self, error: ActionParseError) -> str:
        """The observation sent back for text that could not be parsed."""
        return error.feedback
