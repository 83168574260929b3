"""RolloutScheduler and EngineRouter when things break or are thrown away: an engine whose
requests all fail, the router's cancelled-episode marks over many batches, the count of
discarded surplus episodes, and ``restart_from`` on a live scheduler. Simulated engines on a
virtual clock (``trainer.rollout.sim_clock``): nothing here asserts on time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.trainer.rollout import sim_workload as w
from trainer.errors import RolloutError
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import LocalEnvSource, Sampling
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.sim_engine import SimEngine
from trainer.strategies.base import GenerationRequest, GenerationResult

CUDA_FAULT = "CUDA error: an illegal memory access was encountered"


class BrokenEngine(SimEngine):
    """A dead inference engine: every request fails at once (while ``broken``), as a crashed
    vLLM worker's calls do."""

    broken = True
    failed = 0

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        if not self.broken:
            return super().start_generate(request)
        self.failed += 1
        answer: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        answer.set_exception(RuntimeError(CUDA_FAULT))
        return answer


def scheduler(
    cfg: SchedulerConfig, engines: list[Any], env: type[w.PlannedEnv] = w.PlannedEnv
) -> tuple[RolloutScheduler, EngineRouter]:
    router = EngineRouter(engines, clock=asyncio.get_running_loop().time)
    source = LocalEnvSource(make=lambda env_id, **kwargs: env())
    return RolloutScheduler(cfg, w.manager(router), router, source, Sampling(64)), router


async def closed(sched: RolloutScheduler, engines: list[Any]) -> None:
    await sched.close()
    for engine in engines:
        await engine.close()


# ---------------------------------------------------------------------- a failing engine
def test_a_broken_engine_next_to_a_healthy_one_does_not_stop_the_run() -> None:
    async def go() -> tuple[list[int], int, int]:
        healthy = w.engines(1)[0]
        broken = w.engines(1, kind=BrokenEngine)[0]
        sched, _ = scheduler(SchedulerConfig(4, 2, ("t/p-v0",), mode="sync"), [healthy, broken])
        sizes = []
        for _ in range(4):
            sizes.append(len((await sched.next_batch()).trajectories))
            await sched.update_weights({})
        await closed(sched, [healthy, broken])
        return sizes, healthy.stats.requests, broken.failed

    sizes, served, failed = sim_clock.run(go())
    assert sizes == [8, 8, 8, 8]  # the run trains instead of stopping
    assert served > 10 * failed  # the healthy engine gets the work


def test_an_engine_that_failed_gets_episodes_again_once_it_answers() -> None:
    async def go() -> tuple[int, int]:
        healthy = w.engines(1)[0]
        flaky = w.engines(1, kind=BrokenEngine)[0]
        router = EngineRouter([healthy, flaky], clock=asyncio.get_running_loop().time)

        async def episode(n: int) -> None:
            request = GenerationRequest(f"ep{n}/0", [1, 2, 3], 4)
            try:
                await router.generate(request)
            except RuntimeError:
                pass

        async def wave(first: int) -> None:  # four at once: least-loaded spreads them
            await asyncio.gather(*(episode(n) for n in range(first, first + 4)))

        for first in range(0, 40, 4):
            await wave(first)
        failed_while_broken = flaky.failed
        flaky.broken = False  # the fault was transient
        for first in range(40, 400, 4):
            await wave(first)
        await healthy.close()
        await flaky.close()
        return failed_while_broken, flaky.stats.requests

    failed_while_broken, served_after = sim_clock.run(go())
    assert failed_while_broken < 8  # avoided after a few errors in a row
    assert served_after > 50  # not retired for good: tried again, then balanced again


def test_a_run_whose_only_engine_fails_says_the_engine_is_failing() -> None:
    async def go() -> None:
        broken = w.engines(1, kind=BrokenEngine)
        sched, _ = scheduler(SchedulerConfig(2, 2, ("t/p-v0",), mode="sync"), broken)
        try:
            await sched.next_batch()
        finally:
            await closed(sched, broken)

    with pytest.raises(RolloutError) as error:
        sim_clock.run(go())
    message = str(error.value)
    assert "inference engine" in message and CUDA_FAULT in message
    assert "envhub check" not in message  # the env is fine: do not send the user there


# ---------------------------------------------------------------------- cancelled marks
def test_aborted_episodes_are_not_remembered_after_their_groups_end() -> None:
    async def go() -> list[int]:
        engines = w.engines(1)
        cfg = SchedulerConfig(4, 2, ("t/p-v0",), mode="sync", redundancy=2.0, max_retries=2)
        sched, router = scheduler(cfg, engines)
        remembered = []
        for _ in range(6):
            batch = await sched.next_batch()
            assert batch.metrics["rollout/aborted_surplus"] > 0  # there was something to abort
            await sched.update_weights({})
            remembered.append(len(router._cancelled))
        await closed(sched, engines)
        return remembered

    assert sim_clock.run(go()) == [0] * 6


# ---------------------------------------------------------------------- discarded surplus
class OneTurnEnv(w.PlannedEnv):
    """Every task is one turn of ten tokens: all groups finish in the same engine step."""

    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.plan = [10]
        return super().on_reset(options)


def test_surplus_groups_that_finished_playing_count_as_discarded() -> None:
    async def go() -> dict[str, float]:
        engines = w.engines(1)
        cfg = SchedulerConfig(4, 2, ("t/p-v0",), mode="sync", redundancy=2.0)
        sched, _ = scheduler(cfg, engines, OneTurnEnv)
        batch = await sched.next_batch()
        await closed(sched, engines)
        return batch.metrics

    metrics = sim_clock.run(go())
    assert metrics["rollout/aborted_surplus"] == 8  # four played groups of two, thrown away


# ---------------------------------------------------------------------- restart_from
def test_restart_from_starts_no_group_and_numbers_the_next_ones_from_its_counter() -> None:
    async def go() -> tuple[int, int, set[int]]:
        engines = w.engines(1)
        cfg = SchedulerConfig(2, 2, ("t/p-v0",), mode="async", max_staleness=2)
        sched, _ = scheduler(cfg, engines)
        await sched.next_batch()  # groups keep playing after it (async)
        await sched.restart_from(100)
        in_play = len(sched._running) + len(sched._ready)
        batch = await sched.next_batch()
        await closed(sched, engines)
        return in_play, sched.state_dict()["next_group"], {t.group_id for t in batch.trajectories}

    in_play, next_group, trained = sim_clock.run(go())
    assert in_play == 0  # nothing numbered from the old counter started meanwhile
    assert min(trained) >= 100 and next_group > 100
