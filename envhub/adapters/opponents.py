"""The other player of a two-player adapted game: random, scripted, or a served model.

``make_opponent(spec)`` turns the ``opponent=`` argument of a two-player TextArena id into an
``Opponent``:

``"random"`` (the default)
    A random *legal* move of its own seat. ``RandomOpponent.candidates`` orders the moves to
    try, with the env's seeded RNG: first those the game lists in the opponent's observation
    (TextArena boards say ``Available Moves: '[0]', '[4]'``) in random order, then moves
    shaped like the ``[...]`` examples the game showed (``[a2 a3]``, ``[0 3]``) with their
    board coordinates and numbers varied (``shaped_moves``), in random order. The adapter
    plays the first one the game accepts on a copy of itself, so a listed move of the other
    seat, or the rules' format example, is never played. Deterministic for a seed. The
    adapter shows it only the game's own messages, never a player's text, in which the agent
    could list the moves it wants the opponent to play.
``"module:attr"``
    A scripted player: ``attr`` is a callable, or a class built with no arguments, taking the
    observation text and returning the move, which is TextArena's own ``Agent`` interface
    (``agent(observation) -> str``). Deterministic if the script is.
``"http://host:port/v1"`` (any ``http(s)`` URL)
    A model behind an OpenAI-compatible endpoint, played through ``envhub.model_agent``
    (``opponent_model=`` picks the model when the server has several). It sees its own
    conversation (the game's messages to it and its earlier moves). Each request waits at most
    ``timeout_s`` and is tried ``retries`` more times (``OPPONENT_TIMEOUT_S`` and
    ``OPPONENT_RETRIES`` by default: 12 s x 2 tries, under the step timeout of an ``EnvPool``'s
    and a hub's defaults, 30 s and 60 s, so a hung server fails as itself rather than as a
    killed worker). A request that fails after its retries raises ``SourceError`` ("the
    opponent model at URL failed"): the episode fails, and a pool reports it as a failed
    episode. Not deterministic unless the server samples greedily with a seed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from envhub.errors import SourceConfigError, SourceError
from envhub.registry import import_target

__all__ = [
    "OPPONENT_RETRIES",
    "OPPONENT_TIMEOUT_S",
    "ModelOpponent",
    "Opponent",
    "RandomOpponent",
    "ScriptedOpponent",
    "listed_moves",
    "make_opponent",
    "move_shapes",
    "random_move",
    "shaped_moves",
]

_LISTED_MOVE = re.compile(r"'(\[[^\[\]\n']{1,40}\])'")
_ANY_MOVE = re.compile(r"\[[^\[\]\n]{1,40}\]")
_PART = re.compile(r"(?<![a-z])([a-z])(\d{1,2})(?!\d)|(\d+)", re.IGNORECASE)
"""A board coordinate (``a2``) or a number (``3``) inside a move."""
_FILES = re.compile(r"^\s*a(?:\s+[b-z])+\s*$", re.MULTILINE)  # a board's file axis: a b c d e
_RANKS = re.compile(r"^\s*(\d{1,2})\s*\|", re.MULTILINE)  # a board row's label: "5 |"
MAX_SHAPED = 4_000
"""Most moves ``shaped_moves`` returns (more are sampled, not enumerated)."""
OPPONENT_TIMEOUT_S = 12.0
"""How long one request to a model opponent waits by default."""
OPPONENT_RETRIES = 1
"""How many more times a failed request to a model opponent is tried by default."""


class Opponent(Protocol):
    """What the adapter needs from the other player."""

    def reset(self) -> None:
        """A new episode starts (forget the last one's conversation)."""
        ...

    def act(self, observation: str, rng: np.random.Generator) -> str:
        """The move for ``observation`` (everything new since the opponent's last move)."""
        ...


class RandomOpponent:
    """A uniformly random move among those the observation lists (module docstring)."""

    def reset(self) -> None:
        pass

    def act(self, observation: str, rng: np.random.Generator) -> str:
        return random_move(observation, rng)

    def candidates(
        self, listing: str, shapes: list[str], board: str, rng: np.random.Generator
    ) -> list[str]:
        """The moves to try, in order: ``listing``'s listed moves, then ``shaped_moves`` of
        ``shapes`` (the move examples the game showed so far) on ``board``."""
        listed = listed_moves(listing)
        order = [listed[i] for i in rng.permutation(len(listed))]
        return order + [m for m in shaped_moves(shapes, board, rng) if m not in listed]


def random_move(observation: str, rng: np.random.Generator) -> str:
    """A random move for ``observation``: one of its ``listed_moves``, else ``[0]``."""
    moves = listed_moves(observation) or ["[0]"]
    return moves[int(rng.integers(len(moves)))]


def listed_moves(text: str) -> list[str]:
    """The moves ``text`` lists in quotes (TextArena boards: ``'[4]'``), else any ``[...]``."""
    return [str(move) for move in _LISTED_MOVE.findall(text) or _ANY_MOVE.findall(text)]


def move_shapes(text: str) -> list[str]:
    """One ``[...]`` example of each move shape in ``text`` that holds a coordinate or a
    number (``[a2 a3]`` and ``[b7 b6]`` are one shape, ``[0 3]`` another)."""
    shapes: dict[str, str] = {}
    for move in _ANY_MOVE.findall(text):
        if _PART.search(move):
            shape = _PART.sub(lambda part: "@" if part[1] else "#", move)
            shapes.setdefault(shape, move)
    return list(shapes.values())


def shaped_moves(shapes: Iterable[str], text: str, rng: np.random.Generator) -> list[str]:
    """Moves shaped like ``shapes`` with each coordinate varied over the board ``text`` draws
    (files ``a``.. its last axis letter, ranks 1.. its last row label; ``a``-``h`` and 1-8
    when it draws none) and each number over 0-9, in random order, at most ``MAX_SHAPED``."""
    files = max((line.split()[-1] for line in _FILES.findall(text)), default="h")
    ranks = max((int(rank) for rank in _RANKS.findall(text)), default=8)
    coordinates = [
        f"{chr(f)}{r}" for f in range(ord("a"), ord(files) + 1) for r in range(1, ranks + 1)
    ]
    moves: list[str] = []
    for shape in shapes:
        pieces = _PART.split(shape)
        fixed = pieces[0::4]  # re.split: text, then the 3 groups of each match
        choices = [
            coordinates if letter else [str(n) for n in range(10)] for letter in pieces[1::4]
        ]
        total = int(np.prod([len(c) for c in choices]))
        if total <= MAX_SHAPED:
            combos: Iterable[tuple[str, ...]] = itertools.product(*choices)
        else:
            combos = (
                tuple(c[int(rng.integers(len(c)))] for c in choices) for _ in range(MAX_SHAPED)
            )
        for combo in combos:
            moves.append("".join(f + v for f, v in zip(fixed, combo, strict=False)) + fixed[-1])
    order = rng.permutation(len(moves))[:MAX_SHAPED]
    return [moves[i] for i in order]


class ScriptedOpponent:
    """A TextArena-style agent: ``agent(observation) -> move``."""

    def __init__(self, agent: Callable[[str], str]) -> None:
        self.agent = agent

    def reset(self) -> None:
        pass

    def act(self, observation: str, rng: np.random.Generator) -> str:
        return str(self.agent(observation))


class ModelOpponent:
    """A model served behind an OpenAI-compatible URL, with its own conversation."""

    def __init__(
        self,
        url: str,
        model: str | None,
        api_key: str,
        max_tokens: int = 256,
        *,
        timeout_s: float = OPPONENT_TIMEOUT_S,
        retries: int = OPPONENT_RETRIES,
    ) -> None:
        import openai

        from envhub.model_agent import ModelAgent, resolve_model

        client = openai.OpenAI(
            base_url=url, api_key=api_key, max_retries=retries, timeout=timeout_s
        )
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.agent = ModelAgent(client, resolve_model(client, model), max_tokens=max_tokens)
        self.messages: list[dict[str, Any]] = []

    def reset(self) -> None:
        self.messages = []

    def act(self, observation: str, rng: np.random.Generator) -> str:
        from envhub.model_agent import AgentError

        self.messages.append({"role": "user", "content": observation})
        try:
            turn = self.agent.act(None, self.messages, None)
        except AgentError as error:
            raise SourceError(
                f"the opponent model at {self.url} failed ({error.reason}: {error.detail}) in "
                f"{self.retries + 1} tries of up to opponent_timeout_s={self.timeout_s:g} s; the "
                "episode cannot go on (for a slow server, raise opponent_timeout_s or "
                "opponent_retries, and a pool's step timeout to cover them)"
            ) from error
        self.messages.append(turn.message)
        return turn.action


def make_opponent(
    spec: Any,
    *,
    model: str | None = None,
    api_key: str = "EMPTY",
    timeout_s: float = OPPONENT_TIMEOUT_S,
    retries: int = OPPONENT_RETRIES,
) -> Opponent:
    """The ``Opponent`` for an ``opponent=`` argument (see the module docstring); ``timeout_s``
    and ``retries`` bound a model opponent's requests."""
    if spec == "random":
        return RandomOpponent()
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        return ModelOpponent(spec, model, api_key, timeout_s=timeout_s, retries=retries)
    if isinstance(spec, str) and ":" in spec:
        try:
            target = import_target(spec)
        except (ImportError, AttributeError) as error:
            raise SourceConfigError(
                f"opponent {spec!r} cannot be imported ({error}); give 'module:callable'"
            ) from error
        if isinstance(target, type):
            target = target()
        if not callable(target):
            raise SourceConfigError(f"opponent {spec!r} is not callable (observation -> move)")
        return ScriptedOpponent(target)
    if callable(spec):
        return ScriptedOpponent(spec)
    raise SourceConfigError(
        f"opponent={spec!r} is not one of: 'random', 'module:callable' (a scripted player), "
        "or an OpenAI-compatible URL 'http://host:port/v1'"
    )
