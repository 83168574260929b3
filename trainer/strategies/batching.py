"""``BatchingFrontend``: the async half of an inference engine: queue requests, gather the ones
that arrive while the event loop is busy into a batch, hand each batch to the engine.

``HFEngine`` (``trainer.strategies.hf_engine``) runs it over its own decoding thread; the
driver's ``RankEngine`` (``trainer.workers.infer``) over one rank of the ``actor_infer``
cluster, with several batches in flight there at once (``max_batches``), so a short turn
gathered while a long one runs does not wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from trainer.strategies.base import GenerationRequest, GenerationResult
from trainer.weights.versioned import PolicyVersion, SharedVersion

__all__ = ["BatchingFrontend", "Outcome", "RunBatch", "fail_batch"]

Outcome = GenerationResult | BaseException
"""What one request of a batch came to: its result, or the error that failed it alone."""
RunBatch = Callable[[list[GenerationRequest]], Awaitable[Sequence[Outcome]]]
Waiter = tuple[GenerationRequest, asyncio.Future[GenerationResult]]
"""A queued request and the future its caller waits on."""


class BatchingFrontend:
    """The async half of an engine: queue requests, gather them into batches, run each batch.

    What does the compute (a local torch model in a thread, or a call to the ``actor_infer``
    cluster), one of:

    - ``run_batch(requests)`` (a method, or the callable given): one ``Outcome`` per request,
      in order; raising fails every request of the batch;
    - ``answers(requests)``: ``(index, outcome)`` as each request ends, so a request is
      answered before the rest of its batch (by default, ``run_batch``'s all at once);
    - ``_dispatch(batch)``: for an engine that admits requests into its running batch itself
      (``HFEngine``); it hands them over and returns.

    Up to ``max_batches`` batches are in flight at once: while they run, the front gathers the
    next one (a request that arrives meanwhile waits for a free slot, and is answered as soon
    as its own batch says; a short turn does not wait for a long turn of another batch).
    ``generate``/``abort``/``close`` are the ``InferenceEngine`` methods every such engine
    shares.

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
        max_batches: int = 1,
        policy: PolicyVersion | None = None,
    ) -> None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches!r}")
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_batches = max_batches
        self.policy = policy if policy is not None else PolicyVersion()
        self._queue: list[Waiter] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._batches: dict[asyncio.Task[None], list[Waiter]] = {}
        """Batches handed over and not answered yet (at most ``max_batches``)."""
        self._room: asyncio.Event | None = None

    async def run_batch(self, requests: list[GenerationRequest]) -> Sequence[Outcome]:
        if self._run_batch is None:
            raise NotImplementedError(f"{type(self).__name__} needs run_batch")
        return await self._run_batch(requests)

    async def answers(
        self, requests: list[GenerationRequest]
    ) -> AsyncIterator[tuple[int, Outcome]]:
        """``(index in requests, outcome)`` for each request as it ends (here: ``run_batch``'s,
        all once the batch ended); raising fails the requests not answered yet."""
        for index, outcome in enumerate(await self.run_batch(requests)):
            yield index, outcome

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
            self._room = None
            self._batches = {task: b for task, b in self._batches.items() if not task.done()}
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

    def dispatched(self, request_id: str) -> bool:
        """Whether ``request_id`` is in a batch handed over whose task has not ended (it may
        not have run yet: then the request is neither queued here nor running in the engine;
        or its caller gave it up while the engine still runs it)."""
        return any(
            request.request_id == request_id
            for batch in self._batches.values()
            for request, _ in batch
        )

    async def close(self) -> None:
        """Stop the batching task and the batches in flight (their requests, and the pending
        ones, are answered ``abort``)."""
        for request, future in self._queue:
            if not future.done():
                future.set_result(
                    GenerationResult(request.request_id, [], [], "abort", self.version)
                )
        self._queue.clear()
        tasks = [self._task] if self._task is not None else []
        tasks += list(self._batches)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await task
        self._task = None

    # ------------------------------------------------------------------ batching
    async def _serve(self, wake: asyncio.Event) -> None:
        while True:
            await wake.wait()
            wake.clear()
            while len(self._batches) >= self.max_batches:  # gather once a slot is free
                self._room = self._room or asyncio.Event()
                self._room.clear()
                await self._room.wait()
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

    async def _dispatch(self, batch: list[Waiter]) -> None:
        """Hand one gathered batch over and return: a task answers each of its requests as it
        ends (an engine that admits requests into a running batch itself overrides this)."""
        task = asyncio.get_running_loop().create_task(self._answer(batch))
        self._batches[task] = batch
        task.add_done_callback(self._batch_ended)

    def _batch_ended(self, task: asyncio.Task[None]) -> None:
        self._batches.pop(task, None)
        if self._room is not None:
            self._room.set()

    async def _answer(self, batch: list[Waiter]) -> None:
        """Answer each waiter of ``batch`` with its outcome (``answers``); whatever fails the
        batch fails the waiters not answered yet; a cancelled batch (``close``) answers them
        ``abort``."""
        try:
            async for index, outcome in self.answers([r for r, _ in batch]):
                future = batch[index][1]
                if future.done():  # given up on meanwhile
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
        except asyncio.CancelledError:
            for request, future in batch:
                if not future.done():
                    future.set_result(
                        GenerationResult(request.request_id, [], [], "abort", self.version)
                    )
            raise
        except Exception as error:  # noqa: BLE001 - handed to every waiting future
            fail_batch(batch, error)
        else:
            fail_batch(batch, RuntimeError(f"{type(self).__name__} gave these requests no answer"))


def fail_batch(batch: list[Waiter], error: BaseException) -> None:
    """Whatever failed a batch reaches every waiter, who re-raises it, instead of leaving them
    hanging; it may be of any type."""
    for _, future in batch:
        if not future.done():
            future.set_exception(error)
