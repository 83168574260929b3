"""``FSDP2TrainStrategy``: sharded data-parallel training of an HF causal LM with ``fully_shard``.

A ``TrainStrategy`` (see ``base.py``) a worker holds exactly like ``HFTrainStrategy``. Every
rank of the role builds the same model; the strategy joins the process group
(``distributed.ensure_process_group``: gloo on CPU, NCCL on CUDA, same code), builds a 1-D
``init_device_mesh`` over all ranks and applies ``fully_shard`` to each transformer block
(the classes HF lists in ``model._no_split_modules``) and then to the root, so each rank
holds ``1/world`` of every parameter, gradient and AdamW state.

Options (``roles.actor_train.strategy_args``)
-------------------------------------------
``mixed_precision``          compute in ``model.dtype`` (bf16 when that is float32) over the
                             parameters, gathered in that dtype, with fp32 gradient reduction
                             (``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``); default on
                             for CUDA, off on CPU (compute in the parameters' dtype).
``compute_dtype``            that dtype: ``model.dtype`` unless set here (the worker passes it).
``activation_checkpointing`` recompute each block in backward (HF gradient checkpointing,
                             non-reentrant); trades ~30% compute for activation memory.
``cpu_offload``              keep parameters, gradients and optimiser state in host memory
                             (``CPUOffloadPolicy``); the optimiser step runs on the CPU. CUDA only.
``reshard_after_forward``    free gathered parameters after forward (ZeRO-3, default) or keep
                             them until backward (ZeRO-2-like, faster, more memory).
``tensor_parallel_size``     DTensor tensor parallelism inside each block (2-D mesh dp x tp):
                             q/k/v, gate/up column-wise, o/down row-wise (``parallelize_module``),
                             then FSDP2 over the data-parallel dimension. The TP ranks of one
                             group run the same rows (their union, like Megatron's TP); the
                             gradient norm is summed per mesh. Llama/Qwen2-style blocks only.

Master weights: a trainable role is loaded in fp32 whatever ``model.dtype`` says
(``workers.strategy_worker.master_dtype``), so the shards, their gradients and AdamW's moments are
fp32 and a small-lr update is not rounded away; mixed precision gathers them in ``compute_dtype``
for compute only. A frozen model (the reference) keeps the dtype it was loaded in.

Gradient accumulation: ``grad_accumulation`` micro-batches per optimiser step; gradient
reduce-scatter runs only on the last micro-batch of a step (``set_requires_gradient_sync``).
Ranks must issue the same collectives, so a rank with fewer micro-batches than another runs
zero-weighted dummy ones (a ragged data-parallel split never deadlocks).

Weights for the sync: ``full_weights()`` is a *collective* (every rank must call it); it
yields each parameter gathered to a full tensor in HF naming, one at a time, so the weight
sync can bucket them without ever holding the whole model twice. ``full_state_dict()``
gathers everything to rank 0's CPU memory at once with
``get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Unpack

from trainer.strategies.base import BaseTrainStrategy, ForwardOutput, LossFn, TrainOptions
from trainer.strategies.distributed import ensure_process_group, gather_group_rows
from trainer.strategies.parallel_errors import ParallelConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["FSDP2TrainStrategy", "block_modules"]


def block_modules(model: Any) -> list[Any]:
    """The transformer blocks to shard one by one: instances of ``_no_split_modules`` of the model
    or of an HF model inside it (a critic's value-head wrapper keeps the LM as a submodule)."""
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
"""DTensor tensor-parallel plan of one Llama/Qwen2-style block (fsdp2 ``tensor_parallel_size``)."""


def _tensor_parallel(model: Any, mesh: Any, tp: int) -> None:
    """Apply ``TP_PLAN`` to every transformer block of ``model`` over the 1-D ``mesh``.

    A model it cannot split (sizes ``tp`` does not divide, other block shapes) is refused.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    config = getattr(model, "config", None) or getattr(getattr(model, "lm", None), "config", None)
    problems = []
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, what, None)
        if value is None or value % tp:
            problems.append(f"{what}={value} is not divisible by tensor_parallel_size={tp}")
    blocks = block_modules(model)

    def has(block: Any, name: str) -> bool:
        try:
            block.get_submodule(name)
        except AttributeError:
            return False
        return True

    if not blocks or not all(has(block, name) for block in blocks for name in TP_PLAN):
        problems.append("no Llama/Qwen2-style blocks (self_attn.q_proj ... mlp.down_proj) to split")
    if problems:
        raise ParallelConfigError(
            "fsdp2 tensor parallelism impossible for this model: "
            + "; ".join(problems)
            + ". Choose a tensor_parallel_size that divides them, or drop it"
        )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in blocks:
        parallelize_module(block, mesh, {name: styles[style]() for name, style in TP_PLAN.items()})


def _checkpoint_activations(model: Any) -> None:
    """HF gradient checkpointing (non-reentrant) on ``model``; refused for a model without it."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ParallelConfigError(
            f"activation_checkpointing needs an HF PreTrainedModel; {type(model).__name__} has no "
            "gradient_checkpointing_enable()"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "config"):
        model.config.use_cache = False


