"""The driver's ``RankEngine`` keeps several batches in flight on one ``actor_infer`` rank, and a
request the rank cannot serve fails alone.

A rank's engine batches continuously (a request joins between two steps), so a short turn sent
while a long one runs must come back without waiting for the long one, on both cluster
backends; an abort must reach a request in any of the batches running there; and one request the
engine refuses must not fail the others of its batch. ``HeldEngine`` makes "long" deterministic:
it holds a ``long*`` request until it is aborted, answers any other at once, and refuses a
``bad*`` one, so no test depends on how fast anything runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest

from trainer.config import RoleConfig
from trainer.controller.dispatch import Dispatch, register
from trainer.strategies.base import GenerationRequest, GenerationResult

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from trainer.errors import WorkerCallError
from trainer.rollout.router import EngineRouter
from trainer.workers.infer import InferCluster, InferWorker

GUARD_S = 120
"""A step that never happens fails the test after this long instead of hanging it."""
PROMPT = [5, 6, 7, 8, 9]


class HeldEngine:
    """An engine whose ``long*`` requests run until aborted (see the module docstring)."""

    version = 0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held: dict[str, concurrent.futures.Future[GenerationResult]] = {}

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        rid = request.request_id
        if rid.startswith("long"):
            with self._lock:
                self.held[rid] = future
        elif rid.startswith("bad"):
            future.set_exception(ValueError(f"generation request {rid!r}: refused"))
        else:
            future.set_result(GenerationResult(rid, [1, 2], [-0.1, -0.2], "length", 0))
        return future

    def abort_sync(self, request_ids: list[str]) -> None:
        with self._lock:
            ended = [(rid, self.held.pop(rid)) for rid in request_ids if rid in self.held]
        for rid, future in ended:
            future.set_result(GenerationResult(rid, [1], [-0.1], "abort", 0))

    def update_weights(self, weights: Any) -> None:
        self.version += 1

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass


class HeldInferWorker(InferWorker):
    """An ``InferWorker`` serving from a ``HeldEngine``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held = HeldEngine()
        self.engine = self.held  # type: ignore[assignment]

    @register(Dispatch.ONE_TO_ALL)
    def holding(self) -> list[str]:
        """The ids the engine holds now (requests of batches running here)."""
        with self.held._lock:
            return sorted(self.held.held)


class HeldInferCluster(InferCluster):
    worker_cls = HeldInferWorker
    ray_method_groups: ClassVar[dict[str, str]] = {
        **InferCluster.ray_method_groups,
        "holding": "abort",  # answers while batches run
    }


def holding(cluster: HeldInferCluster) -> list[str]:
    if cluster.backend == "local":
        return cluster._workers[0].holding()
    return cluster._on_rank(0, "holding").result()[0]


async def until_held(cluster: HeldInferCluster, request_id: str) -> None:
    """Wait until the rank's engine holds ``request_id`` (its batch reached the worker)."""

    async def poll() -> None:
        while request_id not in await asyncio.to_thread(holding, cluster):
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), GUARD_S)
    except TimeoutError:
        raise AssertionError(
            f"{request_id} never reached the rank while an earlier batch was running there"
        ) from None


def short_turns_pass_long_ones(cluster: HeldInferCluster) -> None:
    """Two long turns in two batches, then a short one and a refused one: the short one ends while
    both long ones still run, the refused one fails alone, and an abort ends each long one."""
    [engine] = cluster.rank_engines()
    router = EngineRouter([engine])

    async def go() -> None:
        first = router.start_generate(GenerationRequest("long1/0", PROMPT, 10**6))
        await until_held(cluster, "long1/0")
        second = router.start_generate(GenerationRequest("long2/0", PROMPT, 10**6))
        await until_held(cluster, "long2/0")  # a second batch runs beside the first
        short = router.start_generate(GenerationRequest("short/0", PROMPT, 2))
        bad = router.start_generate(GenerationRequest("bad/0", PROMPT, 2))
        done, _ = await asyncio.wait([short, bad], timeout=GUARD_S)
        assert short in done, "a short turn waited for the long ones running on its rank"
        assert (short.result().finish_reason, short.result().token_ids) == ("length", [1, 2])
        assert isinstance(bad.exception(), WorkerCallError)
        assert "'bad/0': refused" in str(bad.exception())
        assert not first.done() and not second.done()
        await router.abort("long1/0")  # an abort reaches each running batch
        await router.abort("long2/0")
        ended = await asyncio.wait_for(asyncio.gather(first, second), GUARD_S)
        assert [r.finish_reason for r in ended] == ["abort", "abort"]
        await engine.close()

    asyncio.run(go())


