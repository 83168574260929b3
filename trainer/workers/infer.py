"""``actor_infer``: generation workers, and ``ClusterEngine``, the driver's engine over them.

Each ``InferWorker`` holds an engine (``HFEngine`` by default) and answers whole batches of
``GenerationRequest``. The driver's env managers talk to a ``ClusterEngine``: the same
batching front as ``HFEngine`` (requests gathered from all running episodes), whose batches
are sent to the cluster, split over its ranks. Weight updates and sampling-RNG state go to
every rank. ``strategy: vllm`` gives each worker a ``VLLMEngine`` instead; the driver does not change.
"""

from __future__ import annotations

from typing import Any

from trainer.controller.batch import Batch
from trainer.controller.cluster import CallFuture, Cluster
from trainer.controller.dispatch import Collect, Dispatch, method_spec, register
from trainer.controller.worker import Worker, WorkerContext
from trainer.strategies.base import GenerationRequest, GenerationResult, Weights
from trainer.strategies.hf_engine import BatchingFrontend
from trainer.weights.sync import WeightReceiver, WeightReceiverCluster

__all__ = ["ClusterEngine", "InferCluster", "InferWorker", "RankEngine", "make_engine"]


def make_engine(name: str | None, model_path: str, *, dtype: str = "float32", seed: int = 0,
                **engine_args: Any) -> Any:
    """The worker-side engine called ``name``: ``hf`` (``HFEngine``) or ``vllm`` (``VLLMEngine``;
    ``engine_args`` are its options, e.g. ``kv_cache_gib``, from ``roles.actor_infer.strategy_args``)."""
    if name in (None, "hf"):
        if engine_args:
            raise ValueError(f"strategy_args {sorted(engine_args)} are not options of the 'hf' inference engine (it has none)")
        from trainer.models import load_policy
        from trainer.strategies.hf_engine import HFEngine

        import torch

        model, tokenizer = load_policy(model_path, dtype=dtype)
        return HFEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=seed,
                        device="cuda" if torch.cuda.is_available() else "cpu")
    if name == "vllm":
        from trainer.strategies.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype=dtype, seed=seed, **engine_args)
    raise ValueError(f"unknown inference engine {name!r}; use 'hf' or 'vllm'")


