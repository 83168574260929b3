"""Faults that are not the episode's own must not fail it: a weight update that holds turns
longer than ``rollout.generate_timeout_s`` (the turns are paused, not late; in the driver and in
env workers, whichever routes their turns), and an env worker killed by another episode's env
(its co-hosted episodes are replayed on the replacement)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.rollout.sim_workload import (
    DYING_SEED,
    FAST,
    GateEngine,
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
from trainer.rollout.groups import EpisodeSpec, run_episodes
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.trajectory import Trajectory
from trainer.rollout.worker_routing import RelayEngines, RelayHost, WorkerRouters
from trainer.strategies.base import GenerationRequest, GenerationResult

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


REAL_TIMEOUT_S = 1.0  # real seconds: the workers' loops run on the wall clock
REAL_LOAD_S = 2.5  # real seconds a weight load holds the workers' turns (the fault itself)
GATE_COST = dataclasses.replace(FAST, step_overhead_s=2e-3)
"""Turns of at most 40 steps of 2 ms: well within REAL_TIMEOUT_S, and still running when the
update begins."""


@pytest.mark.parametrize("route_in_workers", [False, True], ids=["driver-routes", "workers-route"])
def test_worker_turns_held_by_a_weight_update_slower_than_the_timeout_do_not_fail(
    route_in_workers: bool,
) -> None:
    """Episodes played in env workers (``rollout.env_workers``), with the turns routed by the
    driver's router or by the workers' own (``rollout.route_in_workers``): an update that holds
    their turns longer than their ``generate_timeout_s`` is a pause, not a late engine."""

    async def main() -> tuple[list[Trajectory], list[Trajectory], int]:
        started = asyncio.Event()
        sim = engines(2, GATE_COST, kind=GateEngine, started=started, wanted=6, seen=[0])
        router: Any = EngineRouter(sim)
        if route_in_workers:
            router = WorkerRouters(RelayEngines(2), 2, relay=RelayHost(sim))
        setup = functools.partial(worker_setup, generate_timeout_s=REAL_TIMEOUT_S)
        workers = EnvWorkers(router, setup, workers=2)
        await workers.start()
        try:
            specs = [EpisodeSpec("t/planned-v0", 2 + 3 * i, i) for i in range(6)]  # 3 turns each
            playing = asyncio.ensure_future(run_episodes(specs, workers, source(), SAMPLING))
            await started.wait()  # every episode's first turn is in an engine
            # a load slower than the workers' deadline, in a thread as the pipeline's sync runs
            await router.update_weights_live(lambda: time.sleep(REAL_LOAD_S))
            finished, failed = await playing
            preempted = router.totals().preempted
        finally:
            await workers.close()
        return finished, failed, preempted

    finished, failed, preempted = asyncio.run(asyncio.wait_for(main(), 120))
    assert [t.failure for t in failed] == []
    assert [t.failure for t in finished if t.failed] == []
    assert sorted(t.seed for t in finished) == [2 + 3 * i for i in range(6)]
    assert preempted > 0  # the update did hold turns in flight
    for t in finished:  # whole episodes, every turn at its budget
        assert sum(t.response_mask) == sum(budgets(t.seed))


class _Counting(EngineRouter):
    """Sets ``asked`` once ``wanted`` requests came in (held or not)."""

    def __init__(self, *args: Any, asked: asyncio.Event, wanted: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked, self.wanted, self.count = asked, wanted, 0

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        self.count += 1
        if self.count >= self.wanted:
            self.asked.set()
        return super().start_generate(request)


def test_a_worker_started_during_a_weight_update_holds_its_turns_without_failing_them() -> None:
    """The pause began before the worker was ready (a replacement, or the first start): it is
    told at once, and its turns held past its ``generate_timeout_s`` are not late."""

    async def main() -> tuple[list[Trajectory], list[Trajectory]]:
        asked = asyncio.Event()
        router = _Counting(engines(1, GATE_COST), asked=asked, wanted=3)
        await router.pause()  # an update under way
        setup = functools.partial(worker_setup, generate_timeout_s=REAL_TIMEOUT_S)
        workers = EnvWorkers(router, setup, workers=1)
        await workers.start()
        try:
            specs = [EpisodeSpec("t/planned-v0", seed, i) for i, seed in enumerate([2, 5, 8])]
            playing = asyncio.ensure_future(run_episodes(specs, workers, source(), SAMPLING))
            await asyncio.wait_for(asked.wait(), 60)  # every first turn is held in the router
            await asyncio.sleep(REAL_LOAD_S)  # the rest of the slow load (the fault itself)
            router.resume()
            return await playing
        finally:
            await workers.close()

    finished, failed = asyncio.run(asyncio.wait_for(main(), 120))
    assert [t.failure for t in failed] == []
    assert [t.failure for t in finished if t.failed] == []
    assert sorted(t.seed for t in finished) == [2, 5, 8]
