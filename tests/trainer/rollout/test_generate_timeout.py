"""``rollout.generate_timeout_s``: a turn whose generation does not come back in time fails its
episode (replayed, then its group replaced), on simulated engines that stall or queue; the
router then keeps new episodes off an engine that stopped answering."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.rollout.sim_workload import GateEngine, engines, manager, source
from trainer.errors import RolloutError
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import Sampling
from trainer.rollout.groups import EpisodeSpec
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.strategies.base import GenerationRequest

TIMEOUT_S = 30.0  # simulated seconds
HANG_GUARD_S = 100_000.0  # simulated: turns a hang into a failure; nothing asserts on time


def run(coro):
    return sim_clock.run(asyncio.wait_for(coro, HANG_GUARD_S))


def scheduler_for(router: EngineRouter, **config: object) -> RolloutScheduler:
    return RolloutScheduler(
        SchedulerConfig(
            **{"num_groups": 2, "group_size": 2, "env_ids": ("t/planned-v0",), **config}
        ),  # type: ignore[arg-type]
        manager(router, generate_timeout_s=TIMEOUT_S),
        router,
        source(),
        Sampling(64),
    )


def test_a_stalled_engine_fails_the_episode_and_new_episodes_avoid_it() -> None:
    async def main():
        sims = engines(2)
        sims[0].stall()
        router = EngineRouter(sims, clock=asyncio.get_running_loop().time)
        env_manager = manager(router, generate_timeout_s=TIMEOUT_S)
        spec = EpisodeSpec("t/planned-v0", 4, 0)
        stalled = await env_manager.run(
            await source().session(spec.env_id), spec.env_id, 4, Sampling(64), episode_key="first"
        )
        later = [
            await env_manager.run(
                await source().session(spec.env_id),
                spec.env_id,
                4,
                Sampling(64),
                episode_key=f"next{i}",
            )
            for i in range(3)
        ]
        return stalled, later, [s.stats.requests for s in sims]

    stalled, later, requests = run(main())
    assert stalled.failed
    assert "no generation within 30.0 s (rollout.generate_timeout_s)" in stalled.failure
    assert "did not answer the abort" in stalled.failure
    assert not any(t.failed for t in later)
    assert requests[0] == 1  # nothing more was sent to the engine that stopped answering


def test_a_turn_queued_too_long_is_aborted_in_a_live_engine() -> None:
    async def main():
        [sim] = engines(1, max_num_seqs=1)
        router = EngineRouter([sim], clock=asyncio.get_running_loop().time)
        hog = asyncio.ensure_future(sim.generate(GenerationRequest("hog/0", [1] * 8, 100_000)))
        await asyncio.sleep(0)
        env_manager = manager(router, generate_timeout_s=TIMEOUT_S)
        spec = EpisodeSpec("t/planned-v0", 1, 0)
        trajectory = await env_manager.run(
            await source().session(spec.env_id), spec.env_id, 1, Sampling(64)
        )
        await sim.abort("hog/0")
        await hog
        held = sim.held
        await sim.close()
        return trajectory, held, router.engine_of("hog")

    trajectory, held, _ = run(main())
    assert trajectory.failed and "rollout.generate_timeout_s" in trajectory.failure
    assert "did not answer" not in trajectory.failure  # the engine answered the abort
    assert held == 0  # the queued request left the engine


def test_the_scheduler_replays_episodes_a_stalled_engine_held() -> None:
    async def main():
        sims = engines(2)
        sims[0].stall()
        router = EngineRouter(sims, clock=asyncio.get_running_loop().time)
        scheduler = scheduler_for(router)
        try:
            return await scheduler.next_batch()
        finally:
            await scheduler.close()
            await sims[1].close()

    batch = run(main())
    assert len(batch.trajectories) == 4 and not any(t.failed for t in batch.trajectories)
    assert batch.failed and all("rollout.generate_timeout_s" in t.failure for t in batch.failed)


def test_every_engine_stalled_stops_the_run_with_the_timeout_as_the_reason() -> None:
    async def main():
        sims = engines(2)
        for sim in sims:
            sim.stall()
        router = EngineRouter(sims, clock=asyncio.get_running_loop().time)
        scheduler = scheduler_for(router, max_retries=0, max_failed_groups=3)
        try:
            await scheduler.next_batch()
        finally:
            await scheduler.close()

    with pytest.raises(RolloutError, match=r"rollout\.generate_timeout_s"):
        run(main())


def test_a_weight_update_gives_up_on_the_turns_a_hung_engine_holds() -> None:
    """``async``: an engine hangs (answers nothing, aborts included) while it holds turns. The
    next weight update must not wait for it forever (its pause held every turn deadline, so
    nothing else ended the wait): the turns it holds fail and are replayed on the engine that
    answers, the weights load, and the batch comes."""

    async def main():
        started = asyncio.Event()
        sims = engines(2, kind=GateEngine, started=started, wanted=4, seen=[0])
        router = EngineRouter(sims, clock=asyncio.get_running_loop().time)
        scheduler = scheduler_for(router, mode="async", max_staleness=1)
        collecting = asyncio.ensure_future(scheduler.next_batch())
        await started.wait()  # every episode's first turn is in an engine: two in each
        sims[1].stall()
        try:
            await asyncio.wait_for(scheduler.update_weights({}), 100 * TIMEOUT_S)
        except TimeoutError:  # it never returns (asserted below; a close would wait as well)
            return None
        batch = await collecting
        await scheduler.close()
        await sims[0].close()
        return batch, router.version, sims[1].stats.requests

    outcome = run(main())
    assert outcome is not None, "the weight update waited for the hung engine for good"
    batch, version, hung_requests = outcome
    assert version == 1  # the weights loaded
    assert len(batch.trajectories) == 4 and not any(t.failed for t in batch.trajectories)
    assert batch.failed and all("weight update" in t.failure for t in batch.failed)
    assert hung_requests == 2  # the replays went to the engine that answers
