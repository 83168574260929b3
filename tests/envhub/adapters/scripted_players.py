"""Scripted TextArena players (TextArena's agent interface: observation text -> move)."""

from __future__ import annotations

import re

MOVES: list[str] = []
"""Every move ``first_listed_move`` made in this process, in order."""


def first_listed_move(observation: str) -> str:
    """The first move of the last 'Available Moves' list in ``observation``."""
    listed = re.findall(r"Available Moves: '(\[\d+\])'", observation)
    move = listed[-1] if listed else "[0]"
    MOVES.append(move)
    return move


class AlwaysCentre:
    """A class-based player (built with no arguments, then called per move)."""

    def __call__(self, observation: str) -> str:
        return "[4]"


def broken_player(observation: str) -> str:
    """A player whose script fails: the episode fails as the source's failure."""
    raise RuntimeError("the script broke")
