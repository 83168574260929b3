"""``actor_infer``: generation workers, and ``RankEngine``, the driver's engine for one of them.

Each ``InferWorker`` holds an engine (``HFEngine`` by default, ``VLLMEngine`` with ``strategy:
vllm``) and answers batches of ``GenerationRequest`` sent to its rank. The driver's rollouts
(``trainer.rollout.rollouts``) talk to one ``RankEngine`` per rank through the
``EngineRouter``: the same batching front as ``HFEngine`` (requests gathered from all
running episodes), whose batches run on that rank. Weight updates and sampling-RNG state go
to every rank through the cluster.

An abort of a request that is already in the rank's running batch stops it inside the
engine at once (vLLM's real abort frees its slot; ``hf`` ends its row at the next token), on
both backends: a Ray worker actor runs ``abort_requests`` in a concurrency group of its own,
alongside the batch.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, ClassVar

from trainer.config import RoleConfig
from trainer.controller.cluster import CallFuture, Cluster, remote
from trainer.controller.dispatch import Collect, Dispatch, method_spec, register
from trainer.controller.worker import Worker, WorkerContext
from trainer.strategies.base import GenerationRequest, GenerationResult, InferenceEngine, Weights
from trainer.strategies.batching import BatchingFrontend
from trainer.strategies.registry import make_engine
from trainer.weights.receiver import WeightReceiver, WeightReceiverCluster
from trainer.weights.versioned import PolicyVersion

__all__ = ["InferCluster", "InferWorker", "RankEngine"]

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
        self._running_ids: set[str] = set()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def update_weights(self, weights: dict[str, Any]) -> None:
        self.engine.update_weights(weights)

    @register(Dispatch.ONE_TO_ALL)
    def generate_requests(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """This rank's batch (``InferCluster.generate_on`` sends it to one rank only).

        ``abort_requests`` may run while this does (see there); a request aborted before its
        batch got here is answered ``finish_reason="abort"`` with no tokens."""
        requests = list(requests)
        engine = self._inner_engine()
        # vLLM, HFEngine: requests join the running engine (HFEngine's in one admission)
        submit = getattr(engine, "submit_many", None)
        if submit is None and getattr(engine, "submit", None) is not None:
            submit = lambda batch: [engine.submit(r) for r in batch]
        futures: list[Any] = []
        version: int | None = None
        with self._abort_lock:
            refused = {r.request_id for r in requests if r.request_id in self._early_aborts}
            for request_id in refused:
                del self._early_aborts[request_id]
            run = [r for r in requests if r.request_id not in refused]
            if submit is not None and run:
                version = self._served_version()
                futures = submit(run)  # in the engine before any later abort reaches it
            self._running_ids.update(r.request_id for r in run)
        try:
            if submit is None:
                results = self.engine.generate_batch(run) if run else []
            else:
                results = [f.result() for f in futures]
                if version is not None:
                    for result in results:
                        result.policy_version = version
        finally:
            with self._abort_lock:
                self._running_ids.difference_update(r.request_id for r in run)
        by_id = iter(results)
        return [
            GenerationResult(r.request_id, [], [], "abort", self.engine.version)
            if r.request_id in refused
            else next(by_id)
            for r in requests
        ]

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
    ray_concurrency_groups: ClassVar[dict[str, int]] = {"abort": 1, "routed": _ROUTED_BATCHES}
    # abort_requests runs while a batch is in flight; "routed": the env workers' batches when
    # they route their own turns (``worker_engines``), several at once
    ray_method_groups: ClassVar[dict[str, str]] = {"abort_requests": "abort"}

    update_weights = remote(InferWorker.update_weights)
    get_state = remote(InferWorker.get_state, per_rank=True)
    set_state = remote(InferWorker.set_state)

    # by hand: the router's calls go to one rank, not to all as InferWorker's modes say
    async def generate_on(
        self, rank: int, requests: list[GenerationRequest]
    ) -> list[GenerationResult]:
        """Generate ``requests`` on rank ``rank`` only (the router's per-worker path)."""
        return (await self._on_rank(rank, "generate_requests", requests))[0]

    def abort_on(self, rank: int, request_ids: list[str]) -> CallFuture[None] | None:
        """Abort requests sent to ``rank``, also inside its running batch
        (``InferWorker.abort_requests``). In-process workers get it at once, from this thread; a
        Ray actor runs it in its ``abort`` concurrency group, alongside the batch (returns that
        call's future)."""
        if self.backend == "local":
            self._workers[rank].abort_requests(request_ids)
            return None
        return self._on_rank(rank, "abort_requests", request_ids)

    def rank_engines(
        self, *, max_batch_size: int = 512, policy: PolicyVersion | None = None
    ) -> list[RankEngine]:
        """One ``RolloutEngine`` per rank, for ``trainer.rollout.router.EngineRouter``; they all
        report ``policy`` (the run's ``WeightSync.policy``) as their version."""
        policy = policy if policy is not None else PolicyVersion()
        return [
            RankEngine(self, rank, max_batch_size=max_batch_size, policy=policy)
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
    ``InferCluster``: requests queued here run as batches on that rank; ``abort`` also reaches
    a batch already running there."""

    def __init__(
        self,
        cluster: InferCluster,
        rank: int,
        *,
        max_batch_size: int = 512,
        policy: PolicyVersion | None = None,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, policy=policy)
        self.cluster, self.rank = cluster, rank
        self._running: set[str] = set()

    async def run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self._running = {r.request_id for r in requests}
        try:
            return await self._generate(requests)
        finally:
            self._running = set()

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        if request_id in self._running:
            self._abort_running([request_id])

    async def _generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return await self.cluster.generate_on(self.rank, requests)

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
    workers'). Weight loads and engine state are the driver's (``WorkerRouters``)."""

    def __init__(self, actor: Any, rank: int, *, max_batch_size: int = 512) -> None:
        BatchingFrontend.__init__(self, max_batch_size=max_batch_size)
        self.actor, self.rank = actor, rank
        self._running = set()

    async def _generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: list[GenerationResult] = await self.actor.generate_requests.options(
            concurrency_group="routed"
        ).remote(requests)
        return results

    def _abort_running(self, request_ids: list[str]) -> None:
        self.actor.abort_requests.options(concurrency_group="abort").remote(request_ids)

    def update_weights(self, weights: Weights) -> None:
        raise RuntimeError("the driver loads weights into actor_infer (WorkerRouters)")

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """The driver's (``InferCluster.set_state``)."""
