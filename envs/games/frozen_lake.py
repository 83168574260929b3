"""Frozen Lake: walk from the start to the goal without falling through a hole.

A text version of Gymnasium's FrozenLake. Maps are random (seeded) and always have a safe
path from S (top left) to G (bottom right): like ``generate_random_map`` a map is redrawn
until a search finds one. On a slippery lake a move goes the intended way with probability
1/3 and to each perpendicular side with 1/3, exactly as in Gymnasium.

Reward: +1 for reaching the goal (terminates, success); falling into a hole terminates with
0 and no success; ``invalid_action_penalty`` for text that is not a move; 0 otherwise.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from envhub.core import Turn
from envhub.errors import ActionParseError
from envs.games.base import GameEnv
from envs.games.moves import DIRECTIONS, parse_moves, with_valid_actions

__all__ = ["FrozenLakeEnv", "generate_map", "parse_map", "shortest_path"]

_STEP = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_PERPENDICULAR = {
    "up": ("left", "right"),
    "down": ("right", "left"),
    "left": ("down", "up"),
    "right": ("up", "down"),
}
LEGEND = "P you, S start (frozen), F frozen ice (safe), H hole (falling in ends the game), G goal"


def shortest_path(board: list[str], start: tuple[int, int]) -> list[str] | None:
    """Moves of a shortest hole-free path from ``start`` to G, or ``None`` if there is none."""
    size = len(board)
    came: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if board[cell[0]][cell[1]] == "G":
            moves: list[str] = []
            step = came[cell]
            while step is not None:
                cell, move = step
                moves.append(move)
                step = came[cell]
            return moves[::-1]
        for move in DIRECTIONS:
            r, c = cell[0] + _STEP[move][0], cell[1] + _STEP[move][1]
            if 0 <= r < size and 0 <= c < size and board[r][c] != "H" and (r, c) not in came:
                came[(r, c)] = (cell, move)
                queue.append((r, c))
    return None


def generate_map(size: int, hole_fraction: float, rng: np.random.Generator) -> list[str]:
    """A random ``size`` x ``size`` map (rows of S/F/H/G) with a safe path from S to G."""
    for _ in range(10_000):
        holes = rng.random((size, size)) < hole_fraction
        board = [["H" if hole else "F" for hole in row] for row in holes]
        board[0][0], board[-1][-1] = "S", "G"
        rows = ["".join(row) for row in board]
        if shortest_path(rows, (0, 0)) is not None:
            return rows
    raise RuntimeError(
        f"no {size}x{size} map with hole_fraction={hole_fraction} had a safe path in 10000 tries; "
        "lower hole_fraction"
    )


def parse_map(rows: str | list[str]) -> list[str]:
    """A fixed map from rows of S/F/H/G (one S; spaces are ignored), e.g. ``["SF", "HG"]``."""
    lines = rows.splitlines() if isinstance(rows, str) else rows
    board = [row.replace(" ", "") for row in lines if row.strip()]
    if not board or any(len(r) != len(board) for r in board) or set("".join(board)) - set("SFHG"):
        raise ValueError(f"a Frozen Lake map is a square grid of S, F, H and G, got {rows!r}")
    if "".join(board).count("S") != 1 or "G" not in "".join(board):
        raise ValueError(f"a Frozen Lake map needs exactly one S and at least one G, got {rows!r}")
    return board


class FrozenLakeEnv(GameEnv):
    """Cross a random frozen lake from S to G; optionally slippery (Gymnasium's dynamics).

    ``reset(options={"map": ["SFF", "FHF", "FFG"]})`` plays a fixed map instead.
    """

    def __init__(
        self,
        *,
        size: int = 4,
        slippery: bool = False,
        hole_fraction: float = 0.2,
        max_turns: int | None = 20,
        **game: Any,
    ) -> None:
        if not (isinstance(size, int) and size >= 2):
            raise ValueError(f"size must be an int >= 2, got {size!r}")
        if not (isinstance(hole_fraction, (int, float)) and 0.0 <= hole_fraction < 1.0):
            raise ValueError(f"hole_fraction must be in [0, 1), got {hole_fraction!r}")
        super().__init__(max_turns=max_turns, **game)
        self.size, self.slippery, self.hole_fraction = size, bool(slippery), float(hole_fraction)
        self.board: list[str] = []
        self.position = (0, 0)

    # ------------------------------------------------------------------ episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if "map" in options:
            self.board = parse_map(options["map"])
        else:
            self.board = generate_map(self.size, self.hole_fraction, self.np_random)
        self.position = divmod("".join(self.board).index("S"), len(self.board))
        slip = (
            " The ice is slippery: each move goes the way you chose only 1/3 of the time, and "
            "otherwise slides you to one of the two sides (1/3 each)."
            if self.slippery
            else ""
        )
        turns = f" You have {self.max_turns} moves." if self.max_turns else ""
        size = len(self.board)
        prompt = (
            f"Let's play Frozen Lake on a {size}x{size} grid. Walk from the start to the goal G "
            f"without stepping into a hole H.{slip}{turns} Moving off the edge leaves you where "
            "you are.\n"
            f"Legend: {LEGEND}.\n"
            "Actions: up, down, left, right (or U, D, L, R). One move per turn.\n"
            "Reward: 1 for reaching the goal, 0 otherwise.\n\n"
            f"{self.render_grid()}\n\n{self.parser.instructions} Your first move?"
        )
        return prompt, self._info()

    def on_step(self, action: str) -> Turn:
        try:
            (move,) = parse_moves(self.parse_action(action), 1, self.parser.instructions)
        except ActionParseError as error:
            return self.invalid_action(with_valid_actions(self.feedback_for(error)), **self._info())
        went = move
        if self.slippery:
            went = (move, *_PERPENDICULAR[move])[int(self.np_random.integers(3))]
        r, c = self.position[0] + _STEP[went][0], self.position[1] + _STEP[went][1]
        inside = 0 <= r < len(self.board) and 0 <= c < len(self.board)
        if inside:
            self.position = (r, c)
        stayed = "the edge of the lake; you stayed where you were."
        if went != move:
            what = f"You slipped! You tried to move {move} but slid {went}"
            what += "." if inside else f" into {stayed}"
        elif inside:
            what = f"You moved {move}."
        else:
            what = f"You tried to move {move}, but that is {stayed}"
        tile = self.tile
        info = {**self._info(), "move": move, "moved": went, "slipped": went != move}
        if tile == "H":
            text = f"{what} You fell into a hole. Game over.\n\n{self.render_grid()}"
            return Turn(text, reward=0.0, terminated=True, success=False, info=info)
        if tile == "G":
            text = f"{what} You reached the goal!\n\n{self.render_grid()}"
            return Turn(text, reward=1.0, terminated=True, success=True, info=info)
        return Turn(f"{what}\n\n{self.render_grid()}\n\nYour next move?", info=info)

    # ------------------------------------------------------------------ views
    @property
    def tile(self) -> str:
        """The map letter under the player (S, F, H or G)."""
        return self.board[self.position[0]][self.position[1]]

    def render_grid(self) -> str:
        """The lake as text, one row per line, cells separated by spaces (see ``LEGEND``)."""
        rows = []
        for r, row in enumerate(self.board):
            cells = ("P" if (r, c) == self.position else tile for c, tile in enumerate(row))
            rows.append(" ".join(cells))
        return "\n".join(rows)

    def _info(self) -> dict[str, Any]:
        return {"position": list(self.position), "tile": self.tile}

    # ------------------------------------------------------------------ agents
    def expert_action(self) -> str | None:
        """The first move of a shortest hole-free path to the goal (optimal when not slippery)."""
        if self.done or not self.board:
            return None
        path = shortest_path(self.board, self.position)
        return self.format_action(path[0]) if path else None

    def sample_action(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        if roll < 0.1:
            return self.format_action(str(np_random.choice(["jump", "swim", "stay", "diagonal"])))
        if roll < 0.15:
            return "I don't know which way to go."
        move = str(np_random.choice(DIRECTIONS))
        if roll < 0.25:
            move = move[0].upper()
        opener = str(np_random.choice(["I'll go", "Let me move", "Safest is", "Next:"]))
        return f"{opener} {self.format_action(move)}"
