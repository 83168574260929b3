"""``actor_train``: the trained policy. Computes log-probs, takes PPO/GSPO and SFT steps.

The worker owns the *loss* (PPO clip or GSPO, KL to the reference as a loss term, entropy
bonus, one of three aggregation modes - all from ``trainer.algos.losses``); the strategy
(``hf`` here; fsdp2/megatron later) owns how forward/backward/step run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer.controller.batch import Batch
from trainer.controller.cluster import Cluster
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import Worker, WorkerContext
from trainer.strategies.base import ForwardOutput

if TYPE_CHECKING:
    import torch

__all__ = ["ActorCluster", "ActorWorker", "make_train_strategy", "ppo_loss_fn", "sft_loss_fn"]

TRAIN_COLUMNS = ("input_ids", "attention_mask", "response_mask", "old_logprobs", "advantages", "ref_logprobs")


def make_train_strategy(name: str | None, model: Any, *, world_size: int = 1, **kwargs: Any) -> Any:
    """The ``TrainStrategy`` called ``name`` around ``model`` (only ``hf`` ships in this issue).

    ``hf`` trains one full copy on one device (CUDA when visible, else CPU) and does not
    synchronise gradients, so it refuses ``world_size > 1`` rather than train diverging copies.
    """
    if name in (None, "hf"):
        import torch

        from trainer.strategies.hf import HFTrainStrategy

        if world_size > 1 and kwargs.get("trainable", True):
            raise ValueError(f"the 'hf' training strategy runs on one device but this role has {world_size} workers; "
                             "map it to one device (device_mapping: [0]) or use a data-parallel strategy (fsdp2)")
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        return HFTrainStrategy(model, **kwargs)
    raise ValueError(f"unknown training strategy {name!r}; use 'hf' (fsdp2 and megatron are not built yet)")


def ppo_loss_fn(loss: Mapping[str, Any]):  # noqa: ANN201 - returns a LossFn closure
    """The policy loss closure for ``strategy.train_step`` built from a ``LossConfig`` dump."""
    from trainer.algos.losses import aggregate, kl_estimate, policy_loss

    def compute(out: ForwardOutput, mb: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["response_mask"]
        kind = "gspo" if loss.get("gspo") else "ppo"
        per_token, clipped = policy_loss(kind, out.logprobs, mb["old_logprobs"], mb["advantages"], mask,
                                         loss["clip_low"], loss["clip_high"], loss.get("dual_clip"))
        total = aggregate(per_token, mask, loss["agg_mode"])
        metrics = {"actor/pg_loss": float(total.detach()),
                   "actor/clipfrac": float(aggregate(clipped, mask, "token-mean")),
                   "actor/approx_kl_old": float(aggregate(0.5 * (out.logprobs.detach() - mb["old_logprobs"]) ** 2, mask))}
        if loss.get("kl_coef", 0) > 0 and "ref_logprobs" in mb:
            kl = aggregate(kl_estimate(out.logprobs, mb["ref_logprobs"], loss["kl_estimator"]), mask, loss["agg_mode"])
            metrics["actor/kl_ref"] = float(kl.detach())
            if loss.get("kl_mode", "loss") == "loss":
                total = total + loss["kl_coef"] * kl
        if out.entropy is not None:
            entropy = aggregate(out.entropy, mask, loss["agg_mode"])
            metrics["actor/entropy"] = float(entropy.detach())
            if loss.get("entropy_coef", 0) > 0:
                total = total - loss["entropy_coef"] * entropy
        return total, metrics

    return compute


def sft_loss_fn(out: ForwardOutput, mb: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Behaviour cloning: mean negative log-likelihood of the policy (response-mask) tokens."""
    from trainer.algos.losses import aggregate

    nll = aggregate(-out.logprobs, mb["response_mask"], "token-mean")
    return nll, {"sft/nll": float(nll.detach())}


def _namespaced(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """``grad_norm`` -> ``actor/grad_norm``; keys that already have a namespace are kept."""
    return {k if "/" in k else f"{prefix}/{k}": v for k, v in metrics.items()}


class ActorWorker(Worker):
    """One rank of the trained policy."""

    def __init__(self, ctx: WorkerContext, config: Any = None, *, model_path: str, dtype: str = "float32",
                 seed: int = 0, optim: Mapping[str, Any] | None = None, loss: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, config)
        import torch

        from trainer.models import load_policy

        torch.manual_seed(seed + ctx.rank)
        model, self.tokenizer = load_policy(model_path, dtype=dtype)
        self.loss = dict(loss or {})
        self.strategy = make_train_strategy(getattr(config, "strategy", None), model, world_size=ctx.world_size,
                                            **dict(optim or {}))

    @register(Dispatch.DP_SPLIT, collect=Collect.CONCAT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        out = self.strategy.forward({k: batch[k] for k in ("input_ids", "attention_mask")})
        return Batch({"logprobs": out.logprobs})

    @register(Dispatch.DP_SPLIT, collect=Collect.MEAN)
    def train_step(self, batch: Batch, epochs: int = 1) -> dict[str, float]:
        """``epochs`` passes of PPO/GSPO updates over this rank's part of the batch."""
        tensors = {k: batch[k] for k in TRAIN_COLUMNS if k in batch}
        metrics: dict[str, float] = {}
        for _ in range(epochs):
            metrics = self.strategy.train_step(tensors, ppo_loss_fn(self.loss), with_entropy=True)
        return _namespaced(metrics, "actor")

    @register(Dispatch.DP_SPLIT, collect=Collect.MEAN)
    def sft_step(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        if lr is not None:
            self.strategy.set_lr(lr)
        tensors = {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}
        return _namespaced(self.strategy.train_step(tensors, sft_loss_fn), "sft")

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def set_lr(self, lr: float) -> None:
        self.strategy.set_lr(lr)

    @register(Dispatch.RANK_ZERO)
    def get_weights(self) -> dict[str, Any]:
        return {name: tensor.clone() for name, tensor in self.strategy.full_weights()}

    @register(Dispatch.RANK_ZERO)
    def state_dict(self) -> dict[str, Any]:
        from trainer.checkpoint import capture_rng

        return {**self.strategy.state_dict(), "rng": capture_rng()}

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_state_dict(self, state: dict[str, Any]) -> None:
        from trainer.checkpoint import restore_rng

        self.strategy.load_state_dict(state)
        if "rng" in state:
            restore_rng(state["rng"])

    @register(Dispatch.RANK_ZERO)
    def save_pretrained(self, path: str) -> None:
        self.strategy.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def offload(self) -> None:
        self.strategy.offload()
        super().offload()

    def reload(self) -> None:
        self.strategy.reload()
        super().reload()


class ActorCluster(Cluster):
    """Typed calls to the ``actor_train`` workers."""

    worker_cls = ActorWorker

    def compute_logprobs(self, batch: Batch) -> Batch:
        return self._call("compute_logprobs", batch)

    def train_step(self, batch: Batch, epochs: int = 1) -> dict[str, float]:
        return self._call("train_step", batch, epochs)

    def sft_step(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        return self._call("sft_step", batch, lr)

    def get_weights(self) -> dict[str, Any]:
        return self._call("get_weights")

    def set_lr(self, lr: float) -> None:
        self._call("set_lr", lr)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def save_pretrained(self, path: str) -> None:
        self._call("save_pretrained", path)
