"""What a batch's ``rollout/*`` row says was played beside the trained groups: with dynamic
sampling or redundancy the trained groups are a filtered or a first-finished sample, so the row
also reports every group that ran to its end since the previous batch (``rollout/played_*``);
and failed attempts that a replay made good are told apart from episodes that were lost.
Simulated engines on a virtual clock (``trainer.rollout.sim_clock``): nothing here asserts on
time."""

from __future__ import annotations

import asyncio
import collections
import statistics
from typing import Any, ClassVar

import pytest

import envhub
from tests.trainer.rollout import sim_workload as w
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import LocalEnvSource, Sampling
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutBatch, RolloutScheduler, SchedulerConfig


class OutcomeEnv(envhub.TextEnv):
    """One turn of ten tokens (every group ends in the same engine step), won or lost as
    ``wins(seed, reset_number)`` says (resets are counted per task seed: a group's episodes start
    together, so they get the first numbers of a seed). Each ended episode is recorded in
    ``ended``; ``crashes(seed, reset_number)`` makes the env raise on its step."""

    ended: ClassVar[list[tuple[int, bool, float]]] = []
    resets: ClassVar[collections.Counter[int]] = collections.Counter()
    wins: Any = staticmethod(lambda seed, reset_number: False)
    crashes: Any = staticmethod(lambda seed, reset_number: False)

    def __init__(self) -> None:
        super().__init__(max_turns=10)
        self.seed_value, self.reset_number = 0, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[override]
        self.seed_value = int(seed or 0)
        OutcomeEnv.resets[self.seed_value] += 1
        self.reset_number = OutcomeEnv.resets[self.seed_value]
        return super().reset(seed=seed, options=options)

    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "Say anything.", {"max_new_tokens": 10}

    def on_step(self, action: str) -> envhub.Turn:
        if self.crashes(self.seed_value, self.reset_number):
            raise RuntimeError("simulated env crash")
        won = bool(self.wins(self.seed_value, self.reset_number))
        OutcomeEnv.ended.append((self.seed_value, won, float(won)))
        return envhub.Turn("ok", reward=float(won), terminated=True, success=won)


@pytest.fixture(autouse=True)
def fresh_env_records() -> None:
    OutcomeEnv.ended, OutcomeEnv.resets = [], collections.Counter()
    OutcomeEnv.wins = staticmethod(lambda seed, reset_number: False)
    OutcomeEnv.crashes = staticmethod(lambda seed, reset_number: False)


def batches(cfg: SchedulerConfig, count: int) -> list[tuple[RolloutBatch, list[Any]]]:
    """``count`` batches of ``cfg`` (a weight update after each), each with the episodes the
    env saw end since the previous batch."""

    async def go() -> list[tuple[RolloutBatch, list[Any]]]:
        engines = w.engines(1)
        router = EngineRouter(engines, clock=asyncio.get_running_loop().time)
        source = LocalEnvSource(make=lambda env_id, **kwargs: OutcomeEnv())
        sched = RolloutScheduler(cfg, w.manager(router), router, source, Sampling(64))
        taken = []
        try:
            for _ in range(count):
                batch = await sched.next_batch()
                taken.append((batch, OutcomeEnv.ended))
                OutcomeEnv.ended = []
                await sched.update_weights({})
        finally:
            await sched.close()
            for engine in engines:
                await engine.close()
        return taken

    return sim_clock.run(go())


def success(batch: RolloutBatch) -> float:
    return statistics.fmean(t.success for t in batch.trajectories)


def test_with_dynamic_sampling_the_row_reports_the_success_of_the_filtered_groups_too() -> None:
    """Tasks with an even seed are lost by every episode, so dynamic sampling drops their groups
    (no signal); one episode of each other group wins. The trained batch reads 50% success,
    while the policy lost every episode of half the groups it played: ``rollout/played_*``."""
    OutcomeEnv.wins = staticmethod(lambda seed, reset_number: seed % 2 == 1 and reset_number == 1)
    cfg = SchedulerConfig(2, 2, ("t/p-v0",), mode="sync", dynamic_sampling=True)
    for batch, ended in batches(cfg, 2):
        metrics = batch.metrics
        assert success(batch) == 0.5 and metrics["rollout/filtered_groups"] >= 1
        assert (
            metrics["rollout/played_episodes"]
            == len(ended)
            == len(batch.trajectories) + (2 * metrics["rollout/filtered_groups"])
        )
        assert metrics["rollout/played_groups"] == 2 + metrics["rollout/filtered_groups"]
        assert metrics["rollout/played_success"] == pytest.approx(
            statistics.fmean(won for _, won, _ in ended)
        )
        assert metrics["rollout/played_success"] < 0.5
        assert metrics["rollout/played_reward"] == pytest.approx(
            statistics.fmean(reward for _, _, reward in ended)
        )
        assert metrics["rollout/played_turns"] == 1.0


def test_with_redundancy_the_row_reports_the_surplus_groups_that_ran_to_their_end() -> None:
    """Redundancy 2: four groups play for a batch of two, and all four end in the same engine
    step. Two are trained, the other two are thrown away, but they were played: the row counts
    all eight episodes and their success, whichever two groups were taken."""
    OutcomeEnv.wins = staticmethod(lambda seed, reset_number: seed >= 2)
    cfg = SchedulerConfig(2, 2, ("t/p-v0",), mode="sync", redundancy=2.0)
    [(batch, ended)] = batches(cfg, 1)
    metrics = batch.metrics
    assert len(batch.trajectories) == 4 and len(ended) == 8
    assert metrics["rollout/aborted_surplus_episodes"] == 4  # two ready groups of two
    assert metrics["rollout/played_episodes"] == 8 and metrics["rollout/played_groups"] == 4
    assert metrics["rollout/played_success"] == 0.5
    assert metrics["rollout/played_reward"] == 0.5


def test_each_row_counts_only_the_groups_played_since_the_previous_batch() -> None:
    cfg = SchedulerConfig(2, 2, ("t/p-v0",), mode="sync", redundancy=2.0)
    rows = [batch.metrics for batch, _ in batches(cfg, 3)]
    assert [row["rollout/played_episodes"] for row in rows] == [8, 8, 8]


def test_a_failed_attempt_made_good_by_its_replay_is_not_a_lost_episode() -> None:
    """Seed 1's first attempts crash and their replays succeed; seed 2 crashes on every attempt
    (two replays), so its group is replaced. Every attempt that failed is counted, but only
    seed 2's two episodes were lost."""

    def crashes(seed: int, reset_number: int) -> bool:
        return seed == 2 or (seed == 1 and reset_number <= 2)

    OutcomeEnv.crashes = staticmethod(crashes)
    cfg = SchedulerConfig(3, 2, ("t/p-v0",), mode="sync", max_retries=2)
    [(batch, _)] = batches(cfg, 1)
    metrics = batch.metrics
    assert sorted({t.seed for t in batch.trajectories}) == [0, 1, 3]  # 2 replaced by 3
    assert metrics["rollout/failed_attempts"] == 2 + 2 * 3 == len(batch.failed)
    assert metrics["rollout/lost_episodes"] == 2
    assert metrics["rollout/failed_groups"] == 1
    assert "rollout/failed_episodes" not in metrics  # the old name counted attempts
    assert metrics["rollout/played_episodes"] == 6  # the failed group was not played out
