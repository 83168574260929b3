"""Which episodes a step plays, and running them all concurrently (the minimal scheduler).

A *group* is one task (env id + seed) played ``group_size`` times, so GRPO/RLOO can compare
episodes that faced the same map. ``plan_groups`` derives every seed from ``(seed, step)``
alone, so a resumed run plays exactly the episodes the killed run would have;
``plan_eval`` uses a fixed, disjoint seed range, so every evaluation sees the same tasks.

``run_episodes`` starts one ``EnvManager.run`` per episode at once (asyncio; the engine
batches their generation requests) and replaces an episode whose env crashed by replaying
the same task on a fresh env, up to ``max_retries`` times; what still fails is dropped.
The advanced scheduler (async training, staleness bounds, dynamic sampling, redundancy with
abort) replaces this module behind the same ``run_episodes`` signature.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from trainer.errors import RolloutError
from trainer.rollout.env_manager import EnvManager, EnvSource, Sampling
from trainer.rollout.trajectory import Trajectory

__all__ = ["EVAL_SEED_BASE", "EpisodeSpec", "plan_eval", "plan_groups", "run_episodes"]

EVAL_SEED_BASE = 1_000_000_000
"""Evaluation seeds start here; training seeds stay below it."""


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play: which env, which seed, which group it is compared within."""

    env_id: str
    seed: int
    group_id: int


def plan_groups(step: int, *, num_groups: int, group_size: int, env_ids: list[str], seed: int) -> list[EpisodeSpec]:
    """``num_groups * group_size`` episodes for training step ``step`` (deterministic)."""
    specs = []
    for g in range(num_groups):
        group_id = step * num_groups + g
        task_seed = (seed * 7_919 + group_id) % EVAL_SEED_BASE
        specs += [EpisodeSpec(env_ids[group_id % len(env_ids)], task_seed, group_id)] * group_size
    return specs


def plan_eval(episodes: int, *, env_ids: list[str]) -> list[EpisodeSpec]:
    """The fixed evaluation set: ``episodes`` tasks spread round-robin over ``env_ids``."""
    return [EpisodeSpec(env_ids[i % len(env_ids)], EVAL_SEED_BASE + i, i) for i in range(episodes)]


async def run_episodes(specs: list[EpisodeSpec], manager: EnvManager, source: EnvSource, sampling: Sampling,
                       *, max_retries: int = 2) -> tuple[list[Trajectory], list[Trajectory]]:
    """Play ``specs`` concurrently; returns ``(finished, failed)`` trajectories.

    Raises ``RolloutError`` when every episode failed (the env is broken, not flaky).
    """

    async def play(spec: EpisodeSpec) -> tuple[Trajectory, list[Trajectory]]:
        failures: list[Trajectory] = []
        for _ in range(1 + max_retries):
            session = await source.session(spec.env_id)
            try:
                trajectory = await manager.run(session, spec.env_id, spec.seed, sampling, spec.group_id)
            finally:  # closing a crashed env may fail or hang too; the episode is already lost
                await manager.close_session(session)
            if not trajectory.failed:
                return trajectory, failures
            failures.append(trajectory)
        return failures[-1], failures[:-1]

    results = await asyncio.gather(*(play(spec) for spec in specs))
    finished = [t for t, _ in results if not t.failed]
    failed = [f for t, fs in results for f in ([t] if t.failed else []) + fs]
    if specs and not finished:
        reasons = sorted({t.failure or "unknown" for t in failed})[:3]
        raise RolloutError(
            f"all {len(specs)} episodes failed (after {max_retries} retries each); first reasons: {reasons}. "
            "Run `envhub check ENV_ID` to see what breaks the env"
        )
    return finished, failed