def held_cluster(policy_dir: Path, backend: str) -> HeldInferCluster:
    return HeldInferCluster(
        "actor_infer",
        RoleConfig(strategy="hf", device_mapping=[], num_workers=1),
        backend=backend,  # type: ignore[arg-type]
        worker_kwargs={"model_path": str(policy_dir)},
    )


def test_a_short_turn_does_not_wait_for_long_ones_on_its_rank(policy_dir: Path) -> None:
    cluster = held_cluster(policy_dir, "local")
    try:
        short_turns_pass_long_ones(cluster)
    finally:
        cluster.shutdown()


def test_a_short_turn_does_not_wait_for_long_ones_on_a_ray_rank(
    policy_dir: Path, local_ray: None
) -> None:
    cluster = held_cluster(policy_dir, "ray")
    try:
        short_turns_pass_long_ones(cluster)
    finally:
        cluster.shutdown()


def test_a_request_the_rank_cannot_serve_fails_alone(policy_dir: Path) -> None:
    """Three turns batched with one whose token id is outside the vocabulary (a real ``hf``
    engine): the three are generated, the fourth fails with the engine's reason."""
    cluster = InferCluster(
        "actor_infer",
        RoleConfig(strategy="hf", device_mapping=[], num_workers=1),
        backend="local",
        worker_kwargs={"model_path": str(policy_dir)},
    )
    [engine] = cluster.rank_engines()

    async def go() -> list[Any]:
        calls = [
            engine.generate(GenerationRequest(f"ep{i}/0", PROMPT, 4, temperature=0.0))
            for i in range(3)
        ]
        calls.append(engine.generate(GenerationRequest("bad/0", [5, 6, 10**6], 4)))
        try:
            return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            await engine.close()

    try:
        *good, bad = asyncio.run(asyncio.wait_for(go(), GUARD_S))
    finally:
        cluster.shutdown()
    assert [(r.request_id, r.finish_reason, len(r.token_ids)) for r in good] == [
        (f"ep{i}/0", "length", 4) for i in range(3)
    ]
    assert isinstance(bad, WorkerCallError) and "'bad/0'" in str(bad)
    assert "outside the model's vocabulary" in str(bad)


def test_an_abort_right_after_its_batch_left_the_queue_reaches_the_rank(policy_dir: Path) -> None:
    """Between the front taking a batch off its queue and the batch's task first running, its
    requests are neither queued nor running on the rank: an abort then (an episode's callback
    already in the loop's ready queue; a weight load's pause) must still stop them."""
    cluster = held_cluster(policy_dir, "local")
    [engine] = cluster.rank_engines()
    dispatch = engine._dispatch

    async def dispatch_then_abort(batch: Any) -> None:
        await dispatch(batch)  # the batch's task is made, and has not run yet
        for request, _ in batch:
            await engine.abort(request.request_id)

    engine._dispatch = dispatch_then_abort  # type: ignore[method-assign]

    async def play() -> tuple[str, list[str]]:
        result = await asyncio.wait_for(
            engine.start_generate(GenerationRequest("long1/0", PROMPT, 10**6)), GUARD_S
        )
        still = holding(cluster)
        await engine.close()
        return result.finish_reason, still

    try:
        finish, still = asyncio.run(play())
    finally:
        cluster.shutdown()
    assert finish == "abort" and still == []


def test_a_request_its_caller_gave_up_stops_on_the_rank(policy_dir: Path) -> None:
    """A turn given up (``rollout.generate_timeout_s``: the router cancels its part) must not
    keep generating on the rank, holding its slot to ``max_new_tokens``."""
    cluster = held_cluster(policy_dir, "local")
    [engine] = cluster.rank_engines()
    router = EngineRouter([engine])

    async def released() -> None:
        while "long1/0" in await asyncio.to_thread(holding, cluster):
            await asyncio.sleep(0.01)

    async def play() -> None:
        answer = router.start_generate(GenerationRequest("long1/0", PROMPT, 10**6))
        await until_held(cluster, "long1/0")
        answer.cancel()
        try:
            await asyncio.wait_for(released(), GUARD_S)
        finally:
            await engine.close()

    try:
        asyncio.run(play())
    finally:
        cluster.shutdown()
