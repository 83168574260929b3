"""``actor_infer``: generation workers, and ``RankEngine``, the driver's engine for one of them.

Each ``InferWorker`` holds an engine (``HFEngine`` by default, ``VLLMEngine`` with ``strategy:
vllm``) and answers batches of ``GenerationRequest`` sent to its rank. The driver's rollouts
(``trainer.rollout.rollouts``) talk to one ``RankEngine`` per rank through the
``EngineRouter``: the same batching front as ``HFEngine`` (requests gathered from all
running episodes), whose batches run on that rank, several at once (``BATCHES_IN_FLIGHT``):
each joins the engine's running batch, and each request is answered as it ends, so a short
turn never waits for a long one. A request the rank cannot serve fails alone (its own error;
the others of its batch go on). Weight updates and sampling-RNG state go to every rank
through the cluster.

An abort of a request that is already in the rank's running batch stops it inside the
engine at once (vLLM's real abort frees its slot; ``hf`` ends its row at the next token), on
both backends: a Ray worker actor runs ``abort_requests`` in a concurrency group of its own,
alongside the batches (which run in the ``generate`` group); on the local backend the driver's
thread hands batches to the in-process engine and aborts there directly.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

from trainer.config import RoleConfig
from trainer.controller.cluster import CallFuture, Cluster, remote
from trainer.controller.dispatch import Collect, Dispatch, method_spec, register
from trainer.controller.worker import Worker, WorkerContext
from trainer.errors import DispatchError, WorkerCallError
from trainer.strategies.base import GenerationRequest, GenerationResult, InferenceEngine, Weights
from trainer.strategies.batching import BatchingFrontend, Outcome
from trainer.strategies.registry import make_engine
from trainer.weights.receiver import WeightReceiver, WeightReceiverCluster
from trainer.weights.versioned import PolicyVersion
from trainer.workers.served_batch import (
    ServedBatch,
    as_they_end,
    chain,
    run_whole,
    settled,
    submitter,
)

__all__ = ["BATCHES_IN_FLIGHT", "InferCluster", "InferWorker", "RankEngine"]

BATCHES_IN_FLIGHT = 16
"""Batches the driver's ``RankEngine`` keeps in flight on its rank (the rank's Ray actor runs
them in its ``generate`` concurrency group, one thread each; each joins the running engine)."""
_ROUTED_BATCHES = 16
"""Batches one rank runs at once for env workers that route their own turns (each worker has
one batch in flight per rank; ``generate_requests`` hands them all to the running engine)."""

_EARLY_ABORTS_KEPT = 4096
"""Aborted ids a worker remembers while their batch has not arrived (oldest forgotten first)."""


class InferWorker(WeightReceiver, Worker):
    """One rank of the generation role."""

    def __init__(
        self,
        ctx: WorkerContext,
        config: RoleConfig | None = None,
        *,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        adapter_rank: int | None = None,
    ) -> None:
        super().__init__(ctx, config)
        self.config: RoleConfig = config if config is not None else RoleConfig(device_mapping=[])
        lora = {"lora_rank": adapter_rank} if adapter_rank is not None else {}
        self.engine: InferenceEngine = make_engine(
            self.config.strategy,
            model_path,
            dtype=dtype,
            seed=seed + 7 * ctx.rank,
            **lora,  # LoRA adapters will arrive with the syncs (model.lora.sync: adapter)
            **self.config.strategy_args,
        )
        # ``abort_requests`` runs on another thread than ``generate_requests`` (a Ray concurrency
        # group, or the driver's thread on the local backend); the lock orders the two.
        self._abort_lock = threading.Lock()
        self._early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Aborted ids not in a running batch yet: refused when their batch arrives."""
        self._running_ids: collections.Counter[str] = collections.Counter()
        """Ids in the batches running here (a count: batches run side by side)."""

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def update_weights(self, weights: dict[str, Any]) -> None:
        self.engine.update_weights(weights)

    @register(Dispatch.ONE_TO_ALL)
    def generate_requests(self, requests: list[GenerationRequest]) -> list[Outcome]:
        """This rank's batch (``InferCluster.generate_on`` sends it to one rank only): one
        outcome per request, in order, once all ended: its result, or the error that failed it
        alone (a request the engine cannot serve; the others go on).

        ``abort_requests`` may run while this does (see there), and so may other batches: each
        joins the running engine. A request aborted before its batch got here is answered
        ``finish_reason="abort"`` with no tokens."""
        batch = self.start_batch(requests)
        try:
            cf.wait(batch.futures)
            return [batch.outcome(index) for index in range(len(requests))]
        finally:
            self.end_batch(batch)

    def generate_each(self, requests: list[GenerationRequest]) -> Iterator[tuple[int, Outcome]]:
        """``generate_requests``, each ``(index, outcome)`` as its request ends (a Ray
        streaming call: the driver's ``RankEngine`` answers every request on its own)."""
        batch = self.start_batch(requests)
        try:
            index_of = {id(future): index for index, future in enumerate(batch.futures)}
            for future in cf.as_completed(batch.futures):
                index = index_of[id(future)]
                yield index, batch.outcome(index)
        finally:
            self.end_batch(batch)

    def start_batch(self, requests: list[GenerationRequest]) -> ServedBatch:
        """Hand ``requests`` to the running engine and return at once, with a future per
        request (``end_batch`` once they are all done). Any thread may call it, several at
        once: the local backend's driver does (``InferCluster.stream_on``). Raises only when
        the engine serves no complete weights (``VersionedEngine``: a sync half done)."""
        requests = list(requests)
        engine = self._inner_engine()
        # vLLM, HFEngine: requests join the running engine (HFEngine's in one admission)
        submit = submitter(engine)
        futures: list[cf.Future[GenerationResult]] = []
        ran: list[bool] = []
        version: int | None = None
        with self._abort_lock:
            if submit is not None and any(r.request_id not in self._early_aborts for r in requests):
                version = self._served_version()  # before an early abort is used up
            for request in requests:
                ran.append(request.request_id not in self._early_aborts)
                if ran[-1]:
                    futures.append(cf.Future())
                    continue
                del self._early_aborts[request.request_id]
                aborted = GenerationResult(request.request_id, [], [], "abort", self.engine.version)
                futures.append(settled(aborted))
            run = [r for r, went in zip(requests, ran, strict=True) if went]
            waiting = [f for f, went in zip(futures, ran, strict=True) if went]
            if submit is not None and run:  # in the engine before any later abort reaches it
                for submitted, future in zip(submit(run), waiting, strict=True):
                    chain(submitted, future)
            self._running_ids.update(r.request_id for r in run)
        if submit is None and run:  # a blocking engine: the batch runs on a thread of its own
            threading.Thread(
                target=run_whole,
                args=(self.engine, run, waiting),
                name="infer-batch",
                daemon=True,
            ).start()
        return ServedBatch(requests, futures, version, ran)

    def end_batch(self, batch: ServedBatch) -> None:
        """``batch`` ends here: its requests still running (its caller gave them up) are aborted
        in the engine; an abort of any of its ids from now on is kept for a later batch."""
        engine = self._inner_engine()
        with self._abort_lock:
            given_up = batch.unfinished()
            if given_up and hasattr(engine, "abort_sync"):
                engine.abort_sync(given_up)
            for request_id in batch.running:
                self._running_ids[request_id] -= 1
                if self._running_ids[request_id] <= 0:
                    del self._running_ids[request_id]

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests now, inside the engine, even mid-batch: vLLM aborts them for real
        (their KV slots are freed), a batch engine (``hf``) stops their rows at the next token.

        It runs while ``generate_requests`` is in flight: the local backend calls it from the
        driver's thread, and on Ray it has a concurrency group of its own (``InferCluster``).
        Ids whose batch has not reached this worker yet are remembered and refused on arrival
        (the last few thousand; an id that had already finished is kept there harmlessly)."""
        engine = self._inner_engine()
        with self._abort_lock:
            running = [rid for rid in request_ids if rid in self._running_ids]
            for rid in request_ids:
                if rid not in self._running_ids:
                    self._early_aborts[rid] = None
                    self._early_aborts.move_to_end(rid)
            while len(self._early_aborts) > _EARLY_ABORTS_KEPT:  # ids that had already finished
                self._early_aborts.popitem(last=False)
            if running and hasattr(engine, "abort_sync"):  # inside the engine, mid-batch
                engine.abort_sync(running)

    def _inner_engine(self) -> Any:
        """The engine under the weight sync's ``VersionedEngine`` (if any)."""
        return getattr(self.engine, "engine", self.engine)

    def _served_version(self) -> int | None:
        """The weight version a ``VersionedEngine`` serves (raises while half-updated); None
        without one."""
        check = getattr(type(self.engine), "check", None)
        return check(self.engine) if check is not None else None

    @register(Dispatch.ONE_TO_ALL)
    def get_state(self) -> dict[str, Any]:
        return self.engine.get_state()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def set_state(self, states: list[dict[str, Any]]) -> None:
        self.engine.set_state(states[self.rank])

    def offload(self) -> None:
        self.engine.sleep()
        super().offload()

    def close(self) -> None:
        """Release the engine (a vLLM engine's thread and KV cache) when the cluster shuts down,
        then the weight sync's shared memory (also when the engine fails to stop)."""
        shutdown = getattr(getattr(self.engine, "engine", self.engine), "shutdown", None)
        try:
            if callable(shutdown):
                shutdown()
        finally:
            self.close_weight_receiver()

    def reload(self) -> None:
        self.engine.wake_up()
        super().reload()


