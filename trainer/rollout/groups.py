"""Which episodes a step plays, and running them all concurrently (the minimal scheduler).

A *group* is one task (env id + seed) played ``group_size`` times, so GRPO/RLOO can compare
episodes that faced the same map. ``plan_groups`` derives every seed from ``(seed, step)``
alone, so a resumed run plays exactly the episodes the killed run would have;
``plan_eval`` uses a fixed, disjoint seed range, so every evaluation sees the same tasks.

``play_episode`` plays one episode and replays its task on a fresh env when the env
crashed, up to ``max_retries`` times; the rollout scheduler (``trainer.rollout.scheduler``)
plays every training episode through it. ``run_episodes`` plays a fixed list of episodes
at once (asyncio; the engine batches their generation requests): the evaluation set.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from trainer.errors import RolloutError
from trainer.rollout.env_manager import EnvManager, EnvSource, Sampling
from trainer.rollout.env_output import REWARD_FAILURE
from trainer.rollout.env_workers import EnvWorkers
from trainer.rollout.trajectory import Trajectory

__all__ = [
    "EVAL_SEED_BASE",
    "EpisodeSpec",
    "describe_eval",
    "env_for_group",
    "eval_failures",
    "failure_hint",
    "plan_eval",
    "plan_groups",
    "play_episode",
    "run_episodes",
]

EVAL_SEED_BASE = 1_000_000_000
"""Evaluation seeds start here; training seeds stay below it."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play: which env, which seed, which group it is compared within."""

    env_id: str
    seed: int
    group_id: int


_GOLDEN = (5**0.5 - 1) / 2


def env_for_group(
    number: int, env_ids: Sequence[str], weights: Sequence[float] | None = None
) -> str:
    """The env that group ``number`` of a run plays: round-robin over ``env_ids`` when the
    weights are equal, else by weight through the golden-ratio sequence ``frac(n * 0.618...)``
    (stateless, so a resumed run plays the same envs, and every run of consecutive groups
    holds each env close to its share)."""
    if not weights or len(set(weights)) <= 1:
        return env_ids[number % len(env_ids)]
    point = (number * _GOLDEN) % 1.0 * sum(weights)
    for env_id, weight in zip(env_ids, weights, strict=True):
        if point < weight:
            return env_id
        point -= weight
    return env_ids[-1]


def plan_groups(
    step: int,
    *,
    num_groups: int,
    group_size: int,
    env_ids: list[str],
    seed: int,
    weights: Sequence[float] | None = None,
) -> list[EpisodeSpec]:
    """``num_groups * group_size`` episodes for training step ``step`` (deterministic)."""
    specs = []
    for g in range(num_groups):
        group_id = step * num_groups + g
        task_seed = (seed * 7_919 + group_id) % EVAL_SEED_BASE
        env_id = env_for_group(group_id, env_ids, weights)
        specs += [EpisodeSpec(env_id, task_seed, group_id)] * group_size
    return specs


def plan_eval(
    episodes: int, *, env_ids: list[str], counts: Mapping[str, int] | None = None
) -> list[EpisodeSpec]:
    """The fixed evaluation set: ``episodes`` tasks spread round-robin over the ``env_ids`` that
    have no count of their own in ``counts``, then each counted env's tasks (0: none). Seeds
    count up from ``EVAL_SEED_BASE``, above every training seed."""
    counts = counts or {}
    shared = [env_id for env_id in env_ids if env_id not in counts]
    specs = [
        EpisodeSpec(shared[i % len(shared)], EVAL_SEED_BASE + i, i)
        for i in range(episodes if shared else 0)
    ]
    for env_id in env_ids:
        for _ in range(counts.get(env_id, 0)):
            specs.append(EpisodeSpec(env_id, EVAL_SEED_BASE + len(specs), len(specs)))
    return specs


def describe_eval(specs: Sequence[EpisodeSpec], held_out: Mapping[str, dict] | None = None) -> str:
    """One line on what each evaluation plays (for the run's log): episodes and seeds per env,
    its held-out settings, and that training never plays those seeds."""
    parts = []
    for env_id in dict.fromkeys(spec.env_id for spec in specs):
        seeds = [spec.seed for spec in specs if spec.env_id == env_id]
        settings = f" with {held_out[env_id]}" if held_out and env_id in held_out else ""
        parts.append(f"{env_id}: {len(seeds)} episodes, seeds {min(seeds)}-{max(seeds)}{settings}")
    return "; ".join(parts) + f" (training seeds stay below {EVAL_SEED_BASE})"


