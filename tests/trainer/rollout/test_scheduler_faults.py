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
            assert batch.metrics["rollout/aborted_surplus_episodes"] > 0  # something to abort
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
    assert metrics["rollout/aborted_surplus_episodes"] == 8  # four played groups of two


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


# ------------------------------------------------------------ groups cancelled mid env call
class HeldEnvs:
    """An env source whose sessions' steps wait for ``release`` on the task seeds in ``held``
    (a long env call: tests running in a sandbox, a hub env, a slow judge); counts the sessions
    open now and at most, and tells ``entered`` when a held step began."""

    def __init__(self, held: set[int]) -> None:
        self.held, self.release, self.entered = held, asyncio.Event(), asyncio.Event()
        self.open = self.peak = 0

    async def session(self, env_id: str) -> HeldSession:
        self.open += 1
        self.peak = max(self.peak, self.open)
        return HeldSession(self)

    async def aclose(self) -> None:
        """Sessions close themselves."""


class HeldSession:
    def __init__(self, envs: HeldEnvs) -> None:
        self.envs, self.env, self.seed = envs, w.PlannedEnv(), 0

    async def reset(self, seed: int, options: Any = None) -> Any:
        self.seed = seed
        return self.env.reset(seed=seed, options=options)

    async def step(self, action: Any) -> Any:
        if self.seed in self.envs.held:
            self.envs.entered.set()
            await self.envs.release.wait()
        return self.env.step(action)

    async def close(self) -> None:
        self.envs.open -= 1


GUARD_S = 10_000.0  # simulated; a wait this long is a hang (nothing asserts on time)


def held_scheduler(cfg: SchedulerConfig, envs: HeldEnvs) -> tuple[RolloutScheduler, list[Any]]:
    engines = w.engines(1)
    router = EngineRouter(engines, clock=asyncio.get_running_loop().time)
    return RolloutScheduler(cfg, w.manager(router), router, envs, Sampling(64)), engines


def test_the_sync_surplus_does_not_hold_the_batch_while_its_env_calls_run() -> None:
    """``sync`` with redundancy: the batch is full while surplus episodes are inside an env call
    that takes long. ``next_batch`` returns without waiting for it (the surplus is aborted and
    closes its envs in the background), the groups still draining count against the groups in
    play, and ``close`` does not wait for them for good either."""

    async def go() -> tuple[Any, ...] | None:
        envs = HeldEnvs(held={2, 3})  # groups 2 and 3 (of 0-3 started) are the slow ones
        cfg = SchedulerConfig(2, 2, ("t/p-v0",), mode="sync", redundancy=2.0)
        sched, engines = held_scheduler(cfg, envs)
        try:
            first = await asyncio.wait_for(sched.next_batch(), GUARD_S)
            second = await asyncio.wait_for(sched.next_batch(), GUARD_S)
            await asyncio.wait_for(sched.close(), GUARD_S)  # the held calls never return
        except TimeoutError:
            return None
        for engine in engines:
            await engine.close()
        groups = [sorted({t.group_id for t in b.trajectories}) for b in (first, second)]
        return groups, first.metrics["rollout/aborted_surplus_episodes"], envs.peak, envs.open

    outcome = sim_clock.run(go())
    assert outcome is not None, "the batch (or close) waited for the surplus's env calls"
    groups, aborted, peak, still_open = outcome
    assert groups == [[0, 1], [4, 5]]  # the draining groups 2-3 left room for two new ones
    assert aborted == 4
    assert peak <= 4 * 2  # never more groups' envs open than the groups in play allow
    assert still_open == 0  # close ended the held calls and closed their envs


def test_a_weight_update_does_not_wait_for_a_doomed_groups_env_call() -> None:
    """``async``: a weight update aborts the groups that can no longer meet ``max_staleness``;
    one of them inside a long env call must not hold the update (the trainer waits for it)."""

    async def go() -> tuple[Any, ...] | None:
        envs = HeldEnvs(held={1})
        cfg = SchedulerConfig(2, 2, ("t/p-v0",), mode="async", max_staleness=0)
        sched, engines = held_scheduler(cfg, envs)
        collecting = asyncio.ensure_future(sched.next_batch())
        await envs.entered.wait()  # group 1 is inside its env call
        try:
            await asyncio.wait_for(sched.update_weights({}), GUARD_S)
        except TimeoutError:
            return None
        envs.release.set()
        batch = await collecting
        await closed(sched, engines)
        return batch.metrics["rollout/stale_aborted_groups"], batch.version, envs.open

    outcome = sim_clock.run(go())
    assert outcome is not None, "the weight update waited for a doomed group's env call"
    stale_aborted, version, still_open = outcome
    assert stale_aborted >= 1 and version == 1
    assert still_open == 0


# ---------------------------------------------------------------------- a broken env in a mix
class MissingDatasetEnv(w.PlannedEnv):
    """Every reset fails, as an env whose dataset file is missing."""

    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        raise RuntimeError("dataset file not found")


def test_an_env_of_a_mix_that_always_fails_is_warned_about_and_stops_the_run_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``env: [good, bad]``: the good env's successes must not hide the bad one, whose groups
    all fail (half the rollout work wasted, every batch the good env only)."""

    def make(env_id: str, **kwargs: Any) -> w.PlannedEnv:
        return MissingDatasetEnv() if env_id == "acme/bad-v0" else w.PlannedEnv()

    async def go() -> None:
        engines = w.engines(1)
        router = EngineRouter(engines, clock=asyncio.get_running_loop().time)
        cfg = SchedulerConfig(2, 2, ("acme/good-v0", "acme/bad-v0"), max_retries=1)
        sched = RolloutScheduler(
            cfg, w.manager(router), router, LocalEnvSource(make=make), Sampling(64)
        )
        try:
            for _ in range(50):
                await sched.next_batch()
        finally:
            await closed(sched, engines)

    with caplog.at_level("WARNING"), pytest.raises(RolloutError) as error:
        sim_clock.run(go())
    message = str(error.value)
    assert "of env 'acme/bad-v0' in a row failed" in message
    assert "env 'acme/bad-v0' reset raised RuntimeError: dataset file not found" in message
    assert "`envhub check acme/bad-v0`" in message
    warned = [r.getMessage() for r in caplog.records if "acme/bad-v0" in r.getMessage()]
    assert len(warned) == 1 and "dataset file not found" in warned[0]
