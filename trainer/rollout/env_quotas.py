"""Each env's share of a trained batch: ``EnvQuotas``, the scheduler's count per env.

A run over a mix of envs trains every env at its weight. ``plan_groups`` partitions a step's
``num_groups`` groups over the envs by weight (``groups.env_for_group``); a batch of the rollout
scheduler holds the same partition, its *quota*: the envs of the group numbers of its step's
window, ``[first, first + num_groups)``, the window moving on by ``num_groups`` per batch (the
scheduler's first window is step 1's). So every env gets its weight's share of the trained
groups however fast its episodes end, whatever the redundancy or the dynamic sampling (else the
surplus that is thrown away would be the slow env's groups, and a mix would train mostly its
fast env):

- a batch takes, per env, its quota of that env's ready groups (more ready groups of an env wait
  for a later batch, or are the ``sync`` surplus);
- a new group plays its own env (``env_for_group`` of its number, as ``plan_groups`` would)
  while that env has fewer groups in play than its quota; else the env furthest below its quota
  (a replacement for a failed, filtered or stale group goes to the env that lost it); else, once
  every quota is covered (a redundant group, or ``async``'s groups for the next batches), the env
  with the fewest groups in play per group of quota.

"In play" counts the running and ready groups of an env, not cancelled ones. A single env's
quota is the whole batch: one env plays exactly as it would without quotas.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from trainer.rollout.groups import env_for_group

__all__ = ["EnvQuotas"]


class _Played(Protocol):
    env_id: str


G = TypeVar("G", bound=_Played)


class EnvQuotas:
    """Quotas per env of the next batch and groups in play per env (module docstring).

    ``first_group``: the first group number of the first batch's window."""

    def __init__(
        self,
        env_ids: Sequence[str],
        weights: Sequence[float],
        num_groups: int,
        *,
        first_group: int,
    ) -> None:
        self.env_ids, self.weights, self.num_groups = tuple(env_ids), tuple(weights), num_groups
        self.first = first_group
        """The first group number of the next batch's window."""
        self.in_play: collections.Counter[str] = collections.Counter()
        """Per env: its groups running or ready (``started`` minus ``ended``)."""
        self._quota: tuple[int, collections.Counter[str]] = (-1, collections.Counter())

    def quota(self) -> collections.Counter[str]:
        """Groups of each env the next batch takes (they add up to ``num_groups``)."""
        if self._quota[0] != self.first:
            window = range(self.first, self.first + self.num_groups)
            envs = (env_for_group(n, self.env_ids, self.weights) for n in window)
            self._quota = (self.first, collections.Counter(envs))
        return self._quota[1]

    def next_window(self) -> None:
        """A batch was taken: the next one's quota is the next step's partition."""
        self.first += self.num_groups

    def restart(self, first_group: int) -> None:
        """Windows go on from ``first_group`` (a resumed run's task counter)."""
        self.first = first_group

    def env_for(self, number: int) -> str:
        """The env new group ``number`` plays (module docstring)."""
        planned = env_for_group(number, self.env_ids, self.weights)
        if len(self.env_ids) == 1:
            return planned
        quota, in_play = self.quota(), self.in_play
        if in_play[planned] < quota[planned]:
            return planned
        short = max(self.env_ids, key=lambda env_id: quota[env_id] - in_play[env_id])
        if in_play[short] < quota[short]:
            return short
        return min(
            (env_id for env_id in self.env_ids if quota[env_id]),
            key=lambda env_id: in_play[env_id] / quota[env_id],
        )

    def started(self, env_id: str) -> None:
        self.in_play[env_id] += 1

    def ended(self, env_id: str) -> None:
        """A group of ``env_id`` left play: taken, failed, filtered, dropped or cancelled."""
        self.in_play[env_id] -= 1

    def met(self, ready: Sequence[_Played]) -> bool:
        """Whether ``ready`` holds every env's quota."""
        if len(ready) < self.num_groups:
            return False
        counts = collections.Counter(group.env_id for group in ready)
        return all(counts[env_id] >= n for env_id, n in self.quota().items())

    def take(self, ready: Iterable[G]) -> tuple[list[G], list[G]]:
        """``(batch, rest)``: the first groups of ``ready`` (in its order) up to each env's quota,
        and the others, in order."""
        left = collections.Counter(self.quota())
        batch: list[G] = []
        rest: list[G] = []
        for group in ready:
            if left[group.env_id] > 0:
                left[group.env_id] -= 1
                batch.append(group)
            else:
                rest.append(group)
        return batch, rest
