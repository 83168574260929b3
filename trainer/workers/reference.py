"""``reference``: the frozen initial policy, for the KL term. Only computes log-probs."""

from __future__ import annotations

from typing import Any

from trainer.controller.batch import Batch
from trainer.controller.cluster import Cluster
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import Worker, WorkerContext

__all__ = ["ReferenceCluster", "ReferenceWorker"]


class ReferenceWorker(Worker):
    """One rank of the frozen reference policy."""

    def __init__(self, ctx: WorkerContext, config: Any = None, *, model_path: str, dtype: str = "float32",
                 micro_batch_size: int = 8) -> None:
        super().__init__(ctx, config)
        from trainer.models import load_policy
        from trainer.workers.actor import make_train_strategy

        model, _ = load_policy(model_path, dtype=dtype)
        self.strategy = make_train_strategy(getattr(config, "strategy", None), model, trainable=False,
                                            micro_batch_size=micro_batch_size)

    @register(Dispatch.DP_SPLIT, collect=Collect.CONCAT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        out = self.strategy.forward({k: batch[k] for k in ("input_ids", "attention_mask")})
        return Batch({"ref_logprobs": out.logprobs})

    @register(Dispatch.RANK_ZERO)
    def get_weights(self) -> dict[str, Any]:
        return {name: tensor.clone() for name, tensor in self.strategy.full_weights()}

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_weights(self, weights: dict[str, Any]) -> None:
        """Replace the reference (e.g. with the SFT warm-start result before RL begins)."""
        self.strategy.model.load_state_dict(weights)


class ReferenceCluster(Cluster):
    """Typed calls to the ``reference`` workers."""

    worker_cls = ReferenceWorker

    def compute_logprobs(self, batch: Batch) -> Batch:
        return self._call("compute_logprobs", batch)

    def load_weights(self, weights: dict[str, Any]) -> None:
        self._call("load_weights", weights)

    def get_weights(self) -> dict[str, Any]:
        return self._call("get_weights")
