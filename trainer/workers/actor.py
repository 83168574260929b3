"""``actor_train``: the trained policy. Computes log-probs, takes PPO/GSPO and SFT steps.

The worker owns the *loss* (PPO clip or GSPO, KL to the reference as a loss term, entropy
bonus, one of three aggregation modes - all from ``trainer.algos.losses``); the strategy
(``roles.actor_train.strategy``: ``hf``, ``fsdp2`` or ``megatron``) owns how
forward/backward/step run and how the model is laid out over the role's ranks.

Sharded strategies need one OS process per rank (``torch.distributed`` has one default
group per process), so a multi-rank ``fsdp2``/``megatron`` role runs on the Ray backend,
where every worker is a process; the cluster exports the rendezvous variables and then
calls ``setup`` on all ranks at once, which builds the strategy (joining the group is a
collective). Gathering full weights is a collective too, so ``get_weights``,
``state_dict`` and ``save_pretrained`` run on *every* rank and the caller gets rank 0's
answer (the full HF-named tensors). The weight sync's RPCs (gathered or shard-direct buckets,
the broadcast) come from the ``trainer.weights.sender.WeightSender`` mixin, as the inference
worker's come from ``WeightReceiver``; the driver's ``trainer.weights.sync.WeightSync`` calls them.

The policy trained is the one rollouts sample: log-probs (old, new, the adapters-off reference)
and entropy are those of ``softmax(logits / rollout.temperature)``, which is what the engines
draw tokens from and report log-probs of; so a fresh token's PPO ratio starts at 1 and the async
importance weights compare like with like. SFT steps fit the model's own distribution (T = 1).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trainer.config import LoraConfig, LossConfig, RoleConfig
from trainer.controller.batch import Batch
from trainer.controller.cluster import remote
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import WorkerContext
from trainer.strategies.base import ForwardOutput, LossFn, TrainOptions, TrainStrategy
from trainer.strategies.registry import make_train_strategy
from trainer.weights.sender import WeightSender, WeightSenderCluster
from trainer.workers.strategy_worker import (
    StrategyCluster,
    StrategyWorker,
    master_dtype,
    training_temperature,
)

if TYPE_CHECKING:
    import torch

    from trainer.strategies.lora import AdapterWeights
    from trainer.weights.transport import SharedBucket

__all__ = ["ActorCluster", "ActorWorker", "ppo_loss_fn", "sft_loss_fn"]

TRAIN_COLUMNS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "old_logprobs",
    "advantages",
    "ref_logprobs",
    "is_weights",
)
"""``is_weights`` (optional, async rollouts): truncated importance weights of the behaviour policy
that sampled each token, multiplied into the per-token policy loss (see ``AgenticPipeline``)."""


def residency_history(strategy: TrainStrategy | None) -> list[tuple[str, str, bool, str]]:
    """A strategy's offload/reload transitions (``trainer.strategies.offload``), as plain tuples
    for RPC."""
    if strategy is None:
        return []
    return [(e.action, e.state, e.moved, e.reason) for e in strategy.residency.history]


def _masked_like(
    reference: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``reference`` on the response tokens, ``logprobs`` (detached) elsewhere: a difference of
    the two is 0 where the mask is 0."""
    import torch

    return torch.where(mask > 0, reference, logprobs.detach())


