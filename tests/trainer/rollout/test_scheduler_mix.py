"""What a trained batch holds: with a mix of envs each env's share of every batch is its
weight's (the step's groups partitioned as ``plan_groups`` partitions them), whatever the envs'
speeds, with redundancy, dynamic sampling and in ``async``; and a batch's groups come in group
order, not in the order they finished (gradient accumulation sums them in that order).
Simulated engines on a virtual clock (``trainer.rollout.sim_clock``): nothing here asserts on
time."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest

import envhub
from tests.trainer.rollout import sim_workload as w
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import LocalEnvSource, Sampling
from trainer.rollout.env_quotas import EnvQuotas
from trainer.rollout.groups import env_for_group, plan_groups
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutBatch, RolloutScheduler, SchedulerConfig

FLAT_EVERY = 3
"""Task seeds divisible by this earn every episode the same reward (dynamic sampling drops
their groups)."""


class TurnsEnv(envhub.TextEnv):
    """``turns`` turns of 8 tokens each, then done. The reward is the instance's parity (the
    episodes of a group differ), or 0 on a task seed divisible by ``FLAT_EVERY``."""

    made = 0

    def __init__(self, turns: int) -> None:
        super().__init__(max_turns=10)
        TurnsEnv.made += 1
        self.instance, self.turns, self.seed_value = TurnsEnv.made, turns, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[override]
        self.seed_value = int(seed or 0)
        return super().reset(seed=seed, options=options)

    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "Say anything.", {"max_new_tokens": 8}

    def on_step(self, action: str) -> envhub.Turn:
        done = self.turn >= self.turns
        flat = self.seed_value % FLAT_EVERY == 0
        reward = 0.0 if flat or not done else float(self.instance % 2)
        return envhub.Turn("ok", reward=reward, terminated=done, info={"max_new_tokens": 8})


def batches(
    cfg: SchedulerConfig, turns: dict[str, int], count: int, first_group: int
) -> list[RolloutBatch]:
    """``count`` batches of ``cfg`` (a weight update after each); ``turns``: each env's turns
    per episode."""

    def make(env_id: str, **kwargs: Any) -> TurnsEnv:
        return TurnsEnv(turns[env_id])

    async def go() -> list[RolloutBatch]:
        engines = w.engines(2)
        router = EngineRouter(engines, clock=asyncio.get_running_loop().time)
        source = LocalEnvSource(make=make)
        sched = RolloutScheduler(
            cfg, w.manager(router), router, source, Sampling(64), first_group=first_group
        )
        taken = []
        try:
            for _ in range(count):
                taken.append(await sched.next_batch())
                await sched.update_weights({})
        finally:
            await sched.close()
            for engine in engines:
                await engine.close()
        return taken

    return sim_clock.run(go())


def groups_per_env(batch: RolloutBatch) -> collections.Counter[str]:
    groups = {(t.group_id, t.env_id) for t in batch.trajectories}
    return collections.Counter(env_id for _, env_id in groups)


@pytest.mark.parametrize(
    ("mode", "redundancy", "dynamic_sampling", "weights"),
    [
        ("sync", 2.0, False, (1.0, 1.0)),
        ("sync", 1.5, True, (3.0, 1.0)),
        ("async", 1.5, False, (1.0, 1.0)),
        ("async", 1.25, True, (1.0, 2.0)),
    ],
)
def test_every_batch_of_a_mix_holds_each_envs_weighted_share_of_its_groups(
    mode: str, redundancy: float, dynamic_sampling: bool, weights: tuple[float, float]
) -> None:
    """A fast env (one turn) and a slow one (five): the fast env's groups finish first, and
    redundancy or dynamic sampling must not let them take the slow env's share of the batch."""
    num_groups, ids = 4, ("acme/fast-v0", "acme/slow-v0")
    cfg = SchedulerConfig(
        num_groups,
        2,
        ids,
        env_weights=weights,
        mode=mode,  # type: ignore[arg-type]
        redundancy=redundancy,
        dynamic_sampling=dynamic_sampling,
        max_staleness=1,
    )
    taken = batches(cfg, {ids[0]: 1, ids[1]: 5}, count=4, first_group=num_groups)
    for step, batch in enumerate(taken, start=1):
        planned = plan_groups(
            step, num_groups=num_groups, group_size=1, env_ids=list(ids), seed=0, weights=weights
        )
        assert groups_per_env(batch) == collections.Counter(s.env_id for s in planned), step
        assert len(batch.trajectories) == 2 * num_groups and not batch.failed


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_batchs_groups_come_in_group_order_not_finishing_order(mode: str) -> None:
    """Every fourth task takes five turns, the others one: the slow group finishes last but
    keeps its place by number, so a run and its resumed copy sum gradients in one order."""
    env = "acme/steps-v0"
    cfg = SchedulerConfig(4, 2, (env,), mode=mode, max_staleness=1)  # type: ignore[arg-type]

    class Every4th(TurnsEnv):
        def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            self.turns = 5 if self.seed_value % 4 == 0 else 1
            return super().on_reset(options)

    def make(env_id: str, **kwargs: Any) -> TurnsEnv:
        return Every4th(1)

    async def go() -> list[RolloutBatch]:
        engines = w.engines(1)
        router = EngineRouter(engines, clock=asyncio.get_running_loop().time)
        sched = RolloutScheduler(
            cfg, w.manager(router), router, LocalEnvSource(make=make), Sampling(64)
        )
        taken = []
        try:
            for _ in range(3):
                taken.append(await sched.next_batch())
                await sched.update_weights({})
        finally:
            await sched.close()
            await engines[0].close()
        return taken

    for batch in sim_clock.run(go()):
        group_ids = [t.group_id for t in batch.trajectories]
        assert any(group_id % 4 == 0 for group_id in group_ids)  # a slow group is in it
        assert group_ids == sorted(group_ids)