class InferCluster(WeightReceiverCluster, Cluster):
    """Typed calls to the ``actor_infer`` workers."""

    worker_cls = InferWorker
    ray_concurrency_groups: ClassVar[dict[str, int]] = {
        "abort": 1,
        "generate": BATCHES_IN_FLIGHT,
        "routed": _ROUTED_BATCHES,
    }
    # abort_requests runs while batches are in flight; "generate": the driver's batches
    # (``RankEngine``), several at once; "routed": the env workers' batches when they route
    # their own turns (``worker_engines``), several at once
    ray_method_groups: ClassVar[dict[str, str]] = {
        "abort_requests": "abort",
        "generate_requests": "generate",
        "generate_each": "generate",
    }

    update_weights = remote(InferWorker.update_weights)
    get_state = remote(InferWorker.get_state, per_rank=True)
    set_state = remote(InferWorker.set_state)

    # by hand: the router's calls go to one rank, not to all as InferWorker's modes say
    async def stream_on(
        self, rank: int, requests: list[GenerationRequest]
    ) -> AsyncIterator[tuple[int, GenerationResult | WorkerCallError]]:
        """Generate ``requests`` on rank ``rank`` only (the router's per-worker path), yielding
        ``(index, outcome)`` as each request ends: its result, or a ``WorkerCallError`` for a
        request the rank could not serve (the others go on). Batches run side by side there:
        in-process workers get them from this thread, straight into the engine
        (``InferWorker.start_batch``); a Ray actor runs each as a streaming call in its
        ``generate`` concurrency group. Raises ``WorkerCallError`` when the whole batch
        failed (the worker died, or serves a half-done weight sync)."""
        if self._closed:
            raise DispatchError(f"{self!r} is shut down; create a new cluster")
        if self.backend == "ray":
            outcomes = self._stream_ray(rank, requests)
        else:
            worker = self._workers[rank]
            try:
                batch = worker.start_batch(requests)
            except Exception as error:
                raise self._fail("generate_requests", rank, error) from error
            outcomes = as_they_end(batch, worker.end_batch)
        async for index, outcome in outcomes:
            if isinstance(outcome, BaseException):
                outcome = self._fail("generate_requests", rank, outcome)
            yield index, outcome

    async def generate_on(
        self, rank: int, requests: list[GenerationRequest]
    ) -> list[GenerationResult]:
        """``stream_on``'s results in order, once all ended; the first failed request's
        ``WorkerCallError`` is raised."""
        outcomes: dict[int, GenerationResult | WorkerCallError] = {}
        async for index, outcome in self.stream_on(rank, requests):
            outcomes[index] = outcome
        results = [outcomes[index] for index in range(len(requests))]
        for outcome in results:
            if isinstance(outcome, WorkerCallError):
                raise outcome
        return [r for r in results if isinstance(r, GenerationResult)]

    async def _stream_ray(
        self, rank: int, requests: list[GenerationRequest]
    ) -> AsyncIterator[tuple[int, Outcome]]:
        import ray

        call = self._workers[rank].generate_each.options(concurrency_group="generate")
        left = {index: request.request_id for index, request in enumerate(requests)}
        try:
            async for ref in call.remote(requests):
                index, outcome = await ref
                left.pop(index, None)
                yield index, outcome
        except ray.exceptions.RayError as error:
            raise self._fail("generate_requests", rank, error) from error
        except (asyncio.CancelledError, GeneratorExit):  # given up: stop them on the rank too
            if left and not self._closed:
                self.abort_on(rank, list(left.values()))
            raise

    def abort_on(self, rank: int, request_ids: list[str]) -> CallFuture[None] | None:
        """Abort requests sent to ``rank``, also inside its running batches
        (``InferWorker.abort_requests``). In-process workers get it at once, from this thread; a
        Ray actor runs it in its ``abort`` concurrency group, alongside the batches (returns
        that call's future)."""
        if self.backend == "local":
            self._workers[rank].abort_requests(request_ids)
            return None
        return self._on_rank(rank, "abort_requests", request_ids)

    def rank_engines(
        self,
        *,
        max_batch_size: int = 512,
        max_batches: int = BATCHES_IN_FLIGHT,
        policy: PolicyVersion | None = None,
    ) -> list[RankEngine]:
        """One ``RolloutEngine`` per rank, for ``trainer.rollout.router.EngineRouter``, each
        with up to ``max_batches`` batches in flight (``rollout.batches_in_flight``); they all
        report ``policy`` (the run's ``WeightSync.policy``) as their version."""
        policy = policy if policy is not None else PolicyVersion()
        return [
            RankEngine(
                self, rank, max_batch_size=max_batch_size, max_batches=max_batches, policy=policy
            )
            for rank in range(self.world_size)
        ]

    def worker_engines(self, *, max_batch_size: int = 512) -> WorkerRankEngines:
        """What each env worker builds its engines with when it routes its own turns
        (``rollout.route_in_workers``: ``trainer.rollout.worker_routing``): one front per rank,
        calling the rank's Ray actor directly."""
        if self.backend != "ray" or not self.actor_names:
            raise ValueError(
                "rollout.route_in_workers needs the actor_infer workers as Ray actors "
                "(cluster.backend: ray): an env worker process cannot reach workers that live "
                "in the driver; set cluster.backend: ray, or route in the driver "
                "(rollout.route_in_workers: false)"
            )
        import ray

        context = ray.get_runtime_context()
        return WorkerRankEngines(
            context.gcs_address, context.namespace, list(self.actor_names), max_batch_size
        )

    def _on_rank(self, rank: int, method: str, *args: Any) -> CallFuture[Any]:
        """Call ``method`` on rank ``rank`` alone (its result is a one-item list)."""
        spec = method_spec(self.worker_cls, method)
        return CallFuture(self, spec, [rank], [self._submit(rank, method, args, {})])


