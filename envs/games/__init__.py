"""Text games for LLM RL, registered under the ``games/`` namespace.

Every game is seeded and deterministic, reads its action from chatty model text
(``<answer>...</answer>`` by default; ``action_format="last_line"`` or ``"raw"`` too),
answers an invalid action with a penalty and an explanation, and reports ``success``.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register every game with the envhub registry (called by the registry itself)."""
    from envhub.registry import register

    register(
        "games/guess-number-v0",
        "envs.games.guess_number:GuessNumberEnv",
        max_turns=10,
        description=(
            "Find a hidden integer from higher/lower hints (1..100 in 10 guesses by default)."
        ),
        variants={
            "easy": {"low": 1, "high": 20},
            "hard": {"low": 1, "high": 1000, "max_turns": 12},
        },
    )
    register(
        "games/sokoban-v0",
        "envs.games.sokoban:SokobanEnv",
        kwargs={"size": 6, "num_boxes": 1},
        max_turns=30,
        description="Push every box onto a target; procedurally generated, always solvable.",
        variants={
            "5x5": {"size": 5, "num_boxes": 1},
            "8x8": {"size": 8, "num_boxes": 2, "max_turns": 60},
            "10x10": {"size": 10, "num_boxes": 3, "max_turns": 100},
        },
    )
    register(
        "games/frozen-lake-v0",
        "envs.games.frozen_lake:FrozenLakeEnv",
        kwargs={"size": 4, "slippery": False},
        max_turns=20,
        description="Walk from S to G across a frozen lake without falling into a hole.",
        variants={
            "8x8": {"size": 8, "max_turns": 40},
            "slippery": {"slippery": True},
        },
    )
    register(
        "games/wordle-v0",
        "envs.games.wordle:WordleEnv",
        max_turns=6,
        description="Guess a five-letter word in six tries from green/yellow/grey letter feedback.",
    )
    register(
        "games/2048-v0",
        "envs.games.game2048:Game2048Env",
        kwargs={"size": 4, "target": 128},
        max_turns=200,
        description="Slide and merge tiles to reach the target tile (128 by default).",
        variants={"256": {"target": 256, "max_turns": 400}, "3x3": {"size": 3, "target": 64}},
    )
