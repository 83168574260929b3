"""What a router counts: busy time per engine, requests, tokens, aborts, preemptions, errors.

``EngineRouter`` keeps one ``RouterAccounts``: the counters since the last ``take`` (the
scheduler's per-batch metrics) and the totals since the router was made. An engine is *busy*
while it holds at least one request; its busy time is measured with the router's clock (a
simulation passes its loop's ``time``: ``trainer.rollout.sim_clock``). ``WorkerRouters`` adds
its workers' ``RouterStats`` up (``trainer.rollout.worker_routing``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["COUNTS", "RouterAccounts", "RouterStats"]

COUNTS = ("requests", "new_tokens", "aborted", "preempted", "errors")
"""The integer counters of ``RouterStats`` (what crosses the wire from an env worker)."""


@dataclass
class RouterStats:
    """Counters since the last ``take_stats`` (busy seconds per engine, wall seconds)."""

    wall_s: float = 0.0
    busy_s: list[float] = field(default_factory=list)
    requests: int = 0
    new_tokens: int = 0
    aborted: int = 0
    preempted: int = 0
    errors: int = 0

    @property
    def busy_fraction(self) -> float:
        """Mean over engines of the share of wall time with at least one request in flight."""
        if not self.busy_s or self.wall_s <= 0:
            return 0.0
        return min(1.0, sum(self.busy_s) / (len(self.busy_s) * self.wall_s))


class RouterAccounts:
    """The counters of ``engines`` engines: ``current`` (since the last ``take``) and totals.

    The router adds to ``current``'s counters itself and tells ``busy(i)`` / ``idle(i)`` as
    engine ``i``'s load leaves and returns to zero."""

    def __init__(self, engines: int, clock: Callable[[], float]) -> None:
        self.engines, self.clock = engines, clock
        self.current = RouterStats(busy_s=[0.0] * engines)
        self._busy_since: list[float | None] = [None] * engines
        self._since = clock()
        self._total = RouterStats(busy_s=[0.0] * engines)

    def busy(self, index: int) -> None:
        """Engine ``index`` took its first request."""
        self._busy_since[index] = self.clock()

    def idle(self, index: int) -> None:
        """Engine ``index`` holds no request any more."""
        since = self._busy_since[index]
        if since is not None:
            self.current.busy_s[index] += self.clock() - since
            self._busy_since[index] = None

    def take(self) -> RouterStats:
        """Counters since the previous call (busy time of running requests is split at now)."""
        now = self.clock()
        stats = self.current
        for i, since in enumerate(self._busy_since):
            if since is not None:
                stats.busy_s[i] += now - since
                self._busy_since[i] = now
        stats.wall_s = now - self._since
        self.current, self._since = RouterStats(busy_s=[0.0] * self.engines), now
        total = self._total
        total.wall_s += stats.wall_s
        total.busy_s = [a + b for a, b in zip(total.busy_s, stats.busy_s, strict=True)]
        for name in COUNTS:
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        return stats

    def totals(self) -> RouterStats:
        """Counters since the start (or ``reset``), up to now; ``take`` intervals unchanged."""
        now, total, current = self.clock(), self._total, self.current
        busy = [
            t + c + (now - since if since is not None else 0.0)
            for t, c, since in zip(total.busy_s, current.busy_s, self._busy_since, strict=True)
        ]
        counts = {name: getattr(total, name) + getattr(current, name) for name in COUNTS}
        return RouterStats(wall_s=total.wall_s + now - self._since, busy_s=busy, **counts)

    def reset(self) -> None:
        """Start ``totals`` afresh (from now)."""
        self.take()
        self._total = RouterStats(busy_s=[0.0] * self.engines)
