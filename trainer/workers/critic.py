"""``critic``: a value model for GAE: the policy's architecture with a scalar head per token.

``ValueModel`` loads the same checkpoint as the policy (``from_pretrained``), reads the last
hidden state and maps it through a zero-initialised linear head, so training starts from
values of 0. The critic trains with the clipped value loss of ``trainer.algos.losses``, on fp32
master weights whatever ``model.dtype`` (its compute dtype; ``strategy_worker.master_dtype``).

Its strategy is ``roles.critic.strategy`` (``hf`` or ``fsdp2``; ``megatron`` trains causal LMs
only). A multi-rank ``fsdp2`` critic runs one Ray worker process per rank and, like
``actor_train``, builds its strategy in ``setup`` on all ranks at once (joining the process
group is a collective); ``state_dict`` is then a collective whose rank-0 answer is returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer.config import RoleConfig
from trainer.controller.batch import Batch
from trainer.controller.cluster import remote
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import WorkerContext
from trainer.strategies.base import ForwardOutput, LossFn, TrainOptions
from trainer.workers.strategy_worker import StrategyCluster, StrategyWorker, master_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["CriticCluster", "CriticWorker", "ValueModel", "build_value_model"]


def build_value_model(model_path: str, dtype: str = "float32") -> Any:
    """A ``ValueModel`` on the backbone of the checkpoint at ``model_path``."""
    import torch

    from trainer.models import load_policy

    class ValueModel(torch.nn.Module):
        """Causal LM backbone + linear value head: ``forward(...) -> values (B, T)``."""

        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.lm = lm
            self.value_head = torch.nn.Linear(lm.config.hidden_size, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None,
        ) -> torch.Tensor:
            out = self.lm(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                output_hidden_states=True,
            )
            return self.value_head(out.hidden_states[-1].float()).squeeze(-1)

    lm, _ = load_policy(model_path, dtype=dtype, chat=False)
    return ValueModel(lm)


ValueModel = build_value_model  # the class is built lazily (torch import); this is its factory


def _values(out: ForwardOutput) -> torch.Tensor:
    """The value head's output, which a strategy built with ``kind="value"`` must return."""
    if out.values is None:
        raise RuntimeError(
            "the critic's strategy returned no values; a strategy built with kind='value' must "
            "fill ForwardOutput.values (trainer.strategies.base)"
        )
    return out.values


def value_loss_fn(clip: float | None) -> LossFn:
    """The clipped value loss closure for ``strategy.train_step`` (``clip``: None disables)."""
    from trainer.algos.losses import aggregate, value_loss

    def compute(
        out: ForwardOutput, mb: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        per_token = value_loss(_values(out), mb["values"], mb["returns"], clip)
        loss = aggregate(per_token, mb["response_mask"], "token-mean")
        return loss, {"critic/value_loss": float(loss.detach())}

    return compute


class CriticWorker(StrategyWorker):
    """One rank of the value model."""

    def __init__(
        self,
        ctx: WorkerContext,
        config: RoleConfig | None = None,
        *,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        optim: TrainOptions | None = None,
        value_clip: float | None = 0.2,
    ) -> None:
        super().__init__(ctx, config)
        self.model_path, self.dtype, self.seed = model_path, dtype, seed
        self.optim: TrainOptions = optim or {}
        self.value_clip = value_clip
        self._setup_unless_collective()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def setup(self) -> None:
        """Build the value model and its strategy (a collective for sharded strategies);
        idempotent."""
        if self._strategy is not None:
            return
        import torch

        from trainer.strategies.registry import make_train_strategy

        torch.manual_seed(self.seed + 1000 + self.ctx.rank)
        self._strategy = make_train_strategy(
            self.config.strategy,
            build_value_model(self.model_path, master_dtype(self.dtype)),  # fp32 masters
            kind="value",
            world_size=self.ctx.world_size,
            strategy_args=self.config.strategy_args,
            compute_dtype=self.dtype,
            **self.optim,
        )

    @register(Dispatch.DP_SPLIT_RAGGED, collect=Collect.CONCAT)
    def compute_values(self, batch: Batch) -> Batch:
        out = self.strategy.forward({k: batch[k] for k in ("input_ids", "attention_mask")})
        return Batch({"values": _values(out) * batch["response_mask"]})

    @register(Dispatch.DP_SPLIT_RAGGED, collect=Collect.MEAN)
    def train_step(self, batch: Batch) -> dict[str, float]:
        tensors = {
            k: batch[k]
            for k in ("input_ids", "attention_mask", "response_mask", "values", "returns")
        }
        from trainer.workers.actor import _namespaced

        return _namespaced(
            self.strategy.train_step(tensors, value_loss_fn(self.value_clip)), "critic"
        )

    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def state_dict(self) -> dict[str, Any]:
        """Collective for sharded strategies: rank 0's full state is the answer."""
        return self.strategy.state_dict()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(state)


class CriticCluster(StrategyCluster):
    """Typed calls to the ``critic`` workers (batches of any size split over the ranks)."""

    worker_cls = CriticWorker

    compute_values = remote(CriticWorker.compute_values)
    train_step = remote(CriticWorker.train_step)
    state_dict = remote(CriticWorker.state_dict)
    load_state_dict = remote(CriticWorker.load_state_dict)
