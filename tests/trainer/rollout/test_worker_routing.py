"""Routing in the env workers (``trainer.rollout.worker_routing``): each worker routes its own
turns; the same episodes as when the driver routes, weight updates that preempt and resume
the workers' turns, aborts that reach the worker playing an episode, a worker dying mid-run
that holds up nothing and leaves nothing running in the engines."""

from __future__ import annotations

import array
import asyncio
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
from tests.trainer.rollout.test_env_workers import RecordingSimEngine, play, specs
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import Sampling
from trainer.rollout.env_workers import EnvWorkers
from trainer.rollout.groups import run_episodes
from trainer.rollout.router import EngineRouter, episode_key
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.sim_engine import SimEngine
from trainer.rollout.worker_routing import RelayEngines, RelayHost, WorkerRouters
from trainer.strategies.base import GenerationRequest, GenerationResult

SAMPLING = Sampling(64)


def routed(sim_engines: list[SimEngine], off_clock: Any = None) -> WorkerRouters:
    """Routers in the workers over ``sim_engines``, hosted here (loaded by ``update``)."""

    def load(weights: Any) -> None:
        for engine in sim_engines:
            engine.update_weights(weights)

    host = RelayHost(sim_engines, off_clock=off_clock) if off_clock else RelayHost(sim_engines)
    return WorkerRouters(RelayEngines(len(sim_engines)), len(sim_engines), update=load, relay=host)


def in_flight(sim_engines: list[SimEngine]) -> int:
    return sum(len(engine._by_id) for engine in sim_engines)


def test_workers_that_route_play_the_same_episodes_each_on_one_engine() -> None:
    async def main() -> tuple[list[Any], list[Any], list[RecordingSimEngine], Any]:
        router = EngineRouter(engines(2, cost=FAST))
        here = await play(manager(router), router, 12)
        recording = engines(2, cost=FAST, kind=RecordingSimEngine)
        routers = routed(recording)
        workers = EnvWorkers(routers, worker_setup, workers=2)
        try:
            there = await play(workers, router, 12)
        finally:
            await workers.close()
        return here, there, recording, routers.totals()

    here, there, recording, totals = asyncio.run(main())
    assert [t.token_ids for t in there] == [t.token_ids for t in here]
    assert [(t.turn_rewards, t.response_mask, t.messages) for t in there] == [
        (t.turn_rewards, t.response_mask, t.messages) for t in here
    ]
    turns = sum(t.num_turns for t in there)
    assert totals.requests == turns  # the workers' counters reached the driver
    # sticky in each worker: an episode's turns all ran on one engine
    seen = [{episode_key(rid) for rid in engine.prompts} for engine in recording]
    assert sum(len(keys) for keys in seen) == len(there)
    assert not seen[0] & seen[1]
    assert all(seen)  # and the workers' episodes spread over both engines


class _KeepingSimEngine(SimEngine):
    """Keeps every request's prompt as it arrived."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: dict[str, Any] = {}

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        self.prompts[request.request_id] = request.prompt_ids
        return super().start_generate(request)


def test_a_relayed_prompt_reaches_the_hosted_engine_whole_as_one_int_array() -> None:
    """The driver hosts the relayed engines (the cluster simulation), so their prompts are
    its memory: each arrives as one machine array of int32 (no Python int per token for the
    driver to allocate and its cyclic GC to scan), holding the episode's whole prompt."""

    async def main() -> tuple[list[Any], list[_KeepingSimEngine]]:
        keeping = engines(2, cost=FAST, kind=_KeepingSimEngine)
        workers = EnvWorkers(routed(keeping), worker_setup, workers=2)
        try:
            return await play(workers, EngineRouter(keeping), 6), keeping
        finally:
            await workers.close()

    played, keeping = asyncio.run(main())
    prompts = [ids for engine in keeping for ids in engine.prompts.values()]
    assert len(prompts) == sum(t.num_turns for t in played)
    assert all(isinstance(ids, array.array) and ids.typecode == "i" for ids in prompts)
    for ids in prompts:  # each is a prefix of its finished episode
        assert any(t.token_ids[: len(ids)] == ids.tolist() for t in played)