class FSDP2TrainStrategy(BaseTrainStrategy):
    """Runs and trains one model sharded over all ranks (see the module docstring)."""

    name = "fsdp2"
    collective = True

    def __init__(
        self,
        model: Any,
        *,
        device: str | None = "auto",
        mixed_precision: bool | None = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        tensor_parallel_size: int = 1,
        compute_dtype: str | None = None,
        **common: Unpack[TrainOptions],
    ) -> None:
        super().__init__(**common)
        self.compute_dtype = compute_dtype
        on_cuda = self._use_device(
            device,
            cpu_refusal=(
                "fsdp2 cpu_offload=True needs a CUDA device (on CPU the state already lives in "
                "host memory); drop strategy_args.cpu_offload or train on GPU"
            )
            if cpu_offload
            else None,
        )
        self.rank, self.world_size = ensure_process_group(self.device)
        self.mixed_precision = on_cuda if mixed_precision is None else bool(mixed_precision)
        self.cpu_offload = cpu_offload
        self._build_mesh(model, int(tensor_parallel_size), "cuda" if on_cuda else "cpu")
        if activation_checkpointing:
            _checkpoint_activations(model)
        self._shard(model, reshard_after_forward)
        if not cpu_offload and not on_cuda:
            model.to(self.device)
        self.model = model
        # with cpu_offload the shards and AdamW state live in host memory already: nothing to move
        self._init_optimizer(
            f"fsdp2 rank {self.rank}", foreach=not cpu_offload, movers={} if cpu_offload else None
        )

    def _build_mesh(self, model: Any, tp_size: int, mesh_device: str) -> None:
        """The data-parallel mesh FSDP2 shards over; with TP also a tensor-parallel one, applied
        to ``model``."""
        from torch.distributed.device_mesh import init_device_mesh

        self.tp_size = tp_size  # a divisor of the ranks: checked by create() (layout_problem)
        if self.tp_size == 1:
            self.mesh = init_device_mesh(mesh_device, (self.world_size,), mesh_dim_names=("dp",))
            self.tp_group: Any = None
        else:
            full = init_device_mesh(
                mesh_device,
                (self.world_size // self.tp_size, self.tp_size),
                mesh_dim_names=("dp", "tp"),
            )
            self.mesh = full["dp"]
            self.tp_group = full["tp"].get_group()
            _tensor_parallel(model, full["tp"], self.tp_size)
        self.dp_group, self.dp_size = self.mesh.get_group(), self.world_size // self.tp_size

    def _shard(self, model: Any, reshard_after_forward: bool) -> None:
        """``fully_shard`` each transformer block, then the root."""
        import torch
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        from trainer.strategies.hf import half_dtype

        param_dtype = half_dtype(self.compute_dtype) or torch.bfloat16
        policy = (
            MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
            if self.mixed_precision
            else MixedPrecisionPolicy()
        )
        offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        blocks = block_modules(model)
        if not blocks:
            raise ParallelConfigError(
                f"fsdp2 found no transformer blocks in {type(model).__name__} "
                "(model._no_split_modules is empty); use strategy 'hf' for this model or give it "
                "_no_split_modules"
            )
        for module in [*blocks, model]:  # the blocks one by one, then the root
            fully_shard(
                module,
                mesh=self.mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=policy,
                offload_policy=offload,
            )

    # ------------------------------------------------------------------ hooks of the shared loop
    def _group_rows(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], slice]:
        """TP peers run the union of their rows (every row on its own without TP)."""
        return gather_group_rows(batch, self.tp_group, self.tp_size)

    def _run(
        self, micro: Mapping[str, torch.Tensor], with_entropy: bool, temperature: float
    ) -> ForwardOutput:
        from trainer.strategies.hf import hf_outputs

        return hf_outputs(self.model, micro, self.kind, with_entropy, temperature)

    def _on_micro_batch(self, index: int, count: int) -> None:
        """Reduce-scatter gradients only on the last micro-batch of an optimiser step."""
        self.model.set_requires_gradient_sync(index == count - 1)

    def train_step(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """The shared loop (``BaseTrainStrategy.train_step``); gradient sync is on again after."""
        try:
            return super().train_step(
                batch, loss_fn, with_entropy=with_entropy, temperature=temperature
            )
        finally:
            self.model.set_requires_gradient_sync(True)

    def _clip(self) -> float:
        """Clip the global gradient norm (over all shards); returns the norm before clipping."""
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        limit = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        if self.tp_size == 1:
            total = torch.nn.utils.clip_grad_norm_(params, limit, foreach=not self.cpu_offload)
            return float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        # with TP, gradients live on two meshes (dp x tp for TP weights, dp for the rest): one
        # norm per mesh
        by_mesh: dict[Any, list[Any]] = {}
        for param in params:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
        squares = 0.0
        for group in by_mesh.values():
            part = torch.nn.utils.get_total_norm(
                [p.grad for p in group], foreach=not self.cpu_offload
            )
            squares += float(part.full_tensor() if hasattr(part, "full_tensor") else part) ** 2
        norm = math.sqrt(squares)
        if math.isfinite(norm) and norm > limit:
            for group in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(
                    group, limit, torch.tensor(norm), foreach=not self.cpu_offload
                )
        return norm

    # ------------------------------------------------------------------ weights and state
    def full_weights(self, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: every parameter/buffer gathered to a full tensor, HF names, one at a time.

        Every rank must iterate to the end (each ``full_tensor()`` is an all-gather; a tied
        parameter is gathered once, ``trainer.strategies.tied``). Tensors are on ``device``
        (default: the training device; ``"cpu"`` for host copies).
        """
        from trainer.strategies.tied import full_state

        def full(tensor: Any) -> torch.Tensor:
            whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            return whole.detach().to(device) if device is not None else whole.detach()

        self.residency.require("params")
        yield from full_state(self.model, full)

    def full_state_dict(self) -> dict[str, Any]:
        """Collective: the whole model as full CPU tensors on rank 0 (empty dict on other ranks).

        torch types the values as any state-dict value; with ``full_state_dict=True`` they are
        plain tensors keyed by HF name.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def state_dict(self) -> dict[str, Any]:
        """Collective: model + optimiser as full tensors (rank 0 receives them; others empty).

        An optimiser without state (none trained yet, or reset after the warm start) is left
        out: torch's ``get_state_dict`` would create its state with a zero-gradient step, and the
        next real update would then be AdamW's second, not its first."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        from trainer.resume import strategy_stamp

        self.residency.require("params", "optimizer")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.optimizer is None or not self.optimizer.state:  # (the same on every rank)
            return {"model": self.full_state_dict(), **strategy_stamp(self.name)}
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_state, "optimizer": optim_state, **strategy_stamp(self.name)}

    def save_pretrained(self, path: str) -> None:
        """Collective: gather the full model and let rank 0 write it as an HF folder."""
        state = self.full_state_dict()
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: load full tensors (present on every rank) back into the shards; the
        optimizer keeps its configured settings (``trainer.resume``); a state of another strategy
        is refused."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        from trainer.resume import check_saved_strategy, keep_optimizer_settings

        self.residency.require("params", "optimizer")
        if self.optimizer is not None:
            check_saved_strategy(state, self.name)
        options = StateDictOptions(full_state_dict=True)
        if self.optimizer is not None and state.get("optimizer"):
            with keep_optimizer_settings(self.optimizer):
                set_state_dict(
                    self.model,
                    self.optimizer,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optimizer"],
                    options=options,
                )
        else:
            set_model_state_dict(self.model, state["model"], options=options)
