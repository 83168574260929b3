"""``BatchingFrontend``: requests gathered into batches, aborts answered, nothing kept after."""

from __future__ import annotations

import asyncio
import tracemalloc

from trainer.strategies.base import GenerationRequest, GenerationResult
from trainer.strategies.batching import BatchingFrontend


def test_aborts_answer_queued_requests_and_a_long_runs_aborts_are_not_kept() -> None:
    """A run aborts surplus turns all the time (redundancy, staleness, timeouts), mostly of
    requests that already ended or never reached the front: none of them may be kept."""
    release = asyncio.Event()

    async def run_batch(requests: list[GenerationRequest]) -> list[GenerationResult]:
        await release.wait()
        return [GenerationResult(r.request_id, [7], [-0.5], "stop", 0) for r in requests]

    async def scenario() -> None:
        front = BatchingFrontend(run_batch, max_batch_size=1)
        running = front.start_generate(GenerationRequest("running", [1, 2], max_new_tokens=1))
        queued = front.start_generate(GenerationRequest("queued", [1], max_new_tokens=1))
        await front.abort("queued")
        assert (await queued).finish_reason == "abort"
        release.set()
        assert (await running).token_ids == [7]

        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):  # ended, or never here
            await front.abort(f"episode-{i}-turn-3")
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        await front.close()
        assert grown < 200_000, f"{grown} bytes kept for 20,000 aborts of requests not held"

    asyncio.run(scenario())


def test_batches_run_side_by_side_up_to_max_batches_and_the_rest_queue() -> None:
    """A front hands a batch over and gathers the next while it runs, up to ``max_batches`` at
    once; later requests wait in the queue (a front over a worker rank, ``RankEngine``, keeps
    a short turn from waiting for a long one this way)."""
    started: list[list[str]] = []
    release = asyncio.Event()

    async def run_batch(requests: list[GenerationRequest]) -> list[GenerationResult]:
        started.append([r.request_id for r in requests])
        await release.wait()
        return [GenerationResult(r.request_id, [7], [-0.5], "stop", 0) for r in requests]

    async def scenario() -> list[GenerationResult]:
        front = BatchingFrontend(run_batch, max_batch_size=1, max_batches=2)
        calls = [front.start_generate(GenerationRequest(f"r{i}", [1], 1)) for i in range(4)]
        for _ in range(50):  # the front gathers and hands over all it may
            await asyncio.sleep(0)
        assert started == [["r0"], ["r1"]]  # two in flight, the others queued
        release.set()
        results = list(await asyncio.gather(*calls))
        await front.close()
        return results

    results = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3"]
    assert started == [["r0"], ["r1"], ["r2"], ["r3"]]