def test_a_weight_update_preempts_the_workers_turns_and_they_resume_under_the_new_version() -> None:
    async def main() -> tuple[list[Any], list[Any], WorkerRouters, int]:
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        sim = engines(2, kind=GateEngine, sync_s=0.5, started=started, wanted=6, seen=[0])
        routers = routed(sim, off_clock=loop.uncharged)
        workers = EnvWorkers(routers, worker_setup, workers=2, lockstep=True)
        await workers.start()
        try:
            playing = loop.create_task(run_episodes(specs(6), workers, source(), SAMPLING))
            await started.wait()  # every episode's first turn is in an engine
            assert in_flight(sim) == 6
            await routers.update_weights_live({})
            finished, failed = await playing
        finally:
            await workers.close()
        return finished, failed, routers, in_flight(sim)

    finished, failed, routers, left = sim_clock.run(main())
    assert not failed and left == 0
    assert routers.version == 1
    for t in finished:  # whole episodes, every turn at its budget
        assert sum(t.response_mask) == sum(budgets(t.seed))
    resumed = [t for t in finished if {0, 1} <= set(t.token_versions)]
    assert resumed  # turns cut by the update went on under version 1, in the same turn
    assert routers.totals().preempted >= len(resumed)
    for t in finished:
        assert t.policy_versions[-1] == 1 or t.num_turns == 1


def test_the_scheduler_aborts_surplus_episodes_in_the_workers_that_play_them() -> None:
    async def main() -> tuple[list[Any], WorkerRouters, int, int]:
        loop = asyncio.get_running_loop()
        sim = engines(2)
        routers = routed(sim, off_clock=loop.uncharged)
        workers = EnvWorkers(routers, worker_setup, workers=2, lockstep=True)
        await workers.start()
        scheduler = RolloutScheduler(
            SchedulerConfig(4, 4, ("planned",), mode="async", redundancy=1.5, max_staleness=1),
            workers,
            routers,  # type: ignore[arg-type]
            source(),
            SAMPLING,
        )
        batches = []
        try:
            for _ in range(2):  # tasks 0-11: not the seed that kills its worker
                batches.append(await scheduler.next_batch())
                await scheduler.update_weights({})
        finally:
            await scheduler.close()
            left_episodes = workers.episodes
            await workers.close()
        return batches, routers, left_episodes, in_flight(sim)

    batches, routers, left_episodes, left_requests = sim_clock.run(main())
    for batch in batches:
        assert len(batch.trajectories) == 16 and not batch.failed
        assert all(t.num_turns == len(budgets(t.seed)) for t in batch.trajectories)
    assert routers.version == 2
    assert routers.totals().aborted > 0  # the surplus episodes' turns, aborted in their worker
    assert left_episodes == 0 and left_requests == 0


def test_a_worker_that_dies_holds_up_no_update_and_leaves_nothing_in_the_engines() -> None:
    async def main() -> tuple[list[Any], list[Any], WorkerRouters, int, int]:
        sim = engines(2, cost=FAST)
        routers = routed(sim)
        workers = EnvWorkers(routers, worker_setup, workers=2)
        try:
            first = await asyncio.gather(
                *(workers.play(spec, SAMPLING) for spec in specs(20))  # seed 13 kills its worker
            )
            await routers.update_weights_live({})  # the dead worker is not waited for
            second = await asyncio.gather(
                *(workers.play(spec, SAMPLING) for spec in specs(6, first_seed=100))
            )
            restarts = workers.restarts
        finally:
            await workers.close()
        return first, second, routers, restarts, in_flight(sim)

    first, second, routers, restarts, left = asyncio.run(main())
    dead = [t for t in first if t.failed]
    assert any(t.seed == DYING_SEED for t in dead)
    assert all("env worker" in (t.failure or "") for t in dead)
    assert restarts == 1 and routers.version == 1
    assert not any(t.failed for t in second)  # the replacement routes under the new version
    assert all(t.policy_versions == [1] * t.num_turns for t in second)
    assert left == 0  # what the dead worker had asked for was aborted in the engines
