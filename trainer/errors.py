"""The exceptions the trainer raises.

Every message says what failed, the offending value, and how to fix it; tests pin the
wording of the ones users meet first (config typos, impossible device mappings, a worker
that crashed, a checkpoint that cannot be read). Problems found by validation are collected
and raised together, so a user fixes a config in one round trip.

    TrainerError
    ├── ConfigError            the config tree is invalid (lists every problem with its path)
    ├── DeviceMappingError     roles cannot be placed on the devices (lists every problem)
    ├── DispatchError          a cluster call is malformed (unregistered method, bad batch split)
    ├── WorkerCallError        a worker method raised; names role, rank and method
    ├── CheckpointError        no usable checkpoint, or one that cannot be read
    ├── ModelError             a model/tokenizer path or spec that cannot be loaded or built
    ├── RolloutError           no usable episodes (every env crashed), a bad generation request
    ├── RewardError            a reward function or judge is misconfigured
    └── NonFiniteLossError     a loss became NaN/inf; training stops, the last checkpoint is kept

Other trainer modules add their own subclasses of ``TrainerError`` here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeviceMappingError",
    "DispatchError",
    "ModelError",
    "NonFiniteLossError",
    "Problem",
    "RewardError",
    "RolloutError",
    "TrainerError",
    "WorkerCallError",
]


class TrainerError(Exception):
    """Base class of every error the trainer raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One validation finding: the dotted config path it concerns and what is wrong there.

    ``where`` optionally says where the value came from (``"quickstart.yaml:7"`` or
    ``"override 'train.lr=x'"``) so the user can find it.
    """

    path: str
    message: str
    where: str | None = None

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        return f"{text} (at {self.where})" if self.where else text


class _ProblemsError(TrainerError):
    """An error that carries a list of :class:`Problem` and prints one per line."""

    headline = "invalid"

    def __init__(self, problems: list[Problem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        n = len(self.problems)
        source = f" {self.source}" if self.source else ""
        head = f"{self.headline}{source}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


class ConfigError(_ProblemsError, ValueError):
    """The trainer config is invalid; ``.problems`` lists every problem with its dotted path."""

    headline = "invalid trainer config"


class DeviceMappingError(_ProblemsError, ValueError):
    """The roles' ``device_mapping`` cannot be realised; ``.problems`` lists all problems."""

    headline = "impossible device mapping"


class DispatchError(TrainerError, TypeError):
    """A cluster call cannot be dispatched (method not registered, batch cannot be split)."""


class WorkerCallError(TrainerError, RuntimeError):
    """A worker method raised. The worker's exception is chained as ``__cause__``."""

    def __init__(self, role: str, rank: int, method: str, detail: str) -> None:
        self.role, self.rank, self.method = role, rank, method
        super().__init__(f"{role} worker rank {rank} failed in {method}(): {detail}")


class CheckpointError(TrainerError, OSError):
    """No usable checkpoint was found, or one could not be read or written."""


class ModelError(TrainerError, ValueError):
    """A model or tokenizer cannot be loaded or built (missing path, no chat template)."""


class RolloutError(TrainerError, RuntimeError):
    """A rollout could not produce usable episodes (e.g. every env crashed)."""


class RewardError(TrainerError, ValueError):
    """A reward function, verifier or judge is misconfigured (unknown name, bad domain route)."""


class NonFiniteLossError(TrainerError, FloatingPointError):
    """A loss or gradient became NaN/inf; training stops and the last good checkpoint is kept."""
