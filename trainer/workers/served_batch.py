"""A batch on an ``actor_infer`` worker: its requests handed to the running engine, one future
each (``InferWorker.start_batch``).

An engine that batches continuously (``HFEngine``, ``VLLMEngine``) takes the requests between
two of its steps and answers each as it ends, so batches from several callers run side by side
in it. A request the engine cannot serve gets a failed future of its own; the others go on.
An engine that only runs whole batches (``generate_batch``) runs each on a thread of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from trainer.strategies.base import GenerationRequest, GenerationResult
from trainer.strategies.batching import Outcome

__all__ = ["ServedBatch", "as_they_end", "chain", "run_whole", "settled", "submitter"]


@dataclass
class ServedBatch:
    """A batch handed to a worker's engine (``InferWorker.start_batch``)."""

    requests: list[GenerationRequest]
    futures: list[cf.Future[GenerationResult]]
    """One per request, in order: its result, or the error that failed it alone."""
    version: int | None
    """The weight version the batch started under (``VersionedEngine``); None without one."""
    ran: list[bool]
    """Per request: it went to the engine (not aborted before it arrived)."""

    @property
    def running(self) -> list[str]:
        """The ids that went to the engine."""
        return [r.request_id for r, ran in zip(self.requests, self.ran, strict=True) if ran]

    def unfinished(self) -> list[str]:
        """The ids that went to the engine and have not ended yet."""
        return [
            request.request_id
            for request, future, ran in zip(self.requests, self.futures, self.ran, strict=True)
            if ran and not future.done()
        ]

    def outcome(self, index: int) -> Outcome:
        """Request ``index``'s result (labelled with ``version``) or error, once it ended."""
        future = self.futures[index]
        error = future.exception()
        if error is not None:
            return error
        result = future.result()
        if self.version is not None and self.ran[index]:
            result.policy_version = self.version
        return result


def submitter(engine: Any) -> Callable[[list[GenerationRequest]], list[cf.Future[Any]]] | None:
    """How ``engine`` takes requests into its running batch without blocking (one future per
    request; a request it refuses gets a failed future of its own), or None for an engine that
    only runs whole batches (``generate_batch``)."""
    submit_many = getattr(engine, "submit_many", None)
    if submit_many is not None:
        return functools.partial(_submit_all, submit_many)
    submit = getattr(engine, "submit", None)
    return None if submit is None else functools.partial(_submit_each, submit)


def _submit_all(submit_many: Any, batch: list[GenerationRequest]) -> list[cf.Future[Any]]:
    """``submit_many(batch)`` (one admission), or, when it raises (an engine shut down, or
    refusing to serve after a failed weight load), a future per request failed with why."""
    try:
        return list(submit_many(batch))
    except Exception as error:  # noqa: BLE001 - each request's caller re-raises it
        return [settled(error) for _ in batch]


def _submit_each(submit: Any, batch: list[GenerationRequest]) -> list[cf.Future[Any]]:
    """``submit(request)`` for each request; one that raises gets a future failed with why."""
    futures = []
    for request in batch:
        try:
            futures.append(submit(request))
        except Exception as error:  # noqa: BLE001 - that request's caller re-raises it
            futures.append(settled(error))
    return futures


def settled(outcome: Outcome) -> cf.Future[Any]:
    """A future that already holds ``outcome`` (a result, or an error)."""
    future: cf.Future[Any] = cf.Future()
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
    return future


def chain(source: cf.Future[Any], target: cf.Future[Any]) -> None:
    """Answer ``target`` as ``source`` is answered."""

    def copy(done: cf.Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)


def run_whole(
    engine: Any, requests: list[GenerationRequest], futures: list[cf.Future[Any]]
) -> None:
    """Run ``requests`` with ``engine.generate_batch`` (an engine with no ``submit``) and answer
    their futures; what fails the batch fails each of them."""
    try:
        results = engine.generate_batch(requests)
    except Exception as error:  # noqa: BLE001 - each request's caller re-raises it
        for future in futures:
            future.set_exception(error)
        return
    for future, result in zip(futures, results, strict=True):
        future.set_result(result)


async def as_they_end(
    batch: ServedBatch, end: Callable[[ServedBatch], None]
) -> AsyncIterator[tuple[int, Outcome]]:
    """``(index, outcome)`` of each request of ``batch`` as it ends, read on this event loop;
    ``end(batch)`` (``InferWorker.end_batch``) once they all did, or the caller stopped
    reading."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Queue[int] = asyncio.Queue()

    def tell(index: int) -> Callable[[cf.Future[Any]], None]:
        def told(_: cf.Future[Any]) -> None:
            try:
                loop.call_soon_threadsafe(ended.put_nowait, index)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        return told

    try:
        for index, future in enumerate(batch.futures):
            future.add_done_callback(tell(index))
        for _ in batch.futures:
            index = await ended.get()
            yield index, batch.outcome(index)
    finally:
        end(batch)
