"""Small envs that each carry one author bug the checker must catch (importable by name, so
they pickle and a new Python process can build them).

Each bug hides from random play on seeds 0 to 2: it fires on the expert's winning turn, on the
trainer's far evaluation seeds, after another episode on the same object, or in another
process only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import envhub

FAR_SEED = 1_000_000_000
"""Where the trainer's evaluation seeds start (``trainer.rollout.groups.EVAL_SEED_BASE``)."""


class Win(envhub.TextEnv):
    """Say <answer>win</answer> to win; the expert does so. Random text never wins."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def on_reset(self, options):
        return "Say <answer>win</answer>.", {}

    def on_step(self, action):
        if action.strip() == "<answer>win</answer>":
            return self.win()
        return self.invalid_action("Write <answer>win</answer>.")

    def win(self) -> envhub.Turn:
        return envhub.Turn("You won.", reward=1.0, terminated=True, success=True)

    def expert_action(self) -> str | None:
        return None if self.done else "<answer>win</answer>"


class RaisesOnWin(Win):
    def win(self) -> envhub.Turn:
        scores: dict[str, float] = {}
        return envhub.Turn("You won.", reward=scores["best"], terminated=True, success=True)


class NumpyInfoOnWin(Win):
    def win(self) -> envhub.Turn:
        return envhub.Turn(
            "You won.", reward=1.0, terminated=True, success=True, info={"at": np.int64(1)}
        )


class BadObservationOnWin(Win):
    def win(self) -> envhub.Turn:
        return envhub.Turn(
            {"role": "user", "content": 42},  # type: ignore[arg-type]
            reward=1.0,
            terminated=True,
            success=True,
        )


class RaisesOnFarSeeds(Win):
    """Breaks on every step of an episode seeded at or above 1e9 (the trainer's eval seeds)."""

    def on_reset(self, options):
        self.far = self.seed_ is not None and self.seed_ >= FAR_SEED
        return super().on_reset(options)

    def reset(self, *, seed=None, options=None):
        self.seed_ = seed
        return super().reset(seed=seed, options=options)

    def on_step(self, action):
        if self.far:
            raise RuntimeError("boom on an evaluation seed")
        return super().on_step(action)


class ExpertRefused(Win):
    """Its expert answers at length, past what its parser reads: every answer is refused (the
    review's reasoning-gym bug: a parser cap below the dataset's longest answers)."""

    def on_step(self, action):
        if len(action) > 100:
            return self.invalid_action("I found no answer. Write <answer>win</answer>.")
        return super().on_step(action)

    def expert_action(self) -> str | None:
        return None if self.done else "<answer>win</answer>" + " " * 200


class ExpertNeverWins(Win):
    """Its expert's answer is accepted, and the episode ends, but never in a success."""

    def win(self) -> envhub.Turn:
        return envhub.Turn("Out of luck.", reward=0.0, terminated=True, success=False)


class ExpertLosesToChance(Win):
    """Its expert's answer wins only where the dice allow (a seed in four), as on slippery ice:
    no bug, the env is random."""

    def win(self) -> envhub.Turn:
        if self.np_random.random() < 0.25:
            return super().win()
        return envhub.Turn("The ice gave way.", reward=0.0, terminated=True, success=False)


class LeaksAcrossEpisodes(Win):
    """Counts episodes per object and shows the count: seed s depends on what ran before."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.episodes = 0

    def on_reset(self, options):
        self.episodes += 1
        return f"Episode {self.episodes}. Say <answer>win</answer>.", {}


class FirstTaskSticks(Win):
    """Draws the task on the first reset only (the review's lab/leak-v0)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.task: int | None = None

    def on_reset(self, options):
        if self.task is None:
            self.task = int(self.np_random.integers(1_000_000))
        return f"Task {self.task}. Say <answer>win</answer>.", {}


class HashOrdered(Win):
    """Deterministic within one process only: shows ``hash()`` of a str."""

    def on_reset(self, options):
        return f"Task {hash('envhub') % 1_000_003}. Say <answer>win</answer>.", {}


class KeepsConfig(envhub.TextEnv):
    """Takes its own options as ``**config`` and does not pass them to ``TextEnv``."""

    def __init__(self, max_turns: int | None = 3, **config: Any) -> None:
        super().__init__(max_turns=max_turns)
        self.config = config

    def on_reset(self, options):
        return f"config {sorted(self.config.items())}", {}

    def on_step(self, action):
        return envhub.Turn("ok", terminated=True)


class ForwardsConfig(envhub.TextEnv):
    """Passes ``**kwargs`` on to ``TextEnv`` (the usual pattern): a typo is still refused."""

    def __init__(self, *, level: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.level = level

    def on_reset(self, options):
        return f"level {self.level}", {}

    def on_step(self, action):
        return envhub.Turn("ok", terminated=True)


class CannotBeBuilt(Win):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        raise ValueError("low must be below high, got low=500, high=100")


class RaisesOnStep(Win):
    def on_step(self, action):
        if action.strip() == "boom":
            raise KeyError("best")
        return super().on_step(action)


class RaisesOnReset(Win):
    def on_reset(self, options):
        raise RuntimeError("needs the DATA_DIR environment variable")


class Huge(Win):
    """Its opening observation is 300,000 characters long."""

    def on_reset(self, options):
        return "x" * 300_000, {}


class ManyLong(Win):
    """Its opening observation is five messages of 15,000 characters."""

    def on_reset(self, options):
        return [{"role": "user", "content": "y" * 15_000} for _ in range(5)], {}


def register() -> None:
    """A plugin registering the envs the cross-process check needs to find in a new process."""
    envhub.register("bugs/win-v0", f"{__name__}:Win", max_turns=6)
    envhub.register("bugs/hash-v0", f"{__name__}:HashOrdered", max_turns=6)
    envhub.register(
        "bugs/fam-v0", f"{__name__}:Win", max_turns=6, variants={"a": {}, "b": {"max_turns": 4}}
    )
