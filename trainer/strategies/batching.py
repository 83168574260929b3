"""``BatchingFrontend``: the async half of an inference engine: queue requests, gather the ones
that arrive while the event loop is busy into a batch, hand each batch to the engine.

``HFEngine`` (``trainer.strategies.hf_engine``) runs it over its own decoding thread; the
driver's ``RankEngine`` (``trainer.workers.infer``) over one rank of the ``actor_infer``
cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from trainer.strategies.base import GenerationRequest, GenerationResult
from trainer.weights.versioned import PolicyVersion, SharedVersion

__all__ = ["BatchingFrontend", "RunBatch", "fail_batch"]

RunBatch = Callable[[list[GenerationRequest]], Awaitable[list[GenerationResult]]]


class BatchingFrontend:
    """The async half of an engine: queue requests, gather them into batches, run each batch.

    ``run_batch(requests) -> results`` does the compute (a local torch model in a thread, or
    a call to the ``actor_infer`` cluster); ``generate``/``abort``/``close`` are the
    ``InferenceEngine`` methods every such engine shares.

    ``version`` reads ``policy`` (``trainer.weights.versioned.PolicyVersion``): a front that
    loads weights itself (``HFEngine``) owns one of its own and advances it; a driver-side
    front over the ``actor_infer`` workers should be handed the run's (``WeightSync.policy``)
    and only read it.
    """

    version = SharedVersion()
    """The policy version of the weights this front serves (``policy.value``, read-only)."""

    def __init__(
        self,
        run_batch: RunBatch | None = None,
        *,
        max_batch_size: int = 512,
        policy: PolicyVersion | None = None,
    ) -> None:
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.policy = policy if policy is not None else PolicyVersion()
        self._queue: list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self._run_batch is None:
            raise NotImplementedError(f"{type(self).__name__} needs run_batch")
        return await self._run_batch(requests)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.start_generate(request)

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        """``generate`` as a future, queued for the next batch (``EngineRouter`` asks without a
        task); cancelling it gives the request up."""
        loop = asyncio.get_running_loop()
        if (
            self._wake is None
            or self._task is None
            or self._task.done()
            or self._task.get_loop() is not loop
        ):
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._serve(self._wake))
        future: asyncio.Future[GenerationResult] = loop.create_future()
        self._queue.append((request, future))
        self._wake.set()
        return future

    async def abort(self, request_id: str) -> None:
        """Answer a queued request ``abort`` at once; an engine that runs batches itself
        (``HFEngine``, ``RankEngine``) also stops one it is running. Nothing is kept of an id
        this front does not hold (ended, or never here): a run aborts many of those."""
        for request, future in list(self._queue):
            if request.request_id == request_id and not future.done():
                self._queue.remove((request, future))
                future.set_result(GenerationResult(request_id, [], [], "abort", self.version))

    async def close(self) -> None:
        """Stop the batching task (pending requests are aborted)."""
        for request, future in self._queue:
            if not future.done():
                future.set_result(
                    GenerationResult(request.request_id, [], [], "abort", self.version)
                )
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._task
            self._task = None

    # ------------------------------------------------------------------ batching
    async def _serve(self, wake: asyncio.Event) -> None:
        while True:
            await wake.wait()
            wake.clear()
            seen = -1
            while seen != len(self._queue):  # let every runnable episode enqueue its turn
                seen = len(self._queue)
                for _ in range(4):
                    await asyncio.sleep(0)
            batch, self._queue = (
                self._queue[: self.max_batch_size],
                self._queue[self.max_batch_size :],
            )
            batch = [(r, f) for r, f in batch if not f.done()]
            if batch:
                await self._dispatch(batch)
            if self._queue:
                wake.set()

    async def _dispatch(
        self, batch: list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]]
    ) -> None:
        """Run one gathered batch and answer its futures (an engine that admits requests into
        a running batch overrides this to hand them over and return at once)."""
        try:
            results = await self.run_batch([r for r, _ in batch])
        except Exception as error:  # noqa: BLE001 - handed to every waiting future
            fail_batch(batch, error)
            results = []
        for (_, future), result in zip(batch, results, strict=False):
            if not future.done():
                future.set_result(result)


def fail_batch(
    batch: list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]], error: BaseException
) -> None:
    """Whatever failed a batch reaches every waiter, who re-raises it, instead of leaving them
    hanging; it may be of any type."""
    for _, future in batch:
        if not future.done():
            future.set_exception(error)