def test_a_resumed_mix_takes_the_quota_of_the_step_it_resumes_at() -> None:
    """A checkpoint's task counter runs ahead of its step's plan once groups were replaced or
    started beyond it: the resumed batch holds the resumed step's partition, not the counter's."""
    ids, weights = ("acme/fast-v0", "acme/slow-v0"), (3.0, 1.0)
    cfg = SchedulerConfig(4, 2, ids, env_weights=weights, mode="sync", redundancy=1.5)

    async def go() -> RolloutBatch:
        engines = w.engines(1)
        router = EngineRouter(engines, clock=asyncio.get_running_loop().time)
        source = LocalEnvSource(make=lambda env_id, **kwargs: TurnsEnv(1))
        sched = RolloutScheduler(cfg, w.manager(router), router, source, Sampling(64))
        await sched.restart_from(101, window=8)  # step 2 (groups 8-11), its counter at 101
        batch = await sched.next_batch()
        await sched.close()
        await engines[0].close()
        return batch

    batch = sim_clock.run(go())
    planned = plan_groups(2, num_groups=4, group_size=1, env_ids=list(ids), seed=0, weights=weights)
    assert groups_per_env(batch) == collections.Counter(s.env_id for s in planned)
    assert min(t.group_id for t in batch.trajectories) >= 101


def test_planned_groups_play_their_own_envs_and_a_replacement_the_env_that_lost_a_group() -> None:
    fast, slow = ids = ("acme/fast-v0", "acme/slow-v0")
    weights = (1.0, 2.0)
    quotas = EnvQuotas(ids, weights, 4, first_group=8)
    assert quotas.quota() == {fast: 1, slow: 3}
    started = [quotas.env_for(n) for n in range(8, 12)]  # the step's plan, as plan_groups has it
    for env_id in started:
        quotas.started(env_id)
    assert started == [env_for_group(n, ids, weights) for n in range(8, 12)]
    quotas.ended(slow)  # a slow group failed: its replacement plays the slow env
    number = next(n for n in range(12, 40) if env_for_group(n, ids, weights) == fast)
    assert quotas.env_for(number) == slow
    quotas.started(slow)
    redundant = []  # every quota covered: redundant groups go by share
    for n in range(number + 1, number + 5):
        redundant.append(quotas.env_for(n))
        quotas.started(redundant[-1])
    assert collections.Counter(redundant) == {fast: 1, slow: 3}