def ppo_loss_fn(loss: LossConfig) -> LossFn:
    """The policy loss closure for ``strategy.train_step`` built from ``algorithm.loss``.

    Every term (policy loss with IS weights, KL to the reference, entropy bonus) is aggregated
    with ``agg_mode`` over this micro-batch; ``compute.agg_mode`` tells the strategy how to weigh
    micro-batches so that the mean is over the whole step (``trainer.algos.losses``)."""
    from trainer.algos.losses import PolicyLossKind, aggregate, kl_estimate, policy_loss

    def compute(
        out: ForwardOutput, mb: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["response_mask"]
        # masked positions hold whatever the forward left (a pad token's log-prob, 0 in a packed
        # row): their differences are made 0 before any exp(), which could overflow, and
        # inf * mask 0 would be NaN
        old_logprobs = _masked_like(mb["old_logprobs"], out.logprobs, mask)
        kind: PolicyLossKind = "gspo" if loss.gspo else "ppo"
        per_token, clipped = policy_loss(
            kind,
            out.logprobs,
            old_logprobs,
            mb["advantages"],
            mask,
            loss.clip_low,
            loss.clip_high,
            loss.dual_clip,
        )
        if "is_weights" in mb:  # off-policy (async) tokens: truncated importance sampling
            per_token = per_token * mb["is_weights"]
        total = aggregate(per_token, mask, loss.agg_mode)
        metrics = {
            "actor/pg_loss": float(total.detach()),
            "actor/clipfrac": float(aggregate(clipped, mask, "token-mean")),
            "actor/approx_kl_old": float(
                aggregate(0.5 * (out.logprobs.detach() - old_logprobs) ** 2, mask)
            ),
        }
        if loss.kl_coef > 0 and "ref_logprobs" in mb:
            kl = aggregate(
                kl_estimate(
                    out.logprobs,
                    _masked_like(mb["ref_logprobs"], out.logprobs, mask),
                    loss.kl_estimator,
                ),
                mask,
                loss.agg_mode,
            )
            metrics["actor/kl_ref"] = float(kl.detach())
            if loss.kl_mode == "loss":
                total = total + loss.kl_coef * kl
        if out.entropy is not None:
            entropy = aggregate(out.entropy, mask, loss.agg_mode)
            metrics["actor/entropy"] = float(entropy.detach())
            if loss.entropy_coef > 0:
                total = total - loss.entropy_coef * entropy
        return total, metrics

    # LossFn's optional attributes (trainer.strategies.base): how the strategy weighs micro-batches
    # for the loss, and which metrics are token means whatever the mode (a function has no such
    # fields)
    compute.agg_mode = loss.agg_mode  # type: ignore[attr-defined]
    compute.token_metrics = ("actor/clipfrac", "actor/approx_kl_old")  # type: ignore[attr-defined]
    return compute


def sft_loss_fn(
    out: ForwardOutput, mb: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Behaviour cloning: mean negative log-likelihood of the policy (response-mask) tokens."""
    from trainer.algos.losses import aggregate

    nll = aggregate(-out.logprobs, mb["response_mask"], "token-mean")
    return nll, {"sft/nll": float(nll.detach())}


def _over_epochs(passes: list[dict[str, float]]) -> dict[str, float]:
    """One RL step's metrics from its ``train.ppo_epochs`` passes over the batch:
    ``optimizer_steps`` added up (every step the optimiser took), every other metric the mean
    of the passes' figures (each pass ran the same batch, so they weigh alike; a pass that
    lacks a metric is left out of its mean)."""
    values: dict[str, list[float]] = {}
    for metrics in passes:
        for key, value in metrics.items():
            values.setdefault(key, []).append(value)
    return {
        key: sum(seen) if key == "optimizer_steps" else sum(seen) / len(seen)
        for key, seen in values.items()
    }


def _namespaced(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """``grad_norm`` -> ``actor/grad_norm``; keys that already have a namespace are kept."""
    return {k if "/" in k else f"{prefix}/{k}": v for k, v in metrics.items()}


class ActorWorker(WeightSender, StrategyWorker):
    """One rank of the trained policy (see the module docstring)."""

    def __init__(
        self,
        ctx: WorkerContext,
        config: RoleConfig | None = None,
        *,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        optim: TrainOptions | None = None,
        loss: LossConfig | None = None,
        lora: LoraConfig | None = None,
        full_warm_start: bool = False,
        temperature: float = 1.0,
    ) -> None:
        super().__init__(ctx, config)
        self.temperature = training_temperature(temperature)
        """``rollout.temperature``: RL log-probs are those of ``softmax(logits / temperature)``."""
        self.model_path, self.dtype, self.seed = model_path, dtype, seed
        """``model.dtype``: what compute runs in and the engines hold (the weights train in fp32:
        ``strategy_worker.master_dtype``)."""
        self.engine_dtype = dtype  # the weight sync casts the fp32 masters to it (WeightSender)
        self.optim: TrainOptions = optim or {}
        self.loss = loss if loss is not None else LossConfig()
        self.lora = lora
        """``model.lora``: the policy trains ``peft`` adapters (``trainer.strategies.lora``)."""
        self.full_warm_start = full_warm_start
        """LoRA: every weight trains until the warm start is folded (``model.lora.warm_start``)."""
        self._setup_unless_collective()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def setup(self) -> None:
        """Load the policy and build the strategy (a collective for sharded strategies);
        idempotent."""
        if self._strategy is not None:
            return
        import torch
        from transformers.utils import logging as hf_logging

        from trainer.models import load_policy

        hf_logging.disable_progress_bar()  # no per-rank "Loading weights" bars in the run's output
        torch.manual_seed(self.seed + self.ctx.rank)
        # fp32 masters for what trains; a LoRA base that never trains stays in model.dtype (peft
        # keeps the adapters in fp32 over it)
        frozen = self.lora is not None and not self.full_warm_start
        dtype = master_dtype(self.dtype, frozen=frozen)
        model, self.tokenizer = load_policy(self.model_path, dtype=dtype, chat=False)
        if self.lora is not None:
            from trainer.strategies.lora import apply_lora, train_base

            model = apply_lora(model, self.lora)
            train_base(model, self.full_warm_start)  # the optimiser then holds the base too
        self._strategy = make_train_strategy(
            self.config.strategy,
            model,
            world_size=self.ctx.world_size,
            strategy_args=self.config.strategy_args,
            compute_dtype=self.dtype,
            **self.optim,
        )
        if self.lora is not None and self.full_warm_start:
            from trainer.strategies.lora import freeze_adapters

            freeze_adapters(self._strategy.model)  # the base trains alone until fold_adapters

    @register(Dispatch.DP_SPLIT_RAGGED, collect=Collect.CONCAT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        """The policy's log-probs at the rollout temperature (old or proximal log-probs)."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        out = self.strategy.forward(inputs, temperature=self.temperature)
        return Batch({"logprobs": out.logprobs})

    # -- LoRA (``trainer.strategies.lora``): adapters, the adapters-off reference, what syncs
    @register(Dispatch.RANK_ZERO)
    def uses_lora(self) -> bool:
        """Whether the policy trains adapters (``model.lora``)."""
        return self.lora is not None

    @register(Dispatch.DP_SPLIT_RAGGED, collect=Collect.CONCAT)
    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """The reference policy's log-probs: this model with its adapters switched off, at the
        rollout temperature like the policy's."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        with self.strategy.model.disable_adapter():
            out = self.strategy.forward(inputs, temperature=self.temperature)
        return Batch({"ref_logprobs": out.logprobs})

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def fold_adapters(self) -> None:
        """Add the adapters into the base and restart them at zero (after the warm start)."""
        from trainer.strategies.lora import fold_adapters

        fold_adapters(self.strategy.model, getattr(self.strategy, "optimizer", None))

    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def adapter_weights(self) -> AdapterWeights | None:
        """Collective: the adapters' full tensors and config (rank 0's answer), for an adapter
        sync; None without LoRA."""
        from trainer.strategies.lora import adapter_state

        if self.lora is None:
            return None
        return adapter_state(self.strategy.model)

    def _full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full HF-named tensors an engine loads: with LoRA the base alone (adapter syncs
        carry the adapters) or, with ``model.lora.sync: merged``, the adapters merged in."""
        if self.lora is None:
            return self.strategy.full_weights()
        from trainer.strategies.lora import engine_weights, merge_of

        merge = merge_of(self.strategy.model) if self.lora.sync == "merged" else None
        return engine_weights(self.strategy.full_weights(), merge=merge)

    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def weight_sizes(self) -> list[tuple[str, int]]:
        """``(HF name, bytes)`` of every tensor the engines load (see ``WeightSender``)."""
        if self.lora is None:
            return super().weight_sizes()
        from trainer.strategies.lora import engine_weights
        from trainer.weights.buckets import in_dtype

        named = self.strategy.model.state_dict().items()
        sent = in_dtype(engine_weights(named), self.engine_dtype)
        return [(name, t.numel() * t.element_size()) for name, t in sent]

    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def begin_shard_sync(
        self, bucket_bytes: int, only_changed: bool = False
    ) -> list[SharedBucket] | None:
        """With LoRA the engines' tensors are not the strategy's shards (renamed, or merged):
        the gathered path sends them (``_full_weights``)."""
        if self.lora is not None:
            return None
        return super().begin_shard_sync(bucket_bytes, only_changed)

    @register(Dispatch.DP_SPLIT_RAGGED, collect=Collect.MEAN)
    def train_step(self, batch: Batch, epochs: int = 1) -> dict[str, float]:
        """``epochs`` passes (``train.ppo_epochs``) of PPO/GSPO updates over this rank's part of
        the batch, with log-probs and entropy at the rollout temperature. The metrics cover every
        pass (``_over_epochs``): ``actor/optimizer_steps`` is the steps of all passes, the others
        (``pg_loss``, ``clipfrac``, ``approx_kl_old``, ``entropy``, ``kl_ref``, ``grad_norm``)
        the mean over the passes."""
        tensors = {k: batch[k] for k in TRAIN_COLUMNS if k in batch}
        loss_fn = ppo_loss_fn(self.loss)
        passes = [
            self.strategy.train_step(
                tensors, loss_fn, with_entropy=True, temperature=self.temperature
            )
            for _ in range(epochs)
        ]
        return _namespaced(_over_epochs(passes), "actor")

    @register(Dispatch.DP_SPLIT_RAGGED, collect=Collect.MEAN)
    def sft_step(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        """One pass of behaviour cloning; the NLL is the model's own (temperature 1)."""
        if lr is not None:
            self.strategy.set_lr(lr)
        tensors = {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}
        return _namespaced(self.strategy.train_step(tensors, sft_loss_fn), "sft")

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def set_lr(self, lr: float) -> None:
        self.strategy.set_lr(lr)

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def reset_optimizer(self) -> None:
        """Drop the optimiser's state (AdamW's moments and step counts): after the warm start,
        RL's first update is AdamW's first, not the warm start's momentum at the RL rate (what
        ``fold_adapters`` does for LoRA, for every strategy)."""
        optimizer = getattr(self.strategy, "optimizer", None)
        if optimizer is not None:
            optimizer.state.clear()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def state_dict(self) -> dict[str, Any]:
        """Collective: rank 0 holds the strategy state; every rank adds its own RNG state."""
        from trainer.checkpoint import capture_rng

        return {**self.strategy.state_dict(), "rng": capture_rng()}

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank loads the full state; ``rng`` may be one state per rank (this rank takes
        its own). A state saved by another ``roles.actor_train.strategy`` is refused."""
        from trainer.checkpoint import restore_rng
        from trainer.resume import check_saved_strategy

        name = str(getattr(self.strategy, "name", self.config.strategy))
        check_saved_strategy(state, name, role="actor_train")
        self.strategy.load_state_dict(state)
        if self.lora is not None:  # checkpoints come after the warm start: the base is frozen
            from trainer.strategies.lora import train_base

            train_base(self.strategy.model, False)
        rng = state.get("rng")
        if isinstance(rng, list):
            rng = rng[self.rank] if self.rank < len(rng) else None
        if rng is not None:
            restore_rng(rng)

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def save_pretrained(self, path: str) -> None:
        """Collective: rank 0 writes the policy (model + tokenizer) as an HF folder; with LoRA the
        adapters merged in, or (``model.lora.export: adapter``) a ``peft`` adapter folder with the
        base it needs in ``path/base`` (HF weights, as the engines were given them), which
        ``adapter_config.json`` names by its absolute path: ``AutoPeftModelForCausalLM.
        from_pretrained(path)`` loads it from any directory (after moving the folder, load the base
        and ``PeftModel.from_pretrained(base, path)``). Weights in ``model.dtype``, not in the fp32
        masters (``trainer.policy_export``)."""
        if self.lora is not None:
            self._export_lora(path)
        else:
            self.strategy.save_pretrained(path)
        if self.rank == 0:
            import os

            from trainer.policy_export import in_model_dtype

            adapter = self.lora is not None and self.lora.export == "adapter"
            in_model_dtype(os.path.join(path, "base") if adapter else path, self.dtype)
            self.tokenizer.save_pretrained(path)

    def _export_lora(self, path: str) -> None:
        import os

        from trainer.strategies.lora import (
            adapter_state,
            engine_weights,
            export_config,
            merge_of,
            save_plain,
            write_adapter,
        )

        if self.lora is None:
            return
        model = self.strategy.model
        as_adapter = self.lora.export == "adapter"
        merge = None if as_adapter else merge_of(model)
        tensors = dict(engine_weights(self.strategy.full_weights(), merge=merge))  # collective
        adapter = adapter_state(model) if as_adapter else None  # collective
        if self.rank != 0:
            return
        target = os.path.join(path, "base") if as_adapter else path
        save_plain(model.config if as_adapter else export_config(model), tensors, target)
        if adapter is not None:
            # absolute: peft's AutoPeftModelForCausalLM.from_pretrained(path) loads the base it
            # names as given (a relative name is taken as a Hub repo id), from any directory
            write_adapter(path, adapter, os.path.abspath(target))
            self.tokenizer.save_pretrained(target)

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def residency(self) -> list[tuple[str, str, bool, str]]:
        """This rank's offload/reload transitions so far as ``(action, state, moved, reason)``."""
        return residency_history(self._strategy)


class ActorCluster(WeightSenderCluster, StrategyCluster):
    """Typed calls to the ``actor_train`` workers (batches of any size split over the ranks)."""

    worker_cls = ActorWorker
    shutdown_calls = ("close_weight_sync",)  # free the workers' shared-memory segments first

    compute_logprobs = remote(ActorWorker.compute_logprobs)
    compute_ref_logprobs = remote(ActorWorker.compute_ref_logprobs)
    uses_lora = remote(ActorWorker.uses_lora)
    fold_adapters = remote(ActorWorker.fold_adapters)
    adapter_weights = remote(ActorWorker.adapter_weights)
    train_step = remote(ActorWorker.train_step)
    sft_step = remote(ActorWorker.sft_step)
    set_lr = remote(ActorWorker.set_lr)
    reset_optimizer = remote(ActorWorker.reset_optimizer)
    residency = remote(ActorWorker.residency, per_rank=True)
    load_state_dict = remote(ActorWorker.load_state_dict)
    save_pretrained = remote(ActorWorker.save_pretrained)

    # by hand: it merges the ranks' answers (Collect.ALL) into one checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Rank 0's full state plus every rank's RNG state (``rng`` becomes a per-rank list)."""
        states = self._call("state_dict")
        merged = dict(states[0])
        if len(states) > 1:
            merged["rng"] = [state["rng"] for state in states]
        return merged