class InferWorker(WeightReceiver, Worker):
    """One rank of the generation role."""

    def __init__(self, ctx: WorkerContext, config: Any = None, *, model_path: str, dtype: str = "float32",
                 seed: int = 0) -> None:
        super().__init__(ctx, config)
        self.engine = make_engine(getattr(config, "strategy", None), model_path, dtype=dtype, seed=seed + 7 * ctx.rank,
                                  **(getattr(config, "strategy_args", None) or {}))

    @register(Dispatch.DP_SPLIT, collect=Collect.CONCAT)
    def generate_batch(self, batch: Batch) -> list[GenerationResult]:
        return self.engine.generate_batch(list(batch["requests"]))

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def update_weights(self, weights: dict[str, Any]) -> None:
        self.engine.update_weights(weights)

    @register(Dispatch.ONE_TO_ALL)
    def generate_requests(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """This rank's batch (``InferCluster.generate_on`` sends it to one rank only)."""
        return self.engine.generate_batch(list(requests))

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests in the running batch (the local backend calls this from another
        thread while ``generate_requests`` runs; a batch engine checks the set every token)."""
        engine = getattr(self.engine, "engine", self.engine)  # under the weight sync's VersionedEngine
        aborted = getattr(engine, "_aborted", None)
        if hasattr(engine, "abort_sync"):  # vLLM: a real abort inside the engine
            engine.abort_sync(list(request_ids))
        elif aborted is not None:
            aborted.update(request_ids)

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
        """Release the engine (a vLLM engine's thread and KV cache) when the cluster shuts down."""
        shutdown = getattr(getattr(self.engine, "engine", self.engine), "shutdown", None)
        if callable(shutdown):
            shutdown()

    def reload(self) -> None:
        self.engine.wake_up()
        super().reload()


class InferCluster(WeightReceiverCluster, Cluster):
    """Typed calls to the ``actor_infer`` workers."""

    worker_cls = InferWorker

    async def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        pad = -len(requests) % self.world_size  # DP_SPLIT needs equal parts: pad with copies, drop after
        padded = requests + [requests[-1]] * pad
        results = await self._call_async("generate_batch", Batch({"requests": padded}))
        return list(results)[: len(requests)]

    def update_weights(self, weights: dict[str, Any]) -> None:
        self._call("update_weights", weights)

    async def generate_on(self, rank: int, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate ``requests`` on rank ``rank`` only (the router's per-worker path)."""
        return (await self._on_rank(rank, "generate_requests", requests))[0]

    def abort_on(self, rank: int, request_ids: list[str]) -> None:
        """Abort requests running on ``rank``. In-process workers get it at once (the batch sees
        it at its next token); a Ray actor runs calls in order, so there it only stops requests
        that have not started (the driver's frontend already answered the caller)."""
        if self.backend == "local":
            self._workers[rank].abort_requests(request_ids)
        else:
            self._on_rank(rank, "abort_requests", request_ids)

    def rank_engines(self, *, max_batch_size: int = 512) -> list[RankEngine]:
        """One ``InferenceEngine`` per rank, for ``trainer.rollout.router.EngineRouter``."""
        return [RankEngine(self, rank, max_batch_size=max_batch_size) for rank in range(self.world_size)]

    def _on_rank(self, rank: int, method: str, *args: Any) -> CallFuture[Any]:
        spec = method_spec(self.worker_cls, method)
        return CallFuture(self, spec, [rank], [self._submit(rank, method, args, {})])

    def get_state(self) -> list[dict[str, Any]]:
        return self._call("get_state")

    def set_state(self, states: list[dict[str, Any]]) -> None:
        self._call("set_state", states)


class ClusterEngine(BatchingFrontend):
    """``InferenceEngine`` in the driver whose batches run on an ``InferCluster``."""

    def __init__(self, cluster: InferCluster, *, max_batch_size: int = 512) -> None:
        super().__init__(cluster.generate_batch, max_batch_size=max_batch_size)
        self.cluster = cluster

    def update_weights(self, weights: Weights) -> None:
        self.cluster.update_weights(dict(weights.items() if hasattr(weights, "items") else weights))  # type: ignore[arg-type]
        self.version += 1

    def sleep(self) -> None:
        self.cluster.offload()

    def wake_up(self) -> None:
        self.cluster.reload()

    def get_state(self) -> dict[str, Any]:
        return {"ranks": self.cluster.get_state(), "version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        self.cluster.set_state(state["ranks"])
        self.version = int(state.get("version", self.version))


class RankEngine(BatchingFrontend):
    """``InferenceEngine`` in the driver for ONE rank of an ``InferCluster``: requests queued
    here run as batches on that rank; ``abort`` also reaches a batch already running there."""

    def __init__(self, cluster: InferCluster, rank: int, *, max_batch_size: int = 512) -> None:
        super().__init__(max_batch_size=max_batch_size)
        self.cluster, self.rank = cluster, rank
        self._running: set[str] = set()

    async def run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self._running = {r.request_id for r in requests}
        try:
            return await self.cluster.generate_on(self.rank, requests)
        finally:
            self._running = set()

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        if request_id in self._running:
            self.cluster.abort_on(self.rank, [request_id])

    def update_weights(self, weights: Weights) -> None:
        """This rank only (a run's weight sync updates every rank at once instead)."""
        self.cluster._on_rank(self.rank, "update_weights", dict(weights.items() if hasattr(weights, "items")  # type: ignore[union-attr]
                                                               else weights)).result()
        self.version += 1

    def sleep(self) -> None:
        """Colocated memory release is cluster-wide (``ClusterEngine.sleep``)."""

    def wake_up(self) -> None:
        """See ``sleep``."""

    def get_state(self) -> dict[str, Any]:
        return {"rank": self.cluster._on_rank(self.rank, "get_state").result()[0], "version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        states: list[Any] = [None] * self.cluster.world_size
        states[self.rank] = state["rank"]
        self.cluster._on_rank(self.rank, "set_state", states).result()
        self.version = int(state.get("version", self.version))
