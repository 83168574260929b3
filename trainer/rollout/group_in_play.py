"""``GroupInPlay``: one group as the rollout scheduler (``trainer.rollout.scheduler``) tracks it,
from its start to its end: the task, one asyncio task per episode, the policy version it started
under, and what became of it (cancelled, counted in its env's groups in play).

A group *played out* when every episode ended on its own: none was cancelled or raised, none
failed (an abort that cut an episode short ends it ``failed``, as an env that crashed through
every replay does). Such a group was played by the policy whatever the scheduler then did with
it (trained, filtered, thrown away as surplus or as stale): ``rollout/played_*`` counts it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from trainer.rollout.trajectory import Trajectory

__all__ = ["GroupInPlay"]


@dataclass
class GroupInPlay:
    """A group the scheduler started (see the module docstring)."""

    number: int
    env_id: str
    seed: int
    tasks: list[asyncio.Task[Trajectory]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    started_version: int = 0
    """Policy version when the group started: no token of it is older."""
    finished_at: float = 0.0
    cancelled: bool = False
    counted: bool = False
    """Counted among its env's groups in play (``EnvQuotas.in_play``): running or ready."""
    _oldest: list[int | None] = field(default_factory=list, repr=False)
    """``[oldest_version()]`` once computed."""

    def trajectories(self) -> list[Trajectory]:
        return [task.result() for task in self.tasks]

    def played_out(self) -> bool:
        """Every episode ended on its own (module docstring); asked once the group ended."""
        ended = all(t.done() and not t.cancelled() and t.exception() is None for t in self.tasks)
        return ended and not any(t.failed for t in self.trajectories())

    def oldest_version(self) -> int | None:
        """The oldest policy version among its tokens (asked of finished groups only, whose
        trajectories no longer change: computed once)."""
        if not self._oldest:
            versions = [v for t in self.trajectories() if (v := t.oldest_version) is not None]
            self._oldest.append(min(versions) if versions else None)
        return self._oldest[0]
