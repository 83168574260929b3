"""2048: slide and merge numbered tiles on a square grid until the target tile appears.

A longer-horizon game with stochastic transitions: every move slides all tiles one way,
equal neighbours merge into their sum (each tile at most once per move), and a new 2
(probability 0.9) or 4 appears in a random empty cell, drawn from ``np_random``. Making the
``target`` tile ends the episode with success; a full board with no possible merge ends it in
failure. A move that changes nothing is legal but wasted.

Reward: potential-based shaping (Ng, Harada & Russell, 1999) on the best tile,
``progress = log2(best tile) / log2(target)`` (0.5 for a 16 when the target is 256, 1 at the
target). A move pays ``progress(after) - progress(before)``, the spawned tile included, and the
move that makes the target adds 1. Why this shape:

- Over an episode the shaping adds up to ``progress(last) - progress(first)``, whatever the
  path: merging small tiles, stalling and putting off the win earn nothing. A win returns
  ``2 - progress(first)``, more than 1; an episode that does not win returns less than
  ``1 - progress(first)`` (its best tile is at most half the target). So winning is always the
  best return (invalid-action penalties aside). Paying merged values (the game's score) would
  pay more for merging small tiles and keeping the target from forming than for winning.
- The best tile never shrinks, so no move's reward is negative.
- It is dense where a success-only reward is not: each doubling of the best tile pays
  ``1 / log2(target)``, so a policy that cannot win yet still sees which play makes progress
  (the target takes a good player about 75 moves on the default board).

The game's score (merged values) is still shown and reported in ``info["score"]``.

``reset(options={"board": [[2, 2, 0, 0], ...]})`` starts from a given grid (for puzzles,
evaluation and tests); otherwise two random tiles are placed.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any, TypeAlias

import numpy as np

from envhub.core import Turn
from envhub.errors import ActionParseError
from envs.games.base import GameEnv
from envs.games.moves import DIRECTIONS, parse_moves

__all__ = ["DIRECTIONS", "Board", "Game2048Env", "best_move", "can_move", "merge_line", "slide"]

Board: TypeAlias = tuple[tuple[int, ...], ...]
"""Rows of tile values, top row first; 0 is an empty cell."""


def merge_line(line: Sequence[int]) -> tuple[list[int], int]:
    """Slide one line towards index 0, merging equal neighbours once each.

    Returns the new line (padded with zeros) and the total value of the merged tiles:
    ``[2, 2, 2, 2] -> [4, 4, 0, 0]`` (gained 8), ``[4, 0, 4, 8] -> [8, 8, 0, 0]`` (gained 8).
    """
    tiles = [value for value in line if value]
    merged: list[int] = []
    gained = 0
    index = 0
    while index < len(tiles):
        if index + 1 < len(tiles) and tiles[index] == tiles[index + 1]:
            merged.append(2 * tiles[index])
            gained += 2 * tiles[index]
            index += 2
        else:
            merged.append(tiles[index])
            index += 1
    return merged + [0] * (len(line) - len(merged)), gained


def slide(board: Board, direction: str) -> tuple[Board, int]:
    """The board after moving every tile towards ``direction``, and the merged value."""
    vertical = direction in ("up", "down")
    backwards = direction in ("down", "right")
    lines = tuple(zip(*board)) if vertical else board
    moved: list[tuple[int, ...]] = []
    gained = 0
    for line in lines:
        new, value = merge_line(line[::-1] if backwards else line)
        moved.append(tuple(new[::-1] if backwards else new))
        gained += value
    result = tuple(zip(*moved)) if vertical else tuple(moved)
    return result, gained


def can_move(board: Board) -> bool:
    """Whether any move changes the board (an empty cell or two equal neighbours)."""
    size = len(board)
    for row in range(size):
        for col in range(size):
            value = board[row][col]
            if value == 0:
                return True
            if col + 1 < size and board[row][col + 1] == value:
                return True
            if row + 1 < size and board[row + 1][col] == value:
                return True
    return False


def _is_tile(value: int) -> bool:
    """0 (empty) or a power of two >= 2."""
    return value == 0 or (value >= 2 and value & (value - 1) == 0)


def _max_tile(board: Board) -> int:
    return max(max(row) for row in board)


def _evaluate(board: Board) -> float:
    """How promising a position is: empty cells, merge chances, and monotone rows/columns.

    Monotonicity is measured on log2 tile values and rewards lines that only grow (or only
    shrink) in one direction, which keeps big tiles together in a corner.
    """
    logs = [[value.bit_length() - 1 if value else 0 for value in row] for row in board]
    empty = sum(row.count(0) for row in board)
    pairs = 0
    monotone = 0.0
    for lines in (logs, [list(column) for column in zip(*logs)]):
        for line in lines:
            rising = falling = 0
            for a, b in pairwise(line):
                if a and a == b:
                    pairs += 1
                if a > b:
                    falling += a - b
                else:
                    rising += b - a
            monotone -= min(rising, falling)
    corner = max(logs[0][0], logs[0][-1], logs[-1][0], logs[-1][-1])
    return 2.7 * empty + 1.0 * pairs + 1.0 * monotone + 1.5 * corner


def best_move(board: Board) -> str | None:
    """A greedy two-move lookahead (ignoring spawns): the first move of the best pair.

    Each legal move is scored by its merged value plus the best evaluation reachable with
    one more legal move (or its own evaluation when it has none). Deterministic: ties go
    to the earlier direction in ``DIRECTIONS``. ``None`` when no move changes the board.
    """
    best: tuple[float, str] | None = None
    for first in DIRECTIONS:
        after, gained = slide(board, first)
        if after == board:
            continue
        follow = [
            (second_gain, nxt)
            for second_gain, nxt in (slide(after, d)[::-1] for d in DIRECTIONS)
            if nxt != after
        ]
        value = _evaluate(after)
        if follow:
            value = max(_evaluate(nxt) + 0.5 * _log_gain(g) for g, nxt in follow)
        score = value + 0.5 * _log_gain(gained)
        if best is None or score > best[0]:
            best = (score, first)
    return None if best is None else best[1]


def _log_gain(gained: int) -> float:
    return float(gained.bit_length()) if gained else 0.0


class Game2048Env(GameEnv):
    """Slide tiles up/down/left/right on a ``size``x``size`` grid until ``target`` appears."""

    def __init__(
        self, *, size: int = 4, target: int = 128, max_turns: int | None = 200, **game: Any
    ) -> None:
        if not (isinstance(size, int) and size >= 2):
            raise ValueError(f"size must be an int >= 2, got {size!r}")
        if not (isinstance(target, int) and target >= 8 and _is_tile(target)):
            raise ValueError(f"target must be a power of two >= 8 (e.g. 128, 2048), got {target!r}")
        super().__init__(max_turns=max_turns, **game)
        self.size, self.target = size, target
        self._board: Board = tuple((0,) * size for _ in range(size))
        self._score = 0

    @property
    def board(self) -> Board:
        """The current grid (rows, top first; 0 = empty)."""
        return self._board

    # ----------------------------------------------------------------- episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._score = 0
        if options.get("board") is not None:
            self._board = self._check_board(options["board"])
        else:
            self._board = tuple((0,) * self.size for _ in range(self.size))
            self._spawn()
            self._spawn()
        turns = f" You have {self.max_turns} moves." if self.max_turns else ""
        prompt = (
            f"Let's play 2048 on a {self.size}x{self.size} grid. Each move slides every tile "
            f"up, down, left or right as far as it goes; two equal tiles that collide merge "
            f"into one with their sum (a tile merges at most once per move), and the merged "
            f"value is added to your score. After every move that changes the grid a new 2 "
            f"(sometimes a 4) appears in a random empty cell. Make a {self.target} tile to win; "
            f"if the grid fills up with no merge possible, you lose.{turns} Empty cells are "
            f"shown as '.'. Answer with up, down, left or right (or U, D, L, R). "
            f"{self.parser.instructions}\n\n{self._render()}"
        )
        return prompt, self._info()

    def _check_board(self, board: Any) -> Board:
        """``options["board"]`` as a ``Board``, or a ``ValueError`` saying what is wrong."""
        rows = tuple(tuple(row) for row in board) if isinstance(board, (list, tuple)) else ()
        shaped = len(rows) == self.size and all(len(row) == self.size for row in rows)
        tiles = [v for row in rows for v in row]
        valid = all(isinstance(v, (int, np.integer)) and _is_tile(int(v)) for v in tiles)
        if not (shaped and valid and any(tiles)):
            raise ValueError(
                f"options['board'] must be {self.size} rows of {self.size} ints, each 0 (empty) "
                f"or a power of two >= 2, with at least one tile; got {board!r:.200}"
            )
        return tuple(tuple(int(v) for v in row) for row in rows)

    def on_step(self, action: str) -> Turn:
        try:
            direction = self._parse_move(action)
        except ActionParseError as error:
            feedback = f"{self.feedback_for(error)}\n\n{self._render()}"
            return self.invalid_action(feedback, **self._info())
        after, gained = slide(self._board, direction)
        if after == self._board:
            return Turn(
                f"Moving {direction} changes nothing: no tile can slide or merge that way. "
                f"Try another direction.\n\n{self._render()}",
                info=self._info(direction=direction, moved=False),
            )
        before = self._progress()
        self._board = after
        self._score += gained
        merged = f", merging tiles worth {gained}" if gained else ""
        if _max_tile(after) >= self.target:
            return Turn(
                f"Moved {direction}{merged}. You made the {self.target} tile and won!\n\n"
                f"{self._render()}",
                reward=self._progress() - before + 1.0,
                terminated=True,
                success=True,
                info=self._info(direction=direction, moved=True, merged=gained),
            )
        self._spawn()
        reward = self._progress() - before
        info = self._info(direction=direction, moved=True, merged=gained)
        if not can_move(self._board):
            return Turn(
                f"Moved {direction}{merged}. The grid is full and nothing can merge: game over.\n\n"
                f"{self._render()}",
                reward=reward,
                terminated=True,
                info=info,
            )
        return Turn(f"Moved {direction}{merged}.\n\n{self._render()}", reward=reward, info=info)

    def _progress(self) -> float:
        """log2(best tile) / log2(target): the potential the reward is shaped on (see above)."""
        return (_max_tile(self._board).bit_length() - 1) / (self.target.bit_length() - 1)

    def _spawn(self) -> None:
        """Put a 2 (p=0.9) or a 4 in a uniformly random empty cell."""
        board = self._board
        empty = [(r, c) for r, row in enumerate(board) for c, value in enumerate(row) if not value]
        row, col = empty[int(self.np_random.integers(len(empty)))]
        value = 4 if self.np_random.random() < 0.1 else 2
        cells = [list(line) for line in self._board]
        cells[row][col] = value
        self._board = tuple(tuple(line) for line in cells)

    def _render(self) -> str:
        """The grid with right-aligned columns, then the score and the target."""
        width = len(str(max(self.target, _max_tile(self._board))))
        rows = [" ".join(str(v or ".").rjust(width) for v in row) for row in self._board]
        best = _max_tile(self._board)
        status = f"Score: {self._score} | Best tile: {best} | Target: {self.target}"
        return "\n".join([*rows, status])

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {
            "score": self._score,
            "max_tile": _max_tile(self._board),
            "board": [list(row) for row in self._board],
            **extra,
        }

    # ----------------------------------------------------------------- actions
    def _parse_move(self, text: str) -> str:
        """One direction from the model's text (see ``envs.games.moves``)."""
        (move,) = parse_moves(self.parse_action(text), 1, self.parser.instructions)
        return move

    def sample_action(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        direction = DIRECTIONS[int(np_random.integers(len(DIRECTIONS)))]
        if roll < 0.1:
            return "I am not sure which way to go."
        if roll < 0.15:
            return self.format_action("diagonal")
        if roll < 0.3:
            return self.format_action(direction[0].upper())
        return f"I'll slide the tiles {direction}. {self.format_action(direction)}"

    def expert_action(self) -> str | None:
        if self.done:
            return None
        return self.format_action(best_move(self._board) or DIRECTIONS[0])
