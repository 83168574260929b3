"""Prometheus metrics of one hub, on a registry of its own (several hubs may share a process).

Per-step work is one counter increment and one histogram observation; pool figures
(workers alive, restarts, failed episodes) are read from the pools at scrape time.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from envhub.server.wire import ErrorCode

__all__ = ["HubMetrics"]

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


class _PoolCollector:
    def __init__(self, pools: Callable[[], dict[str, Any]]) -> None:
        self.pools = pools

    def collect(self) -> Any:
        alive = GaugeMetricFamily(
            "envhub_workers_alive", "Env workers running, per env.", labels=["env"]
        )
        episodes = GaugeMetricFamily(
            "envhub_pool_episodes", "Open episodes in the pool, per env.", labels=["env"]
        )
        restarts = CounterMetricFamily(
            "envhub_worker_restarts", "Workers replaced after a crash or hang.", labels=["env"]
        )
        failures = CounterMetricFamily(
            "envhub_episode_failures",
            "Episodes lost to a crash, hang or env error.",
            labels=["env"],
        )
        for env_id, pool in self.pools().items():
            stats = pool.stats()
            alive.add_metric([env_id], stats.workers_alive)
            episodes.add_metric([env_id], stats.episodes)
            restarts.add_metric([env_id], stats.worker_restarts)
            failures.add_metric([env_id], stats.failures)
        yield from (alive, episodes, restarts, failures)


class _StepMetrics:
    """Steps and step latency per env: plain ints updated on the hot path, exported at scrape time.

    ``prometheus_client``'s ``Histogram.observe`` walks every bucket under a lock; this keeps
    one list of counts per env and finds the bucket by bisection, which matters at 10k+ steps/s.
    Updates and scrapes both run on the hub's event loop, so no lock is needed.
    """

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, env_id: str, seconds: float) -> None:
        counts = self.counts.get(env_id)
        if counts is None:
            counts = self.counts[env_id] = [0] * (len(_LATENCY_BUCKETS) + 1)
            self.sums[env_id] = 0.0
        counts[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        self.sums[env_id] += seconds

    def collect(self) -> Any:
        steps = CounterMetricFamily("envhub_steps", "Env steps applied, per env.", labels=["env"])
        latency = HistogramMetricFamily(
            "envhub_step_latency_seconds", "Step latency seen by the hub, per env.", labels=["env"]
        )
        for env_id, counts in list(self.counts.items()):
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, _LATENCY_BUCKETS), "+Inf"], counts):
                cumulative += count
                buckets.append((bound, cumulative))
            steps.add_metric([env_id], cumulative)
            latency.add_metric([env_id], buckets, self.sums[env_id])
        yield steps
        yield latency


class HubMetrics:
    """The hub's counters, gauges and histograms."""

    def __init__(
        self, pools: Callable[[], dict[str, Any]], sessions: Callable[[], tuple[int, int]]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sessions_gauge = Gauge(
            "envhub_sessions", "Open sessions by state.", ["state"], registry=r
        )
        self.sessions_opened = Counter("envhub_sessions_opened", "Sessions opened.", registry=r)
        self.sessions_closed = Counter(
            "envhub_sessions_closed", "Sessions closed, by reason.", ["reason"], registry=r
        )
        self.resumes = Counter(
            "envhub_session_resumes", "Sessions resumed after a dropped socket.", registry=r
        )
        self.steps_per_second = Gauge(
            "envhub_steps_per_second", "Steps per second over the last few seconds.", registry=r
        )
        self.errors = Counter("envhub_errors", "Error replies sent, by code.", ["code"], registry=r)
        self.rejected = Counter(
            "envhub_rejected_connections", "Connections refused, by reason.", ["reason"], registry=r
        )
        for code in get_args(ErrorCode):  # every series exists from the start, at 0
            self.errors.labels(code)
        r.register(_PoolCollector(pools))
        self.step_metrics = _StepMetrics()
        r.register(self.step_metrics)
        self._sessions = sessions
        self._last = (time.monotonic(), 0.0)
        self._steps_total = 0

    def tick(self) -> None:
        """Refresh the gauges (called about once a second by the hub)."""
        attached, detached = self._sessions()
        self.sessions_gauge.labels("attached").set(attached)
        self.sessions_gauge.labels("detached").set(detached)
        now = time.monotonic()
        then, steps_then = self._last
        if now - then >= 1.0:
            self.steps_per_second.set((self._steps_total - steps_then) / (now - then))
            self._last = (now, self._steps_total)

    def step_done(self, env_id: str, seconds: float) -> None:
        self._steps_total += 1
        self.step_metrics.observe(env_id, seconds)

    def render(self) -> bytes:
        self.tick()
        return generate_latest(self.registry)
