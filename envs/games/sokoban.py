"""Sokoban: push every box onto a target in a procedurally generated, always solvable room.

Levels are generated the gym-sokoban way: carve a connected room out of solid wall with a
random walk, put the boxes on their targets, then play the puzzle *backwards* with random
pulls. Every pull is undone by a push, so the start state is solvable by construction, and
the reverse walk is capped at the episode's move budget so it is solvable in time as well.

Rewards follow gym-sokoban: -0.1 per move, +1 per box pushed onto a target, -1 per box
pushed off one, +10 when every box is on a target (the episode terminates, success).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from envhub.core import Turn
from envhub.errors import ActionParseError
from envs.games.base import GameEnv
from envs.games.moves import DIRECTIONS, parse_moves, with_valid_actions

__all__ = [
    "LEGEND",
    "SokobanEnv",
    "SokobanLevel",
    "generate_level",
    "parse_level",
    "solve",
]

_OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
_WALKS, _KEEP_DIRECTION, _PULL = 4, 0.6, 0.9
_CHECK_EXPANSIONS = 2_000
LEGEND = (
    "# wall, _ floor, O target, X box, √ box on a target, P you (the player), "
    "S you standing on a target"
)


@dataclass(frozen=True)
class SokobanLevel:
    """A start state. Cells are flat indices ``row * size + col``; the border is always wall."""

    size: int
    floor: frozenset[int]
    targets: frozenset[int]
    boxes: frozenset[int]
    player: int
    solution: tuple[str, ...] | None = None
    """A known solution (shortest when the generator's check found it), ``None`` if unknown."""


def parse_level(text: str | list[str]) -> SokobanLevel:
    """A level from a square text grid in the ``LEGEND`` characters (spaces are ignored)."""
    lines = text.splitlines() if isinstance(text, str) else text
    rows = [row.replace(" ", "") for row in lines if row.strip()]
    size = len(rows)
    if size < 3 or any(len(row) != size for row in rows):
        raise ValueError(f"a Sokoban level must be a square grid of at least 3 rows, got {rows!r}")
    floor, targets, boxes, players = set(), set(), set(), []
    for cell, char in enumerate("".join(rows)):
        if char not in "#_OX√PS":
            raise ValueError(f"unknown level character {char!r}; use the legend: {LEGEND}")
        if char != "#":
            if cell // size in (0, size - 1) or cell % size in (0, size - 1):
                raise ValueError("the border of a Sokoban level must be wall (#)")
            floor.add(cell)
        targets |= {cell} if char in "O√S" else set()
        boxes |= {cell} if char in "X√" else set()
        players += [cell] if char in "PS" else []
    if len(players) != 1 or not boxes or len(boxes) != len(targets):
        raise ValueError("a level needs one player and as many boxes as targets (at least one)")
    return SokobanLevel(size, frozenset(floor), frozenset(targets), frozenset(boxes), players[0])


def _offsets(size: int) -> dict[str, int]:
    return {"up": -size, "down": size, "left": -1, "right": 1}


def generate_level(
    size: int, num_boxes: int, rng: np.random.Generator, max_moves: int
) -> SokobanLevel:
    """A random level solvable in at most ``max_moves`` moves; retries until one is not too easy.

    A level is too easy when its shortest solution is under ``min(size - 2, max_moves // 2)``
    moves (which also rejects levels with every box already home).
    """
    steps = max(1, min(max_moves, 2 * size * (num_boxes + 1)))
    min_moves = max(1, min(size - 2, max_moves // 2))
    for _ in range(500):
        floor = _carve_room(size, num_boxes, rng)
        level = _reverse_play(size, floor, num_boxes, rng, steps)
        if level is None:
            continue
        # The expansion cap (not a clock) keeps generation deterministic; an unsolved search
        # means a hard level, which is kept with its construction solution.
        shortest = solve(level, max_expansions=_CHECK_EXPANSIONS, time_limit=float("inf"))
        if shortest is None:
            return level
        if len(shortest) >= min_moves:
            return replace(level, solution=tuple(shortest))
    raise RuntimeError(
        f"could not generate a {size}x{size} Sokoban level with {num_boxes} boxes; use fewer boxes"
    )


def _carve_room(size: int, num_boxes: int, rng: np.random.Generator) -> frozenset[int]:
    """A connected set of interior floor cells, carved by a random walk that sometimes widens."""
    inner = size - 2
    goal = min(inner * inner, max(num_boxes + 4, round(inner * inner * rng.uniform(0.55, 0.8))))
    steps = list(_offsets(size).values())
    cell = size * int(rng.integers(1, size - 1)) + int(rng.integers(1, size - 1))
    step = steps[int(rng.integers(4))]
    floor = {cell}

    def inside(c: int) -> bool:
        return 1 <= c // size <= size - 2 and 1 <= c % size <= size - 2

    while len(floor) < goal:
        if rng.random() < 0.35:
            step = steps[int(rng.integers(4))]
        if not inside(cell + step):
            step = steps[int(rng.integers(4))]
            continue
        cell += step
        floor.add(cell)
        side = steps[int(rng.integers(4))]
        if rng.random() < 0.3 and inside(cell + side):
            floor.add(cell + side)
    return frozenset(floor)


def _reverse_play(
    size: int, floor: frozenset[int], num_boxes: int, rng: np.random.Generator, steps: int
) -> SokobanLevel | None:
    """Pull boxes away from their targets; keep the state whose boxes are furthest from home.

    Several reverse walks start from the solved room (player placed at random); each walk
    tends to keep its direction so boxes get dragged along corridors. A state scores
    (fewest pushes from every box to a target) x (boxes off target), as in gym-sokoban.
    """
    cells = sorted(floor)
    if len(cells) < num_boxes + 2:
        return None
    picks = rng.choice(len(cells), size=num_boxes, replace=False)
    targets = frozenset(cells[i] for i in picks)
    distance = _push_distances(size, floor, targets)
    offsets = list(_offsets(size).items())
    best: tuple[int, frozenset[int], int, tuple[str, ...]] | None = None
    free = [c for c in cells if c not in targets]
    for _ in range(_WALKS):
        player, boxes, walk = free[int(rng.integers(len(free)))], set(targets), []
        name, off = offsets[int(rng.integers(4))]
        for _ in range(steps):
            if rng.random() > _KEEP_DIRECTION:
                name, off = offsets[int(rng.integers(4))]
            ahead, behind = player + off, player - off
            if ahead not in floor or ahead in boxes:
                continue
            if behind in boxes and rng.random() < _PULL:
                boxes.remove(behind)
                boxes.add(player)
            player = ahead
            walk.append(name)
            score = sum(distance.get(b, 0) for b in boxes) * len(boxes - targets)
            if score > 0 and (best is None or score >= best[0]):
                undo = tuple(_OPPOSITE[m] for m in reversed(walk))
                best = (score, frozenset(boxes), player, undo)
    if best is None:
        return None
    _, boxes_set, player, solution = best
    return SokobanLevel(size, floor, targets, boxes_set, player, solution)


def _push_distances(size: int, floor: frozenset[int], targets: frozenset[int]) -> dict[int, int]:
    """Fewest pushes that bring a box from each cell to some target (other boxes ignored).

    Cells missing from the result are dead: a box there can never reach a target.
    """
    pushes = {t: 0 for t in targets}
    queue = deque(sorted(targets))
    while queue:
        cell = queue.popleft()
        for off in _offsets(size).values():
            if cell - off in floor and cell - 2 * off in floor and cell - off not in pushes:
                pushes[cell - off] = pushes[cell] + 1
                queue.append(cell - off)
    return pushes


def _walk(
    size: int, floor: frozenset[int], boxes: frozenset[int], start: int
) -> dict[int, tuple[int, str, int]]:
    """BFS of the player around fixed boxes: cell -> (previous cell, move, distance)."""
    came = {start: (-1, "", 0)}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        for name, off in _offsets(size).items():
            nxt = cell + off
            if nxt in floor and nxt not in boxes and nxt not in came:
                came[nxt] = (cell, name, came[cell][2] + 1)
                queue.append(nxt)
    return came


def _path(came: dict[int, tuple[int, str, int]], goal: int) -> list[str]:
    moves: list[str] = []
    while came[goal][0] != -1:
        goal, move, _ = came[goal]
        moves.append(move)
    return moves[::-1]


def solve(
    level: SokobanLevel,
    boxes: frozenset[int] | None = None,
    player: int | None = None,
    *,
    max_expansions: int = 30_000,
    time_limit: float = 1.0,
) -> list[str] | None:
    """Fewest-moves solution from a state (the level's start by default), or ``None``.

    A* over push states (player position right after a push, box set); an edge is the walk
    to a box plus the push, costing walk length + 1. The heuristic (sum over boxes of the
    fewest pushes to any target, ignoring other boxes) is consistent, so the plan is
    optimal. Dead squares are pruned; the search gives up (``None``) after
    ``max_expansions`` expanded states or ``time_limit`` seconds.
    """
    size, floor, targets = level.size, level.floor, level.targets
    boxes = level.boxes if boxes is None else boxes
    player = level.player if player is None else player
    pushes = _push_distances(size, floor, targets)
    if any(b not in pushes for b in boxes):
        return None
    start = (player, boxes)
    best_g = {start: 0}
    came: dict[tuple[int, frozenset[int]], tuple[tuple[int, frozenset[int]], int, str]] = {}
    heap = [(sum(pushes[b] for b in boxes), 0, 0, start)]
    deadline, expansions, counter = time.perf_counter() + time_limit, 0, 0
    while heap:
        _, g, _, state = heapq.heappop(heap)
        if g > best_g[state]:
            continue
        at, on = state
        if on <= targets:
            return _plan(level, came, state)
        expansions += 1
        if expansions > max_expansions or time.perf_counter() > deadline:
            return None
        reach = _walk(size, floor, on, at)
        for box in sorted(on):
            for name, off in _offsets(size).items():
                stand, dest = box - off, box + off
                if stand not in reach or dest not in pushes or dest in on:
                    continue
                moved = (on - {box}) | {dest}
                cost = g + reach[stand][2] + 1
                nxt = (box, moved)
                if cost < best_g.get(nxt, 1 << 30):
                    best_g[nxt] = cost
                    came[nxt] = (state, stand, name)
                    counter += 1
                    estimate = cost + sum(pushes[b] for b in moved)
                    heapq.heappush(heap, (estimate, cost, counter, nxt))
    return None


def _plan(level: SokobanLevel, came: dict, state: tuple[int, frozenset[int]]) -> list[str]:
    """Rebuild the move list of a solved search state from the push records."""
    segments: list[list[str]] = []
    while state in came:
        previous, stand, push = came[state]
        walk = _walk(level.size, level.floor, previous[1], previous[0])
        segments.append(_path(walk, stand) + [push])
        state = previous
    return [move for segment in reversed(segments) for move in segment]


class SokobanEnv(GameEnv):
    """Push every box (X) onto a target (O); levels are random, seeded and always solvable.

    ``reset(options={"level": grid})`` plays a fixed level instead (see ``parse_level``).
    """

    def __init__(
        self,
        *,
        size: int = 6,
        num_boxes: int = 1,
        max_turns: int | None = 30,
        max_moves_per_turn: int = 1,
        **game: Any,
    ) -> None:
        if not (isinstance(size, int) and size >= 5):
            raise ValueError(f"size must be an int >= 5 (the border is wall), got {size!r}")
        if not (isinstance(num_boxes, int) and 1 <= num_boxes <= (size - 2) ** 2 // 3):
            most = (size - 2) ** 2 // 3
            raise ValueError(f"num_boxes must be 1..{most} for size={size}, got {num_boxes!r}")
        if not (isinstance(max_moves_per_turn, int) and max_moves_per_turn >= 1):
            raise ValueError(f"max_moves_per_turn must be an int >= 1, got {max_moves_per_turn!r}")
        super().__init__(max_turns=max_turns, **game)
        self.size, self.num_boxes, self.max_moves_per_turn = size, num_boxes, max_moves_per_turn
        # A solved 3x3 placeholder until the first reset.
        self.level = SokobanLevel(3, frozenset({4}), frozenset({4}), frozenset({4}), 4)
        self._boxes, self._player = self.level.boxes, self.level.player
        self._plan: list[tuple[tuple[int, frozenset[int]], str]] = []

    # ------------------------------------------------------------------ episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if "level" in options:
            self.level = parse_level(options["level"])
        else:
            budget = self.max_moves_per_turn * (self.max_turns or self.size**2)
            self.level = generate_level(self.size, self.num_boxes, self.np_random, budget)
        self._boxes, self._player, self._plan = self.level.boxes, self.level.player, []
        per_turn = (
            "One move per turn."
            if self.max_moves_per_turn == 1
            else f"Up to {self.max_moves_per_turn} moves a turn, comma-separated (e.g. 'up, left')."
        )
        turns = f" You have {self.max_turns} turns." if self.max_turns else ""
        size = self.level.size
        prompt = (
            f"Let's play Sokoban on a {size}x{size} grid. Push every box onto a target. You push a "
            "box by walking into it; you cannot pull boxes, and a box with a wall or another box "
            "behind it does not move.\n"
            f"Legend: {LEGEND}.\n"
            f"Actions: up, down, left, right (or U, D, L, R). {per_turn}{turns}\n"
            "Rewards: -0.1 per move, +1 for each box pushed onto a target, -1 for each box pushed "
            "off a target, +10 when every box is on a target.\n\n"
            f"{self.render_grid()}\n{self._status()}\n\n{self.parser.instructions} Your first move?"
        )
        return prompt, self._info()

    def on_step(self, action: str) -> Turn:
        try:
            text = self.parse_action(action)
            moves = parse_moves(text, self.max_moves_per_turn, self.parser.instructions)
        except ActionParseError as error:
            return self.invalid_action(with_valid_actions(self.feedback_for(error)), **self._info())
        reward, lines, blocked = 0.0, [], 0
        for index, move in enumerate(moves):
            before = self.boxes_on_target
            self._player, self._boxes, event = _apply(self.level, self._player, self._boxes, move)
            change = self.boxes_on_target - before
            reward += -0.1 + change
            blocked += event.startswith("blocked")
            lines.append(_describe(move, event, change))
            if self.solved:
                reward += 10.0
                if index < len(moves) - 1:
                    lines.append("The puzzle is solved, so your remaining moves were not played.")
                break
        if len(moves) > 1:
            lines = [f"Move {i + 1}: {line}" for i, line in enumerate(lines)]
        ending = "Every box is on a target: puzzle solved!" if self.solved else "Your next move?"
        observation = "\n".join(lines) + f"\n\n{self.render_grid()}\n{self._status()}\n\n{ending}"
        info = {**self._info(), "moves": moves[: index + 1], "blocked_moves": blocked}
        solved = self.solved
        return Turn(observation, round(reward, 6), terminated=solved, success=solved, info=info)

    # ------------------------------------------------------------------ state views
    @property
    def player(self) -> tuple[int, int]:
        """The player's (row, column)."""
        return divmod(self._player, self.level.size)

    @property
    def boxes(self) -> list[tuple[int, int]]:
        """Every box's (row, column), sorted."""
        return [divmod(b, self.level.size) for b in sorted(self._boxes)]

    @property
    def boxes_on_target(self) -> int:
        return len(self._boxes & self.level.targets)

    @property
    def solved(self) -> bool:
        return self._boxes <= self.level.targets

    def render_grid(self) -> str:
        """The board as text, one row per line, cells separated by spaces (see ``LEGEND``)."""
        size, floor, targets = self.level.size, self.level.floor, self.level.targets
        glyphs = []
        for cell in range(size * size):
            pair = "PS" if cell == self._player else "X√" if cell in self._boxes else "_O"
            glyphs.append(pair[cell in targets] if cell in floor else "#")
        return "\n".join(" ".join(glyphs[r * size : (r + 1) * size]) for r in range(size))

    def _status(self) -> str:
        return f"Boxes on target: {self.boxes_on_target}/{len(self.level.boxes)}"

    def _info(self) -> dict[str, Any]:
        return {"boxes_on_target": self.boxes_on_target, "num_boxes": len(self.level.boxes)}

    # ------------------------------------------------------------------ agents
    def expert_action(self) -> str | None:
        """The next move(s) of a shortest solution; replans when the state left the plan."""
        if self.done or self.solved:  # also before the first reset (a solved placeholder)
            return None
        state = (self._player, self._boxes)
        while self._plan and self._plan[0][0] != state:
            self._plan.pop(0)
        if not self._plan:
            moves: Sequence[str] | None = None
            if state == (self.level.player, self.level.boxes):
                moves = self.level.solution  # found (or built) by the generator
            if moves is None:
                moves = solve(self.level, self._boxes, self._player)
            if moves is None:
                return None
            player, boxes = state
            for move in moves:
                self._plan.append(((player, boxes), move))
                player, boxes, _ = _apply(self.level, player, boxes, move)
        return self.format_action(", ".join(m for _, m in self._plan[: self.max_moves_per_turn]))

    def sample_action(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        if roll < 0.1:
            return self.format_action(str(np_random.choice(["jump", "wait", "pull", "diagonal"])))
        if roll < 0.15:
            return "Hmm, I am not sure what to do here."
        count = int(np_random.integers(1, self.max_moves_per_turn + 1))
        moves = ", ".join(str(np_random.choice(DIRECTIONS)) for _ in range(count))
        opener = str(np_random.choice(["I'll go", "Let me move", "Best option:", "Next:"]))
        return f"{opener} {self.format_action(moves)}"


def _apply(
    level: SokobanLevel, player: int, boxes: frozenset[int], move: str
) -> tuple[int, frozenset[int], str]:
    """One move: the new player and boxes, and what happened (walked/pushed/blocked_*)."""
    off = _offsets(level.size)[move]
    ahead = player + off
    if ahead not in level.floor:
        return player, boxes, "blocked_wall"
    if ahead not in boxes:
        return ahead, boxes, "walked"
    if ahead + off not in level.floor or ahead + off in boxes:
        return player, boxes, "blocked_box"
    return ahead, (boxes - {ahead}) | {ahead + off}, "pushed"


def _describe(move: str, event: str, change: int) -> str:
    """One line telling the model what its move did (blocked moves are legal but do nothing)."""
    where = {1: " onto a target", -1: " off its target"}.get(change, "")
    return {
        "blocked_wall": f"You tried to move {move} but there is a wall; you stayed in place.",
        "blocked_box": f"You tried to push the box {move}, but a wall or another box is behind "
        "it; nothing moved.",
        "walked": f"You moved {move}.",
    }.get(event, f"You pushed a box {move}{where}.")
