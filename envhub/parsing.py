"""Pull the action out of a model's chatty text.

Models think aloud, repeat the format instructions, wrap answers in code fences and change
case. ``ActionParser`` finds the action robustly and, when it cannot, raises
``ActionParseError`` whose ``feedback`` tells the model exactly what format to use.

Formats
-------
``"tag"`` (default)
    The content of the *last* ``<answer>...</answer>`` block (tag name configurable,
    case-insensitive, whitespace and code fences stripped). With ``lenient=True`` (default)
    text with no tag at all falls back to ``"last_line"`` so plain answers still count;
    an unclosed ``<answer>`` takes the rest of the text.
``"last_line"``
    The last non-empty line.
``"raw"``
    The whole text, stripped.

Thinking is never the action: with ``"tag"`` and ``"last_line"``, what a reasoning model wrote
inside ``<think>...</think>`` blocks is left out, as it is for tool calls, so an answer it only
mused about ("maybe <answer>0</answer>?") is not graded. Only blocks the text opens count
(``thinking_spans(leading=False)``): a parser cannot know whether the prompt opened one, and a
``</think>`` in an answer (``print('</think>')``) must stay the answer's.

Tool calls (``<tool_call>`` JSON, ``ToolCallParser``) are read by ``envhub.tool_calls``; its
names are importable from here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from envhub.errors import ActionParseError
from envhub.tool_calls import (  # the tool-call half, importable from here as before
    MAX_NESTING,
    ToolCall,
    ToolCallParser,
    _strip,
    blank_thinking,
    format_tool_call,
    json_problem,
    message_text,
    parse_tool_calls,
)

__all__ = [
    "MAX_NESTING",
    "ActionFormat",
    "ActionParser",
    "ToolCall",
    "ToolCallParser",
    "blank_thinking",
    "extract_answer",
    "format_tool_call",
    "json_problem",
    "message_text",
    "parse_tool_calls",
    "valid_text",
]

ActionFormat = Literal["tag", "last_line", "raw"]


@dataclass(frozen=True)
class ActionParser:
    """Extract an action from model text (see the module docstring for the formats)."""

    format: ActionFormat = "tag"
    tag: str = "answer"
    lenient: bool = True
    max_length: int = 1_000

    def __post_init__(self) -> None:
        if self.format not in ("tag", "last_line", "raw"):
            raise ValueError(
                f"unknown action format {self.format!r}; use 'tag', 'last_line' or 'raw'"
            )
        if not re.fullmatch(r"[A-Za-z_][\w-]*", self.tag):
            raise ValueError(f"action tag {self.tag!r} must be a plain name like 'answer'")

    @property
    def instructions(self) -> str:
        """One sentence telling the model how to format its action."""
        if self.format == "tag":
            return f"Put your action inside <{self.tag}>...</{self.tag}>."
        if self.format == "last_line":
            return "Write your action alone on the last line."
        return "Reply with the action only."

    def wrap(self, action: str) -> str:
        """Format an action the way this parser expects it (for experts and examples)."""
        return f"<{self.tag}>{action}</{self.tag}>" if self.format == "tag" else action

    def parse(self, text: str) -> str:
        """Return the action in ``text`` or raise ``ActionParseError`` with model feedback."""
        if not isinstance(text, str):
            raise ActionParseError(f"expected text, got {type(text).__name__}")
        if self.format != "raw":
            text = blank_thinking(text, leading=False)  # (not the action: module docstring)
        if self.format == "tag":
            action = self._parse_tag(text)
        elif self.format == "last_line":
            action = self._parse_last_line(text)
        else:
            action = _strip(text)
        if not action:
            raise ActionParseError(
                "empty action", feedback=f"Your reply contained no action. {self.instructions}"
            )
        if len(action) > self.max_length:
            raise ActionParseError(
                f"action of {len(action)} characters exceeds max_length={self.max_length}",
                feedback=f"Your action is too long ({len(action)} characters). "
                f"Give just the action. {self.instructions}",
            )
        return action

    def _parse_tag(self, text: str) -> str:
        tag = re.escape(self.tag)
        closed = re.findall(rf"<{tag}\s*>(.*?)</\s*{tag}\s*>", text, re.IGNORECASE | re.DOTALL)
        if closed:
            return _strip(closed[-1])
        opened = list(re.finditer(rf"<{tag}\s*>", text, re.IGNORECASE))
        if opened:
            return _strip(text[opened[-1].end() :])
        if self.lenient:
            return self._parse_last_line(text)
        raise ActionParseError(
            f"no <{self.tag}> tag in the text",
            feedback=f"I could not find your action. {self.instructions}",
        )

    def _parse_last_line(self, text: str) -> str:
        lines = [line for line in _strip(text).splitlines() if line.strip()]
        if not lines:
            raise ActionParseError(
                "empty text", feedback=f"Your reply was empty. {self.instructions}"
            )
        return _strip(lines[-1])


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """The content of the last ``<tag>...</tag>`` block, or ``None`` if there is none."""
    try:
        return ActionParser(format="tag", tag=tag, lenient=False).parse(text)
    except ActionParseError:
        return None


LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate on its own: a JSON string can carry one, UTF-8 cannot encode it."""


def valid_text(value: Any) -> Any:
    """``value`` with every lone surrogate in its text (in its lists and dicts too) replaced by
    U+FFFD, so that it can be written as UTF-8 or sent as JSON: what a model's reply held is
    kept, as near as UTF-8 allows, rather than failing the write or the request."""
    if isinstance(value, str):
        return LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [valid_text(item) for item in value]
    if isinstance(value, dict):
        return {key: valid_text(item) for key, item in value.items()}
    return value
