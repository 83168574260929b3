"""A training batch's row of ``rollout/*`` and ``timing/*`` metrics (``RolloutScheduler``).

What the episodes of the batch look like (turns and policy tokens: mean, p90, max), how far
their oldest tokens lag the policy they are trained at (``rollout/staleness_<lag>``: episodes
per lag), what the engines did since the previous batch (``RouterStats``: busy fraction,
preempted turns, aborts sent, errors) and what the scheduler recorded meanwhile (``EVENTS``).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping, Sequence

from trainer.rollout.router_stats import RouterStats
from trainer.rollout.trajectory import Trajectory

__all__ = ["EVENTS", "batch_metrics"]

EVENTS = (
    "aborted_surplus",
    "filtered_groups",
    "failed_episodes",
    "failed_groups",
    "stale_dropped_groups",
    "stale_aborted_groups",
    "filter_passed_over_limit",
)
"""The scheduler's counts reported in every row (``rollout/<name>``; 0 when none happened)."""


def batch_metrics(
    trajectories: Sequence[Trajectory],
    stats: RouterStats,
    events: collections.Counter[str],
    *,
    in_play: Mapping[str, float],
    version: int,
    max_staleness: int,
    weight_pause_s: float,
) -> dict[str, float]:
    """The row of a batch of ``trajectories`` trained at ``version``: ``stats`` are the engines'
    counters since the previous batch, ``events`` the scheduler's (taken: the ``EVENTS`` are
    popped), ``in_play`` its gauges now (groups ready, running, ...). A staleness column for
    every lag up to ``max_staleness`` (and any beyond it), so a run's columns do not vary."""
    turns = sorted(t.num_turns for t in trajectories)
    tokens = sorted(t.num_policy_tokens for t in trajectories)
    metrics: dict[str, float] = {
        # wall-clock measures: timing/
        "timing/engine_busy_frac": round(stats.busy_fraction, 4),
        "timing/weight_pause_s": round(weight_pause_s, 4),
        **in_play,
        "rollout/turns_mean": statistics.fmean(turns),
        "rollout/turns_p90": float(turns[int(0.9 * (len(turns) - 1))]),
        "rollout/turns_max": float(turns[-1]),
        "rollout/policy_tokens_mean": statistics.fmean(tokens),
        "rollout/policy_tokens_p90": float(tokens[int(0.9 * (len(tokens) - 1))]),
        "rollout/policy_tokens_max": float(tokens[-1]),
        "rollout/preempted_turns": float(stats.preempted),
        "rollout/engine_aborts": float(stats.aborted),
        "rollout/engine_errors": float(stats.errors),
    }
    for name in EVENTS:
        metrics[f"rollout/{name}"] = float(events.pop(name, 0))
    lags = collections.Counter(
        version - (oldest if (oldest := t.oldest_version) is not None else version)
        for t in trajectories
    )
    for lag in range(max(max_staleness, max(lags, default=0)) + 1):
        metrics[f"rollout/staleness_{lag}"] = float(lags.get(lag, 0))
    return metrics
