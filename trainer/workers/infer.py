"""``actor_infer``: generation workers, and ``ClusterEngine``, the driver's engine over them.

Each ``InferWorker`` holds an engine (``HFEngine`` by default) and answers whole batches of
``GenerationRequest``. The driver's env managers talk to a ``ClusterEngine``: the same
batching front as ``HFEngine`` (requests gathered from all running episodes), whose batches
are sent to the cluster, split over its ranks. Weight updates and sampling-RNG state go to
every rank. A vLLM engine will plug in as another worker engine without the driver changing.
"""

from __future__ import annotations

from typing import Any

from trainer.controller.batch import Batch
from trainer.controller.cluster import Cluster
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import Worker, WorkerContext
from trainer.strategies.base import GenerationRequest, GenerationResult, Weights
from trainer.strategies.hf_engine import BatchingFrontend

__all__ = ["ClusterEngine", "InferCluster", "InferWorker", "make_engine"]


def make_engine(name: str | None, model_path: str, *, dtype: str = "float32", seed: int = 0) -> Any:
    """The worker-side engine called ``name`` (only ``hf`` ships in this issue)."""
    if name in (None, "hf"):
        from trainer.models import load_policy
        from trainer.strategies.hf_engine import HFEngine

        import torch

        model, tokenizer = load_policy(model_path, dtype=dtype)
        return HFEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=seed,
                        device="cuda" if torch.cuda.is_available() else "cpu")
    raise ValueError(f"unknown inference engine {name!r}; use 'hf' (vllm is not built yet)")


class InferWorker(Worker):
    """One rank of the generation role."""

    def __init__(self, ctx: WorkerContext, config: Any = None, *, model_path: str, dtype: str = "float32",
                 seed: int = 0) -> None:
        super().__init__(ctx, config)
        self.engine = make_engine(getattr(config, "strategy", None), model_path, dtype=dtype, seed=seed + 7 * ctx.rank)

    @register(Dispatch.DP_SPLIT, collect=Collect.CONCAT)
    def generate_batch(self, batch: Batch) -> list[GenerationResult]:
        return self.engine.generate_batch(list(batch["requests"]))

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def update_weights(self, weights: dict[str, Any]) -> None:
        self.engine.update_weights(weights)

    @register(Dispatch.ONE_TO_ALL)
    def get_state(self) -> dict[str, Any]:
        return self.engine.get_state()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def set_state(self, states: list[dict[str, Any]]) -> None:
        self.engine.set_state(states[self.rank])

    def offload(self) -> None:
        self.engine.sleep()
        super().offload()

    def reload(self) -> None:
        self.engine.wake_up()
        super().reload()


class InferCluster(Cluster):
    """Typed calls to the ``actor_infer`` workers."""

    worker_cls = InferWorker

    async def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        pad = -len(requests) % self.world_size  # DP_SPLIT needs equal parts: pad with copies, drop after
        padded = requests + [requests[-1]] * pad
        results = await self._call_async("generate_batch", Batch({"requests": padded}))
        return list(results)[: len(requests)]

    def update_weights(self, weights: dict[str, Any]) -> None:
        self._call("update_weights", weights)

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