class RankEngine(BatchingFrontend):
    """``RolloutEngine`` (``trainer.rollout.router``) in the driver for ONE rank of an
    ``InferCluster``: requests queued here run as batches on that rank, up to ``max_batches``
    at once, each request answered as it ends; ``abort`` also reaches a request in any batch
    running there."""

    def __init__(
        self,
        cluster: InferCluster,
        rank: int,
        *,
        max_batch_size: int = 512,
        max_batches: int = BATCHES_IN_FLIGHT,
        policy: PolicyVersion | None = None,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, max_batches=max_batches, policy=policy)
        self.cluster, self.rank = cluster, rank
        self._running: collections.Counter[str] = collections.Counter()
        """Ids of the requests running on the rank (a count: batches run side by side)."""

    async def answers(
        self, requests: list[GenerationRequest]
    ) -> AsyncIterator[tuple[int, Outcome]]:
        """Each request's outcome as the rank says it ended (a batch given up, on ``close``,
        is aborted on the rank: ``InferCluster.stream_on``)."""
        left = {index: r.request_id for index, r in enumerate(requests)}
        self._running.update(left.values())
        try:
            async for index, outcome in self._outcomes(requests):
                if left.pop(index, None) is not None:
                    self._leave([requests[index].request_id])
                yield index, outcome
        finally:
            self._leave(list(left.values()))

    async def abort(self, request_id: str) -> None:
        """Also on the rank when the request may be there: running, or in a batch handed over
        whose task has not sent it yet (the rank refuses an id aborted before it arrives)."""
        await super().abort(request_id)
        self._stop_on_rank(request_id)

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        """``BatchingFrontend.start_generate``; a request whose caller gives it up (cancels the
        future: ``rollout.generate_timeout_s``) is aborted on the rank too, not left generating
        there to ``max_new_tokens``."""
        future = super().start_generate(request)
        request_id = request.request_id
        future.add_done_callback(
            lambda done: self._stop_on_rank(request_id) if done.cancelled() else None
        )
        return future

    def _stop_on_rank(self, request_id: str) -> None:
        if request_id in self._running or self.dispatched(request_id):
            self._abort_running([request_id])

    def _leave(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._running[request_id] -= 1
            if self._running[request_id] <= 0:
                del self._running[request_id]

    def _outcomes(self, requests: list[GenerationRequest]) -> AsyncIterator[tuple[int, Outcome]]:
        return self.cluster.stream_on(self.rank, requests)

    def _abort_running(self, request_ids: list[str]) -> None:
        self.cluster.abort_on(self.rank, request_ids)

    def update_weights(self, weights: Weights) -> None:
        """This rank only (a run's weight sync updates every rank at once instead). The version
        is the caller's to advance (``EngineRouter.update_weights``): the ranks share one."""
        self.cluster._on_rank(self.rank, "update_weights", dict(weights)).result()

    def sleep(self) -> None:
        """Colocated memory release is cluster-wide (``InferCluster.offload``, called by
        ``trainer.devices.Colocation``)."""

    def wake_up(self) -> None:
        """See ``sleep``."""

    def get_state(self) -> dict[str, Any]:
        return {"rank": self.cluster._on_rank(self.rank, "get_state").result()[0]}

    def set_state(self, state: dict[str, Any]) -> None:
        states: list[Any] = [None] * self.cluster.world_size
        states[self.rank] = state["rank"]
        self.cluster._on_rank(self.rank, "set_state", states).result()


class WorkerRankEngines:
    """``EngineSetup`` (``trainer.rollout.worker_routing``) of an env worker that routes its own
    turns to a Ray ``InferCluster``: it joins the run's Ray cluster and builds one
    ``RoutedRankEngine`` per rank (picklable: it travels to each worker)."""

    def __init__(
        self, address: str, namespace: str, actor_names: list[str], max_batch_size: int
    ) -> None:
        self.address, self.namespace = address, namespace
        self.actor_names, self.max_batch_size = actor_names, max_batch_size

    def __call__(self, link: Any) -> list[RoutedRankEngine]:
        import ray

        if not ray.is_initialized():
            ray.init(
                address=self.address,
                namespace=self.namespace,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
        return [
            RoutedRankEngine(ray.get_actor(name), rank, max_batch_size=self.max_batch_size)
            for rank, name in enumerate(self.actor_names)
        ]


class RoutedRankEngine(RankEngine):
    """``RankEngine`` in an env worker: the same batching front, calling the rank's Ray actor
    directly (its batches run in the actor's ``routed`` concurrency group, alongside other
    workers'), one batch at a time per rank: the group's threads are shared by every env
    worker, and a batch is answered whole. Weight loads and engine state are the driver's
    (``WorkerRouters``)."""

    def __init__(self, actor: Any, rank: int, *, max_batch_size: int = 512) -> None:
        BatchingFrontend.__init__(self, max_batch_size=max_batch_size)
        self.actor, self.rank = actor, rank
        self._running = collections.Counter()

    async def _outcomes(
        self, requests: list[GenerationRequest]
    ) -> AsyncIterator[tuple[int, Outcome]]:
        outcomes: list[Outcome] = await self.actor.generate_requests.options(
            concurrency_group="routed"
        ).remote(requests)
        for index, outcome in enumerate(outcomes):
            yield index, outcome

    def _abort_running(self, request_ids: list[str]) -> None:
        self.actor.abort_requests.options(concurrency_group="abort").remote(request_ids)

    def update_weights(self, weights: Weights) -> None:
        raise RuntimeError("the driver loads weights into actor_infer (WorkerRouters)")

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """The driver's (``InferCluster.set_state``)."""
