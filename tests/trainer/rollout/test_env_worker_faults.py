"""Faults that are not the episode's own must not fail it: a weight update that holds turns
longer than ``rollout.generate_timeout_s`` (the turns are paused, not late), and an env worker
killed by another episode's env (its co-hosted episodes are replayed on the replacement)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.rollout.sim_workload import (
    DYING_SEED,
    budgets,
    engines,
    manager,
    source,
    worker_setup,
)
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import Sampling
from trainer.rollout.env_workers import EnvWorkers
from trainer.rollout.groups import EpisodeSpec
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.trajectory import Trajectory

TIMEOUT_S = 2.0  # simulated seconds; turns take well under one
LOAD_S = 10.0  # simulated seconds a weight load holds the paused turns
SAMPLING = Sampling(64)
HANG_GUARD_S = 100_000.0  # simulated: turns a hang into a failure; nothing asserts on time


def run_simulated(coro: Any) -> Any:
    return sim_clock.run(asyncio.wait_for(coro, HANG_GUARD_S))


def slow_load(seconds: float) -> Any:
    """A weight sync (run in a thread while the router is paused) that takes ``seconds``."""
    loop = asyncio.get_running_loop()
    return lambda: loop.skip(seconds)  # type: ignore[attr-defined]


def test_turns_held_by_a_weight_update_slower_than_the_timeout_do_not_fail() -> None:
    """Async mode: every update preempts the turns in flight and holds them for LOAD_S; none of
    them is late, so every episode is trained and none fails."""

    async def main() -> list[tuple[int, int]]:
        router = EngineRouter(engines(1), clock=asyncio.get_running_loop().time)
        config = SchedulerConfig(4, 2, ("t/planned-v0",), mode="async", max_staleness=1)
        scheduler = RolloutScheduler(
            config, manager(router, generate_timeout_s=TIMEOUT_S), router, source(), Sampling(64)
        )
        counts = []
        for _ in range(4):
            batch = await scheduler.next_batch()
            counts.append((len(batch.trajectories), len(batch.failed)))
            await scheduler.update_weights(slow_load(LOAD_S))
        await scheduler.close()
        return counts

    assert run_simulated(main()) == [(8, 0)] * 4


def test_a_turn_that_stalls_after_a_weight_update_still_times_out() -> None:
    """The pause does not count; the engine's silence after it does."""

    async def main() -> Any:
        [sim] = engines(1)
        router = EngineRouter([sim], clock=asyncio.get_running_loop().time)
        env_manager = manager(router, generate_timeout_s=TIMEOUT_S)
        await router.pause()
        spec = EpisodeSpec("t/planned-v0", 4, 0)
        episode = asyncio.ensure_future(
            env_manager.run(await source().session(spec.env_id), spec.env_id, 4, Sampling(64))
        )
        await asyncio.sleep(LOAD_S)  # the simulated load: the turn is held meanwhile
        sim.stall()
        router.resume()
        return await episode

    trajectory = run_simulated(main())
    assert trajectory.failed
    assert "no generation within 2.0 s (rollout.generate_timeout_s)" in trajectory.failure


def test_a_dying_worker_fails_only_the_episode_that_killed_it() -> None:
    """Seed 13's env ends its worker's process at its first step; the worker's other episodes
    were still waiting for the engine (longer first turns): they are replayed and trained."""
    long_first_turn = [s for s in range(100) if budgets(s)[0] >= budgets(DYING_SEED)[0] + 8][:4]

    async def main() -> tuple[list[Trajectory], list[Trajectory], int]:
        router = EngineRouter(engines(1))  # 7B-sized simulated steps: turns end apart
        workers = EnvWorkers(router, worker_setup, workers=1)
        lost: list[Trajectory] = []
        try:
            played = await asyncio.gather(
                *(
                    workers.play(
                        EpisodeSpec("t/planned-v0", seed, i), SAMPLING, on_failure=lost.append
                    )
                    for i, seed in enumerate([DYING_SEED, *long_first_turn])
                )
            )
        finally:
            await workers.close()
        return played, lost, workers.restarts

    played, lost, restarts = asyncio.run(asyncio.wait_for(main(), 60))
    assert [t.seed for t in played if t.failed] == [DYING_SEED]
    assert "env worker 0 died (exit code 3)" in (played[0].failure or "")
    assert lost == []  # a replayed bystander is not a failed episode: its group is not charged
    assert restarts == 1
