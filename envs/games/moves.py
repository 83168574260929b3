"""Parsing grid moves (up/down/left/right) from model text, shared by the grid games.

Direction words (up/down/left/right, U/D/L/R, north/south/west/east) count; a few filler
words ("move", "go", "then", ...) are ignored; anything else makes the action invalid, so
the model gets precise feedback rather than a silent guess ("I give up" is not "up").
"""

from __future__ import annotations

import re

from envhub.errors import ActionParseError

__all__ = ["DIRECTIONS", "VALID_ACTIONS", "parse_moves", "with_valid_actions"]

DIRECTIONS: tuple[str, ...] = ("up", "down", "left", "right")
_ALIASES = {
    "u": "up",
    "north": "up",
    "d": "down",
    "south": "down",
    "l": "left",
    "west": "left",
    "r": "right",
    "east": "right",
}
_FILLER = frozenset(
    {"move", "moves", "go", "step", "walk", "push", "slide", "swipe", "then", "and", "to", "the"}
)
VALID_ACTIONS = "Valid actions: up, down, left, right (or U, D, L, R)."


def with_valid_actions(feedback: str) -> str:
    """``feedback`` ending with the list of valid moves, unless it already names them."""
    return feedback if VALID_ACTIONS in feedback else f"{feedback} {VALID_ACTIONS}"


def parse_moves(action: str, max_moves: int = 1, instructions: str = "") -> list[str]:
    """Read 1..``max_moves`` directions from an action like ``"Left"``, ``"move up"``, ``"U, L"``.

    Direction words (up/down/left/right, U/D/L/R, north/south/west/east) count; a few filler
    words ("move", "go", "then", ...) are ignored; anything else makes the action invalid, so
    the model gets precise feedback rather than a silent guess. Raises ``ActionParseError``.
    """
    many = f" Up to {max_moves} moves, comma-separated, e.g. 'up, left'." if max_moves > 1 else ""
    hint = f"{VALID_ACTIONS}{many} {instructions}".strip()
    words = re.findall(r"[a-z]+", action.lower())
    unknown = [w for w in words if w not in DIRECTIONS and w not in _ALIASES and w not in _FILLER]
    moves = [_ALIASES.get(w, w) for w in words if w in DIRECTIONS or w in _ALIASES]
    if unknown or not moves:
        raise ActionParseError(
            f"no move in {action[:60]!r}", feedback=f"{action[:60]!r} is not a valid move. {hint}"
        )
    if len(moves) > max_moves:
        limit = "one move" if max_moves == 1 else f"at most {max_moves} moves"
        raise ActionParseError(
            f"{len(moves)} moves given, at most {max_moves} allowed",
            feedback=f"You gave {len(moves)} moves but may make {limit} per turn. {hint}",
        )
    return moves
