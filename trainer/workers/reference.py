"""``reference``: the frozen initial policy, for the KL term. Only computes log-probs.

Its strategy is chosen like the actor's (``roles.reference.strategy``: ``hf``, ``fsdp2``,
``megatron`` with ``strategy_args``). A multi-rank ``fsdp2``/``megatron`` reference runs one
Ray worker process per rank: the cluster exports the rendezvous variables, then calls
``setup`` on all ranks at once (joining the process group is a collective), exactly like
``actor_train``. ``get_weights`` and ``load_weights`` are collectives for sharded strategies,
so every rank takes part and the caller gets rank 0's answer. Its log-probs are taken at the
rollout temperature, like the actor's (``ActorWorker``), so the KL compares like with like.
"""

from __future__ import annotations

from typing import Any

from trainer.config import RoleConfig
from trainer.controller.batch import Batch
from trainer.controller.cluster import remote
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import WorkerContext
from trainer.workers.strategy_worker import StrategyCluster, StrategyWorker, training_temperature

__all__ = ["ReferenceCluster", "ReferenceWorker"]


class ReferenceWorker(StrategyWorker):
    """One rank of the frozen reference policy."""

    def __init__(
        self,
        ctx: WorkerContext,
        config: RoleConfig | None = None,
        *,
        model_path: str,
        dtype: str = "float32",
        micro_batch_size: int = 8,
        temperature: float = 1.0,
    ) -> None:
        super().__init__(ctx, config)
        self.model_path, self.dtype, self.micro_batch_size = model_path, dtype, micro_batch_size
        self.temperature = training_temperature(temperature)
        """``rollout.temperature``: log-probs are those of ``softmax(logits / temperature)``."""
        self._setup_unless_collective()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def setup(self) -> None:
        """Load the policy and build the frozen strategy (a collective for sharded strategies);
        idempotent."""
        if self._strategy is not None:
            return
        from trainer.models import load_policy
        from trainer.strategies.registry import make_train_strategy

        model, _ = load_policy(self.model_path, dtype=self.dtype, chat=False)
        self._strategy = make_train_strategy(
            self.config.strategy,
            model,
            trainable=False,
            world_size=self.ctx.world_size,
            micro_batch_size=self.micro_batch_size,
            strategy_args=self.config.strategy_args,
        )

    @register(Dispatch.DP_SPLIT_RAGGED, collect=Collect.CONCAT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        """The reference's log-probs at the rollout temperature."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        out = self.strategy.forward(inputs, temperature=self.temperature)
        return Batch({"ref_logprobs": out.logprobs})

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_weights(self, weights: dict[str, Any]) -> None:
        """Replace the reference (e.g. with the SFT warm-start result before RL begins); every
        rank gets the full tensors and keeps its own shard."""
        self.strategy.load_state_dict({"model": weights})


class ReferenceCluster(StrategyCluster):
    """Typed calls to the ``reference`` workers (batches of any size split over the ranks)."""

    worker_cls = ReferenceWorker

    compute_logprobs = remote(ReferenceWorker.compute_logprobs)
    load_weights = remote(ReferenceWorker.load_weights)