async def play_episode(
    manager: EnvManager | EnvWorkers,
    source: EnvSource,
    spec: EpisodeSpec,
    sampling: Sampling,
    *,
    max_retries: int = 2,
    key: str | None = None,
    on_failure: Callable[[Trajectory], None] | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> Trajectory:
    """One episode, replayed on a fresh env (same task) after each failure, ``max_retries``
    times at most; returns the last attempt. A failed attempt that is followed by another
    goes to ``on_failure``; an env that cannot even start is a failed attempt, not an error.

    ``key`` names the episode's requests (attempt ``n`` uses ``{key}a{n}``) so a router can
    abort them all; ``manager.engine.forget(key)`` is called after each attempt when the
    engine has it. ``stop()`` true after an attempt (the group was cancelled) ends the replays.

    ``EnvWorkers`` in place of the manager plays the episode in a worker process, the same
    way (``stop`` is then ``EnvWorkers.stop``).
    """
    if isinstance(manager, EnvWorkers):
        return await manager.play(
            spec, sampling, max_retries=max_retries, key=key, on_failure=on_failure
        )
    trajectory = Trajectory(
        spec.env_id, spec.seed, spec.group_id, failed=True, failure="not started"
    )
    for attempt in range(1 + max_retries):
        attempt_key = None if key is None else f"{key}a{attempt}"
        try:
            session = await source.session(spec.env_id)
        except Exception as error:  # noqa: BLE001 - a broken env start is a recorded failure
            trajectory = Trajectory(
                spec.env_id,
                spec.seed,
                spec.group_id,
                failed=True,
                failure=f"env {spec.env_id!r} start raised {type(error).__name__}: {error}"[:500],
            )
        else:
            try:
                trajectory = await manager.run(
                    session,
                    spec.env_id,
                    spec.seed,
                    sampling,
                    spec.group_id,
                    episode_key=attempt_key,
                )
            finally:  # closing a crashed env may fail or hang too (the manager's timeout bounds it)
                forget = getattr(manager.engine, "forget", None)
                if attempt_key is not None and forget is not None:
                    forget(attempt_key)
                await manager.close_session(session)
        if not trajectory.failed or stop() or attempt == max_retries:
            return trajectory
        if on_failure is not None:
            on_failure(trajectory)
    return trajectory


async def run_episodes(
    specs: list[EpisodeSpec],
    manager: EnvManager | EnvWorkers,
    source: EnvSource,
    sampling: Sampling,
    *,
    max_retries: int = 2,
) -> tuple[list[Trajectory], list[Trajectory]]:
    """Play ``specs`` concurrently (``play_episode`` each); returns ``(finished, failed)``
    trajectories, ``failed`` holding every failed attempt.

    Raises ``RolloutError`` when every episode failed (the env is broken, not flaky).
    """
    failed: list[Trajectory] = []
    results = await asyncio.gather(
        *(
            play_episode(
                manager, source, spec, sampling, max_retries=max_retries, on_failure=failed.append
            )
            for spec in specs
        )
    )
    finished = [t for t in results if not t.failed]
    failed += [t for t in results if t.failed]
    if specs and not finished:
        reasons = sorted({t.failure or "unknown" for t in failed})[:3]
        hint = failure_hint([t.failure or "" for t in failed], sorted({s.env_id for s in specs}))
        raise RolloutError(
            f"all {len(specs)} episodes failed (after {max_retries} retries each); first "
            f"reasons: {reasons}. {hint}"
        )
    return finished, failed


def failure_hint(failures: Sequence[str], env_ids: Sequence[str] = ()) -> str:
    """Where to look, for episodes of ``env_ids`` that failed for ``failures`` (their reasons):
    the agent when every one is the agent's own failure, the reward function when every one is
    its, else the env (``envhub check`` of each id)."""
    agent = ("agent raised", "agent timeout", "the agent returned")  # AgentRunner's reasons
    if failures and all(reason.startswith(agent) for reason in failures):
        return (
            "The agent failed in every episode (its own errors above): fix rollout.agent's "
            "command or callable (docs/train-your-agent.md, 'Limits and errors')"
        )
    if failures and all(reason.startswith(REWARD_FAILURE) for reason in failures):
        return (
            "The reward function failed in every episode (its errors above): fix the scorer "
            "of env.rewards it names"
        )
    checks = " and ".join(f"`envhub check {env_id}`" for env_id in env_ids) or "`envhub check`"
    return f"Run {checks} to see what breaks the env"


def eval_failures(
    specs: Sequence[EpisodeSpec], finished: Sequence[Trajectory], failed: Sequence[Trajectory]
) -> dict[str, float]:
    """What an evaluation lost: ``eval/failed_episodes`` (planned episodes that failed every
    retry; per env too in a mix), with a warning naming the first reason. Such episodes are not
    in the success rate, so a few lost ones would inflate it unseen.

    Raises ``RolloutError`` when none of an env's evaluation episodes finished (its eval kwargs
    or the env itself are broken: a mix would report the other envs only, silently).
    """
    planned = Counter(spec.env_id for spec in specs)
    lost = planned - Counter(t.env_id for t in finished)
    reasons = {t.env_id: t.failure or "unknown" for t in reversed(failed)}  # the first per env
    for env_id, count in lost.items():
        if count == planned[env_id]:
            raise RolloutError(
                f"evaluation of {env_id}: all {count} episodes failed (after retries); first "
                f"reason: {reasons.get(env_id, 'unknown')}. Fix its eval kwargs (env.eval or "
                f"the env's own eval: entry) or run `envhub check {env_id}`"
            )
    if lost:
        _log.warning(
            "evaluation: %d of %d episodes failed every retry and are left out of eval/success "
            "(%s); first reason: %s",
            sum(lost.values()),
            len(specs),
            ", ".join(f"{env_id}: {count}" for env_id, count in sorted(lost.items())),
            reasons.get(min(lost), "unknown"),
        )
    metrics = {"eval/failed_episodes": float(sum(lost.values()))}
    if len(planned) > 1:
        metrics |= {f"eval/{env_id}/failed_episodes": float(lost[env_id]) for env_id in planned}
    return metrics
