"""A training batch's row of ``rollout/*`` and ``timing/*`` metrics (``RolloutScheduler``).

What the episodes of the batch look like (turns and policy tokens: mean, p90, max), how far
their oldest tokens lag the policy they are trained at (``rollout/staleness_<lag>``: episodes
per lag), what the engines did since the previous batch (``RouterStats``: busy fraction,
preempted turns, aborts sent, errors), what the scheduler recorded meanwhile (``EVENTS``), and
what the policy played meanwhile (``PlayedGroups``: ``rollout/played_*``).

``train/*`` describes the trained batch only. With ``rollout.dynamic_sampling`` that batch is
what the filter let through (groups whose episodes all got the same reward are dropped: the
better the policy, the more all-win groups it drops, so ``train/success`` falls behind it); with
``rollout.redundancy > 1`` it is the groups that finished first (often the short episodes). The
``rollout/played_*`` figures are the same statistics over every group played since the previous
batch: what the policy really does.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping, Sequence

from trainer.rollout.router_stats import RouterStats
from trainer.rollout.trajectory import Trajectory

__all__ = ["EVENTS", "PlayedGroups", "batch_metrics"]

EVENTS = {
    "aborted_surplus_episodes": "episodes of the sync surplus thrown away (played out or cut)",
    "filtered_groups": "groups dynamic sampling dropped (all rewards equal)",
    "filter_passed_over_limit": "such groups let through (max_filtered_per_batch reached)",
    "failed_attempts": "failed attempts of episodes, replays included, made good or not",
    "lost_episodes": "episodes whose every attempt failed (max_retries replays)",
    "failed_groups": "groups replaced because they lost an episode",
    "stale_dropped_groups": "ready groups dropped, their oldest token beyond max_staleness",
    "stale_aborted_groups": "running groups aborted, unable to meet max_staleness",
}
"""The scheduler's counts since the previous batch, reported in every row (``rollout/<name>``; 0
when none happened), and what each counts."""


class PlayedGroups:
    """The groups played out since the previous batch (``GroupInPlay.played_out``), whatever
    became of them: trained now or in a later batch, filtered, thrown away as surplus or stale.
    Not failed groups. ``take`` gives their row: ``rollout/played_groups``,
    ``rollout/played_episodes`` and, as ``train/*`` defines them (``trainer.metrics.summarise``)
    but over all these episodes, ``rollout/played_success``, ``rollout/played_reward`` (the mean
    episode return) and ``rollout/played_turns`` (when a group was played)."""

    def __init__(self) -> None:
        self.groups = self.episodes = self.wins = self.turns = 0
        self.reward = 0.0
        """Sums over the groups added since the last ``take``."""

    def add(self, trajectories: Sequence[Trajectory]) -> None:
        """A group that played out, its episodes ``trajectories``."""
        self.groups += 1
        self.episodes += len(trajectories)
        self.wins += sum(t.success for t in trajectories)
        self.turns += sum(t.num_turns for t in trajectories)
        self.reward += sum(t.episode_reward for t in trajectories)

    def take(self) -> dict[str, float]:
        """The row of the groups added since the last ``take`` (then forgotten)."""
        row = {"rollout/played_groups": float(self.groups)}
        row["rollout/played_episodes"] = float(self.episodes)
        if self.episodes:
            row["rollout/played_success"] = self.wins / self.episodes
            row["rollout/played_reward"] = self.reward / self.episodes
            row["rollout/played_turns"] = self.turns / self.episodes
        self.groups = self.episodes = self.wins = self.turns = 0
        self.reward = 0.0
        return row


def batch_metrics(
    trajectories: Sequence[Trajectory],
    stats: RouterStats,
    events: collections.Counter[str],
    *,
    in_play: Mapping[str, float],
    played: PlayedGroups,
    version: int,
    max_staleness: int,
    weight_pause_s: float,
) -> dict[str, float]:
    """The row of a batch of ``trajectories`` trained at ``version``: ``stats`` are the engines'
    counters since the previous batch, ``events`` the scheduler's (taken: the ``EVENTS`` are
    popped), ``in_play`` its gauges now (groups ready, running, ...), ``played`` the groups played
    out since the previous batch (taken: ``rollout/played_*``). A staleness column for
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
    metrics |= played.take()
    lags = collections.Counter(
        version - (oldest if (oldest := t.oldest_version) is not None else version)
        for t in trajectories
    )
    for lag in range(max(max_staleness, max(lags, default=0)) + 1):
        metrics[f"rollout/staleness_{lag}"] = float(lags.get(lag, 0))
    return metrics
