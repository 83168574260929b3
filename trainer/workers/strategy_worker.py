"""``StrategyWorker``: what the actor, critic and reference workers share about holding a strategy.

Each of them owns one training-side strategy (``hf``, ``fsdp2``, ``megatron``). A sharded
strategy with several ranks is built by a collective, so it needs one process per rank (the
Ray backend) and is built when the driver calls ``setup()`` on all ranks at once; a single
rank or an unsharded strategy is built right away. Around colocated phases the worker
offloads what its role's ``offload_params`` / ``offload_optimizer`` flags say and reloads
before use (moves are tracked no-ops on CPU; ``trainer.strategies.offload``). The actor and
the reference take their log-probs at the rollout temperature (``training_temperature``).

Precision: what trains (``actor_train``, ``critic``) is loaded in fp32 whatever ``model.dtype``
says (``master_dtype``): fp32 master weights, gradients and AdamW moments, as verl and ROLL keep
them, while compute runs in ``model.dtype`` where the strategy can (``compute_dtype``: autocast or
fsdp2 mixed precision on CUDA). The frozen reference and the engines hold ``model.dtype``.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.config import RoleConfig
from trainer.controller.cluster import Cluster, remote
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import Worker, WorkerContext
from trainer.errors import ConfigError, Problem
from trainer.strategies.base import TrainStrategy
from trainer.strategies.parallel_errors import ParallelConfigError
from trainer.strategies.registry import TRAIN_STRATEGIES, process_problem

__all__ = [
    "StrategyCluster",
    "StrategyWorker",
    "master_dtype",
    "offload_flags",
    "training_temperature",
]


def _sharded(name: str | None) -> bool:
    """Whether ranks of strategy ``name`` build their shards together (a collective), one
    process per rank."""
    spec = TRAIN_STRATEGIES.get(name or "hf")
    return spec is not None and spec.sharded


def offload_flags(config: RoleConfig) -> dict[str, bool]:
    """``roles.<role>.offload_params/offload_optimizer`` as ``strategy.offload`` keywords."""
    return {"params": config.offload_params, "optimizer": config.offload_optimizer}


def master_dtype(dtype: str, *, frozen: bool = False) -> str:
    """The dtype a role loads the policy's weights in for ``model.dtype`` = ``dtype``: fp32 for
    weights that train (AdamW's moments take the parameters' dtype, and a bf16 weight of ~0.02
    rounds away any update below ~4e-5, so lr=1e-6 would change almost nothing), ``dtype`` for
    weights that stay ``frozen`` (a reference, a LoRA base: they need no master copy)."""
    return dtype if frozen else "float32"


def training_temperature(temperature: float) -> float:
    """``rollout.temperature`` as the temperature RL log-probs are taken at (``softmax(logits /
    temperature)``, what the engines sample from); 0 (greedy) is refused with the fix."""
    if temperature > 0 and math.isfinite(temperature):
        return float(temperature)
    raise ConfigError(
        [
            Problem(
                "rollout.temperature",
                f"{temperature} samples greedily, and greedy tokens cannot be trained on-policy: "
                "the trainer takes log-probs under softmax(logits / temperature), which needs a "
                "temperature > 0; set rollout.temperature > 0 (1 samples the policy itself) and "
                "use eval.temperature: 0 for greedy evaluation",
            )
        ]
    )


class StrategyWorker(Worker):
    """A worker holding one strategy; subclasses implement a ``@register``-ed ``setup()`` that
    builds it."""

    def __init__(self, ctx: WorkerContext, config: RoleConfig | None = None) -> None:
        super().__init__(ctx, config)
        self.config: RoleConfig = config if config is not None else RoleConfig(device_mapping=[])
        problem = process_problem(self.config.strategy, ctx.world_size, ctx.backend)
        if problem:  # a cluster built without a TrainerConfig (config.problems() says it for a run)
            raise ParallelConfigError(f"{ctx.role}: {problem}")
        self._strategy: TrainStrategy | None = None

    def setup(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement setup()")

    def _setup_unless_collective(self) -> None:
        """Build now when there is nothing to rendezvous with; otherwise the driver calls
        ``setup()``."""
        if self.world_size == 1 or not _sharded(self.config.strategy):
            self.setup()

    @property
    def strategy(self) -> TrainStrategy:
        if self._strategy is None:
            raise RuntimeError(
                f"{self.role} rank {self.rank}: the strategy is not built; call setup() on all "
                "ranks"
            )
        return self._strategy

    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def get_weights(self) -> dict[str, Any]:
        """Collective: the full HF-named CPU tensors (rank 0's answer is the result; the other
        ranks return {})."""
        weights: dict[str, Any] = {}
        for name, tensor in self.strategy.full_weights():  # every rank takes part in each gather
            if self.rank == 0:
                weights[name] = tensor.detach().cpu().clone()
        return weights

    def offload(self) -> None:
        """Colocation: offload what ``roles.<role>.offload_params/offload_optimizer`` say
        (no-op moves on CPU)."""
        if self._strategy is not None:
            self.strategy.offload(**offload_flags(self.config))
        super().offload()

    def reload(self) -> None:
        if self._strategy is not None:
            self.strategy.reload()
        super().reload()


class StrategyCluster(Cluster):
    """A cluster of ``StrategyWorker``: building it calls ``setup`` on every rank at once (sharded
    strategies join their process group there); a failed build stops the workers it started."""

    worker_cls: type[Worker] = StrategyWorker
    get_weights = remote(StrategyWorker.get_weights)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # by name: each concrete worker registers its own setup(); StrategyWorker's is abstract
        try:
            self._call("setup")
        except BaseException:
            self.shutdown()
            raise
