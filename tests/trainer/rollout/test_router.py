"""``EngineRouter``: a weight update aborts every in-flight request at once (an engine takes
aborts between two of its steps; sent one after another, each would wait for a step of its own,
with 100 requests in flight 100 engine steps of paused rollouts), turns sent meanwhile wait for
the new weights, and a turn given up on moves new episodes to other engines.
"""

from __future__ import annotations

import asyncio
from typing import Any

from trainer.rollout.router import EngineRouter
from trainer.strategies.base import GenerationRequest, GenerationResult

HANG_GUARD_S = 60  # only stops a hung test; nothing here asserts on time


class StepEngine:
    """Requests run until aborted (or, once resumed, finish at once); an abort is answered at
    the engine's next step, together with every other abort that arrived before it."""

    def __init__(self) -> None:
        self.version = 0
        self.running: dict[str, asyncio.Future[GenerationResult]] = {}
        self.waiting_aborts: list[str] = []
        self.abort_sets: list[int] = []  # how many aborts each engine step took

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if "." in request.request_id:  # a resumed part: finish it
            return GenerationResult(
                request.request_id,
                [7] * request.max_new_tokens,
                [0.0] * request.max_new_tokens,
                "length",
                self.version,
            )
        future = asyncio.get_running_loop().create_future()
        self.running[request.request_id] = future
        return await future

    async def abort(self, request_id: str) -> None:
        self.waiting_aborts.append(request_id)
        await asyncio.sleep(0)  # the next engine step
        if self.waiting_aborts:
            self.abort_sets.append(len(self.waiting_aborts))
            for rid in self.waiting_aborts:
                future = self.running.pop(rid)
                future.set_result(GenerationResult(rid, [1, 2], [0.0, 0.0], "abort", self.version))
            self.waiting_aborts = []

    def update_weights(self, weights: Any) -> None:
        self.version += 1


def test_a_weight_update_preempts_all_in_flight_requests_in_one_engine_step() -> None:
    engine = StepEngine()
    router = EngineRouter([engine])

    async def go() -> list[GenerationResult]:
        calls = [
            asyncio.ensure_future(router.generate(GenerationRequest(f"ep{i}/0", [1, 2, 3], 5)))
            for i in range(20)
        ]
        while len(engine.running) < 20:
            await asyncio.sleep(0)
        await router.update_weights_live({"w": 0})
        return list(await asyncio.gather(*calls))

    results = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert engine.abort_sets == [20]  # one step took all 20 preemptions
    # resumed, tokens kept
    assert all(r.finish_reason == "length" and len(r.token_ids) == 5 for r in results)
    assert all(r.extra["token_versions"] == [0, 0, 1, 1, 1] for r in results)


def test_aborting_an_episode_reaches_the_engine_and_refuses_its_next_turn() -> None:
    engine = StepEngine()
    router = EngineRouter([engine])

    async def go() -> tuple[GenerationResult, GenerationResult]:
        call = asyncio.ensure_future(router.generate(GenerationRequest("ep0/0", [1, 2, 3], 5)))
        while not engine.running:
            await asyncio.sleep(0)
        await router.abort_episode("ep0")
        first = await call
        return first, await router.generate(GenerationRequest("ep0/1", [1, 2, 3], 5))

    first, second = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert first.finish_reason == "abort" and first.token_ids == [1, 2]
    assert second.finish_reason == "abort" and second.token_ids == []


def test_a_turn_sent_while_weights_load_waits_and_runs_under_the_new_version() -> None:
    engine = StepEngine()
    router = EngineRouter([engine])

    async def go() -> tuple[float, GenerationResult]:
        loading = asyncio.Event()
        loaded = asyncio.Event()

        def load() -> None:  # the weight sync, in its thread
            loop.call_soon_threadsafe(loading.set)
            asyncio.run_coroutine_threadsafe(loaded.wait(), loop).result()
            engine.update_weights({})

        loop = asyncio.get_running_loop()
        update = asyncio.ensure_future(router.update_weights_live(load))
        await loading.wait()
        # '.' in the id: the engine finishes it at once
        late = router.start_generate(GenerationRequest("ep0/0.", [1, 2, 3], 4))
        for _ in range(5):
            await asyncio.sleep(0)
        held = late.done()
        loaded.set()
        await update
        return held, await late

    held, result = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert not held  # nothing reaches an engine while its weights change
    assert result.finish_reason == "length" and result.policy_version == 1
    assert "token_versions" not in result.extra  # one version: no per-token list


def test_giving_up_on_a_turn_cancels_it_in_the_engine_and_new_episodes_go_elsewhere() -> None:
    slow, other = StepEngine(), StepEngine()
    router = EngineRouter([slow, other])

    async def go() -> tuple[bool, int | None, int | None]:
        answer = router.start_generate(GenerationRequest("ep0/0", [1, 2, 3], 5))
        while not slow.running:
            await asyncio.sleep(0)
        part = slow.running["ep0/0"]
        answer.cancel()  # what rollout.generate_timeout_s does to a turn that hangs
        while router.loads != [0, 0]:
            await asyncio.sleep(0)
        await router.generate(GenerationRequest("ep1/0.", [1], 2))
        return part.cancelled(), router.engine_of("ep0"), router.engine_of("ep1")

    cancelled, first, second = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert cancelled and first == 0
    assert second == 1  # equal loads, but the silent engine gets no new episode
    assert router.in_flight == 0


def test_an_engine_given_up_on_gets_a_trial_episode_and_its_share_once_it_answers() -> None:
    """A hung engine is avoided, not retired: one new episode in ``_PROBE_EVERY`` tries it, and
    an answer makes it an engine like the others (a recovered engine stayed unused for good)."""
    from trainer.rollout.router import _PROBE_EVERY

    slow, other = StepEngine(), StepEngine()
    router = EngineRouter([slow, other])

    async def go() -> list[int | None]:
        answer = router.start_generate(GenerationRequest("ep0/0", [1, 2, 3], 5))
        while not slow.running:
            await asyncio.sleep(0)
        answer.cancel()  # given up on (rollout.generate_timeout_s, or a weight update's pause)
        while router.loads != [0, 0]:
            await asyncio.sleep(0)
        engines = []
        for i in range(1, 2 * _PROBE_EVERY + 1):  # '.' in the id: the engine ends it at once
            await router.generate(GenerationRequest(f"ep{i}/0.", [1], 2))
            engines.append(router.engine_of(f"ep{i}"))
        return engines

    engines = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert 0 in engines[:_PROBE_EVERY]  # a trial episode
    after = engines[engines.index(0) + 1 :]
    assert after and set(after) == {0}  # answered: the first of equally loaded engines again


def test_an_aborted_turn_held_by_a_weight_update_ends_at_once() -> None:
    engine = StepEngine()
    router = EngineRouter([engine])

    async def go() -> GenerationResult:
        await router.pause()
        held = router.start_generate(GenerationRequest("ep0/0", [1, 2, 3], 5))
        await router.abort("ep0/0")
        result = await held
        router.resume()
        return result

    result = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert result.finish_reason == "abort" and result.token_ids == []
    assert router.take_stats().aborted == 1
