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
    FAST,
    budgets,
    engines,
    manager,
    source,
    worker_setup,
)
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import Sampling
from trainer.rollout.env_worker_replay import EnvCalls, HeldEpisode, settle_held
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


def play_on_one_worker(
    seeds: list[int], cost: Any = None
) -> tuple[list[Trajectory], list[Trajectory], int]:
    """Play ``seeds`` on one env worker behind one simulated engine (``cost``: its step cost;
    7B-sized by default): ``(trajectories, those given to on_failure, worker restarts)``."""

    async def main() -> tuple[list[Trajectory], list[Trajectory], int]:
        router = EngineRouter(engines(1) if cost is None else engines(1, cost=cost))
        workers = EnvWorkers(router, worker_setup, workers=1)
        lost: list[Trajectory] = []
        try:
            played = await asyncio.gather(
                *(
                    workers.play(
                        EpisodeSpec("t/planned-v0", seed, i), SAMPLING, on_failure=lost.append
                    )
                    for i, seed in enumerate(seeds)
                )
            )
        finally:
            await workers.close()
        return played, lost, workers.restarts

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_a_dying_worker_fails_only_the_episode_that_killed_it() -> None:
    """Seed 13's env ends its worker's process at its first step; the worker's other episodes
    were still waiting for the engine (longer first turns): they are replayed and trained."""
    long_first_turn = [s for s in range(100) if budgets(s)[0] >= budgets(DYING_SEED)[0] + 8][:4]
    played, lost, restarts = play_on_one_worker([DYING_SEED, *long_first_turn])
    assert [t.seed for t in played if t.failed] == [DYING_SEED]
    assert "env worker 0 died (exit code 3)" in (played[0].failure or "")
    assert lost == []  # a replayed bystander is not a failed episode: its group is not charged
    assert restarts == 1


def test_a_dying_worker_replays_the_episodes_it_stepped_beside_the_culprit() -> None:
    """A fast engine: the episodes' first turns end together and every episode the worker holds
    is past its generation (stepping its env, or about to) when seed 13's env ends the process.
    The worker's record of its env calls names the culprit: only it fails; the others are
    replayed on the replacement and trained."""
    same_first_turn = [s for s in range(200) if budgets(s)[0] == budgets(DYING_SEED)[0]][1:4]
    played, lost, restarts = play_on_one_worker([*same_first_turn, DYING_SEED], FAST)
    assert [t.seed for t in played if t.failed] == [DYING_SEED]
    assert "env worker 0 died (exit code 3)" in (played[-1].failure or "")
    assert lost == []
    assert restarts == 1


def test_the_record_of_env_calls_names_the_episodes_in_one() -> None:
    """What a worker writes around its env calls is what its driver reads after its death: the
    episodes in a call (several with threaded envs), none once they returned."""
    driver, fd = EnvCalls.create()
    worker = EnvCalls.attach(fd)
    try:
        assert driver.running() == set()
        worker.begin("w1")
        worker.begin("w2")
        worker.begin("w2")
        worker.end("w2")
        assert driver.running() == {"w1", "w2"}
        worker.end("w1")
        worker.end("w2")
        assert driver.running() == set()
    finally:
        worker.close()
        driver.close()


def test_a_dead_workers_episodes_fail_only_if_in_an_env_call_or_out_of_replays() -> None:
    """The culprit fails; an episode with no replay left fails too; the others are replayed
    with one replay fewer; without a replay (closing) every episode fails."""

    async def main() -> tuple[dict[str, str], list[tuple[str, int]]]:
        loop = asyncio.get_running_loop()
        held = {
            key: HeldEpisode(
                EpisodeSpec("t/planned-v0", i, i), SAMPLING, retries, loop.create_future(), None
            )
            for i, (key, retries) in enumerate([("culprit", 2), ("spent", 0), ("bystander", 2)])
        }
        replayed: list[tuple[str, int]] = []
        settle_held(held, {"culprit"}, "died", lambda k, e: replayed.append((k, e.max_retries)))
        return {
            k: (e.future.result().failure or "") for k, e in held.items() if e.future.done()
        }, replayed

    failed, replayed = asyncio.run(main())
    assert failed == {"culprit": "died", "spent": "died"}
    assert replayed == [("bystander", 1)]
