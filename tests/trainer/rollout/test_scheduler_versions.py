"""Policy versions and engine aborts as a run reports them: a group is aborted as stale only
for tokens it really generated under an old policy (not for the version it started under), a
batch's row counts the engine aborts that batch sent, and a turn preempted by weight updates
records the version of each of its parts in ``Trajectory.policy_versions`` (the trajectory
store's column). Fake engines that answer only when the test says: nothing here waits on time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.trainer.rollout import sim_workload as w
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import Sampling
from trainer.rollout.groups import EpisodeSpec, play_episode
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.strategies.base import GenerationRequest, GenerationResult

HANG_GUARD_S = 120  # only stops a hung test; nothing here asserts on time


class ParkingEngine:
    """Answers a request at once (its whole budget, ``stop``) when ``quick(request_id)`` or when
    it is a resumed part; parks any other until it is aborted. An abort is answered (with the
    one token the parked request made) only once ``deliver()`` is called: an engine that takes
    its aborts at a later step."""

    def __init__(self, quick: Any = lambda request_id: False) -> None:
        self.quick, self.version = quick, 0
        self.token = w.renderer().encode("a")[0]
        self.parked: dict[str, asyncio.Future[GenerationResult]] = {}
        self.aborts: list[str] = []
        self.parked_one = asyncio.Event()
        self.abort_asked = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.quick(request.request_id) or "." in request.request_id:
            n = request.max_new_tokens
            return GenerationResult(request.request_id, [self.token] * n, [-0.5] * n, "stop")
        future = asyncio.get_running_loop().create_future()
        self.parked[request.request_id] = future
        self.parked_one.set()
        return await future

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self.abort_asked.set()

    def deliver(self) -> None:
        """Answer every abort asked so far."""
        for request_id in self.aborts:
            future = self.parked.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(
                    GenerationResult(request_id, [self.token], [-0.5], "abort", self.version)
                )
        self.aborts = []

    def update_weights(self, weights: Any) -> None:
        self.version += 1

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None: ...


def group_of(request_id: str) -> int:
    """The group number of a scheduler request id (``g{group}e{episode}a{attempt}/{turn}``)."""
    return int(request_id[1:].partition("e")[0])


def run(coro: Any) -> Any:
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, HANG_GUARD_S)

    return asyncio.run(guarded())


# ---------------------------------------------------------------------- engine aborts
def test_a_batchs_row_counts_the_engine_aborts_that_batch_sent() -> None:
    """``sync`` with redundancy: each batch aborts its surplus group's request in the engine,
    which answers the abort later. The batch that sent it reports it, not the next one."""

    async def go() -> list[dict[str, float]]:
        engine = ParkingEngine(quick=lambda request_id: group_of(request_id) % 2 == 0)
        router = EngineRouter([engine])
        cfg = SchedulerConfig(1, 1, ("t/p-v0",), mode="sync", redundancy=2.0)
        sched = RolloutScheduler(cfg, w.manager(router), router, w.source(), Sampling(64))
        rows = []
        for _ in range(3):
            rows.append((await sched.next_batch()).metrics)
            engine.deliver()  # the surplus's abort is answered after the batch was taken
            await sched.update_weights({})
        await sched.close()
        return rows

    rows = run(go())
    assert [row["rollout/aborted_surplus_episodes"] for row in rows] == [1, 1, 1]
    assert [row["rollout/engine_aborts"] for row in rows] == [1, 1, 1]


# ---------------------------------------------------------------------- stale groups
class HeldResets:
    """Env sessions whose reset waits for ``release`` on the task seeds in ``held`` (an env that
    is slow to start: a sandbox, a browser); ``entered`` is set once a held reset began."""

    def __init__(self, held: set[int]) -> None:
        self.held, self.release, self.entered = held, asyncio.Event(), asyncio.Event()

    async def session(self, env_id: str) -> HeldReset:
        return HeldReset(self)

    async def aclose(self) -> None:
        """Sessions close themselves."""


class HeldReset:
    def __init__(self, envs: HeldResets) -> None:
        self.envs, self.env = envs, w.PlannedEnv()

    async def reset(self, seed: int, options: Any = None) -> Any:
        if seed in self.envs.held:
            self.envs.entered.set()
            await self.envs.release.wait()
        return self.env.reset(seed=seed, options=options)

    async def step(self, action: Any) -> Any:
        return self.env.step(action)

    async def close(self) -> None: ...


def test_a_group_slow_to_start_across_a_weight_update_is_trained_not_aborted_as_stale() -> None:
    """``async``, ``max_staleness: 1``: a group starts at version 0, its envs take until after
    the update to version 1 to reset, so every token it makes is of version 1 or later. At the
    update to version 2 it is within the bound and must go on to be trained."""

    async def go() -> tuple[Any, ...]:
        engines = w.engines(1)
        router = EngineRouter(engines, clock=asyncio.get_running_loop().time)
        envs = HeldResets(held={0})
        cfg = SchedulerConfig(1, 2, ("t/p-v0",), mode="async", max_staleness=1)
        sched = RolloutScheduler(cfg, w.manager(router), router, envs, Sampling(64))
        collecting = asyncio.ensure_future(sched.next_batch())
        await envs.entered.wait()  # group 0 started under version 0; its envs are resetting
        await sched.update_weights({})
        envs.release.set()
        await sched.update_weights({})  # to version 2: group 0 has no token older than 1
        batch = await collecting
        await sched.close()
        await engines[0].close()
        return batch, router.version

    batch, version = sim_clock.run(go())
    assert batch.metrics["rollout/stale_aborted_groups"] == 0
    assert {t.group_id for t in batch.trajectories} == {0}
    assert all(version - t.oldest_version <= 1 for t in batch.trajectories)  # the bound holds


class FailingStep:
    """Env sessions: on task seed 0 the first step waits for ``release`` and then raises (a
    group that fails while weights load); other seeds play ``PlannedEnv``."""

    def __init__(self) -> None:
        self.release, self.entered = asyncio.Event(), asyncio.Event()

    async def session(self, env_id: str) -> FailingSession:
        return FailingSession(self)

    async def aclose(self) -> None:
        """Sessions close themselves."""


class FailingSession(HeldReset):
    def __init__(self, envs: Any) -> None:
        super().__init__(envs)
        self.seed = -1

    async def reset(self, seed: int, options: Any = None) -> Any:
        self.seed = seed
        return self.env.reset(seed=seed, options=options)

    async def step(self, action: Any) -> Any:
        if self.seed == 0:
            self.envs.entered.set()
            await self.envs.release.wait()
            raise RuntimeError("env crashed")
        return self.env.step(action)


def test_no_group_starts_while_weights_load_and_its_replacement_starts_once_they_have() -> None:
    """A group that ends during a weight update's pause is replaced after the load, under the
    new version (started during the pause, its first request would wait for the new weights
    anyway while it counted as started under the old ones, and go stale a version early)."""

    async def go() -> tuple[set[int], set[int], int]:
        engine = ParkingEngine(quick=lambda request_id: request_id != "g1e0a0/0")
        router = EngineRouter([engine])
        envs = FailingStep()
        cfg = SchedulerConfig(
            1, 1, ("t/p-v0",), mode="async", max_staleness=1, redundancy=2.0, max_retries=0
        )
        sched = RolloutScheduler(cfg, w.manager(router), router, envs, Sampling(64))
        collecting = asyncio.ensure_future(sched.next_batch())
        await envs.entered.wait()  # group 0 is in its env step
        await engine.parked_one.wait()  # group 1's first turn is in the engine
        ending = list(sched._running[0].tasks)
        update = asyncio.ensure_future(sched.update_weights({}))
        await engine.abort_asked.wait()  # paused: waiting for group 1's turn to stop
        envs.release.set()
        await asyncio.wait(ending)  # group 0 failed (and the scheduler saw it) while paused
        during = set(sched._running)
        engine.deliver()
        await update
        after = set(sched._running) | {group.number for group in sched._ready}
        batch = await collecting
        await sched.close()
        return during, after, batch.version

    during, after, version = run(go())
    assert during == {1}  # no replacement while paused
    assert 2 in after and version == 1  # it started once the weights had loaded


# ---------------------------------------------------------------------- policy versions
class PreemptedTwice(ParkingEngine):
    """Parks a turn's first two parts (each makes one token before its abort) and answers the
    third at once: a turn cut by two weight updates."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.request_id.count(".") == 0 or request.request_id.endswith(".1"):
            future = asyncio.get_running_loop().create_future()
            self.parked[request.request_id] = future
            self.parked_one.set()
            return await future
        return await super().generate(request)

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self.deliver()


@pytest.mark.parametrize("updates", [0, 2])
def test_a_preempted_turn_records_the_version_of_each_of_its_parts(updates: int) -> None:
    """``Trajectory.policy_versions`` (the trajectory store's column, shown by ``envhub view``):
    a one-turn episode whose turn two weight updates preempted lists versions 0, 1 and 2, the
    versions its tokens were generated under, not only the last."""

    async def go() -> Any:
        engine = PreemptedTwice() if updates else ParkingEngine(quick=lambda request_id: True)
        router = EngineRouter([engine])
        playing = asyncio.ensure_future(
            play_episode(w.manager(router), w.source(), EpisodeSpec("t/p-v0", 0, 0), Sampling(64))
        )
        for _ in range(updates):
            await engine.parked_one.wait()
            engine.parked_one.clear()
            await router.update_weights_live({})
        return await playing

    trajectory = run(go())
    assert not trajectory.failed and trajectory.num_turns == 1
    assert trajectory.policy_versions == list(range(updates + 1))
    assert sorted(set(trajectory.token_versions) - {-1}) == trajectory.policy_versions
