"""``FSDP2TrainStrategy``: sharded data-parallel training of an HF causal LM with ``fully_shard``.

A ``TrainStrategy`` (see ``base.py``) a worker holds exactly like ``HFTrainStrategy``. Every
rank of the role builds the same model; the strategy joins the process group
(``distributed.ensure_process_group``: gloo on CPU, NCCL on CUDA, same code), builds a 1-D
``init_device_mesh`` over all ranks and applies ``fully_shard`` to each transformer block
(the classes HF lists in ``model._no_split_modules``) and then to the root, so each rank
holds ``1/world`` of every parameter, gradient and AdamW state.

Options (``roles.actor_train.strategy_args``)
-------------------------------------------
``mixed_precision``          bf16 compute with fp32 master weights and fp32 gradient
                             reduction (``MixedPrecisionPolicy``); default on for CUDA, off on CPU.
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
from typing import TYPE_CHECKING, Any, Literal

from trainer.errors import NonFiniteLossError
from trainer.strategies.base import ForwardOutput, LossFn
from trainer.strategies.distributed import (
    ensure_process_group,
    gather_group_rows,
    micro_batch_scales,
    resolve_device,
    split_micro_batches,
)
from trainer.strategies.offload import Residency, state_movers
from trainer.strategies.parallel_errors import ParallelConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["FSDP2TrainStrategy", "block_modules"]


def block_modules(model: Any) -> list[Any]:
    """The transformer blocks to shard one by one: instances of ``_no_split_modules`` of the model or of
    an HF model inside it (a critic's value-head wrapper keeps the LM as a submodule)."""
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}
"""DTensor tensor-parallel plan of one Llama/Qwen2-style block (``fsdp2`` ``tensor_parallel_size``)."""


def _tensor_parallel(model: Any, mesh: Any, tp: int) -> None:
    """Apply ``TP_PLAN`` to every transformer block of ``model`` over the 1-D ``mesh``; refuse what it cannot split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
        raise ParallelConfigError("fsdp2 tensor parallelism impossible for this model: " + "; ".join(problems)
                                  + ". Choose a tensor_parallel_size that divides them, or drop it")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in blocks:
        parallelize_module(block, mesh, {name: styles[style]() for name, style in TP_PLAN.items()})


class FSDP2TrainStrategy:
    """Runs and trains one model sharded over all ranks (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int = 8,
        grad_accumulation: int | None = None,
        trainable: bool = True,
        kind: Literal["lm", "value"] = "lm",
        device: str | None = "auto",
        mixed_precision: bool | None = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        tensor_parallel_size: int = 1,
    ) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.device = resolve_device(device)
        on_cuda = self.device.startswith("cuda")
        if cpu_offload and not on_cuda:
            raise ParallelConfigError(
                "fsdp2 cpu_offload=True needs a CUDA device (on CPU the state already lives in host "
                "memory); drop strategy_args.cpu_offload or train on GPU"
            )
        self.rank, self.world_size = ensure_process_group(self.device)
        self.kind = kind
        self.micro_batch_size = micro_batch_size
        self.grad_accumulation = grad_accumulation
        self.max_grad_norm = max_grad_norm
        self.mixed_precision = on_cuda if mixed_precision is None else bool(mixed_precision)
        self.cpu_offload = cpu_offload
        self.tp_size = int(tensor_parallel_size)
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ParallelConfigError(
                f"fsdp2 tensor_parallel_size={tensor_parallel_size} does not divide the role's {self.world_size} "
                "ranks; choose a divisor of the device count"
            )
        mesh_device = "cuda" if on_cuda else "cpu"
        if self.tp_size == 1:
            self.mesh = init_device_mesh(mesh_device, (self.world_size,), mesh_dim_names=("dp",))
            self.tp_group: Any = None
        else:
            full = init_device_mesh(mesh_device, (self.world_size // self.tp_size, self.tp_size),
                                    mesh_dim_names=("dp", "tp"))
            self.mesh = full["dp"]
            self.tp_group = full["tp"].get_group()
            _tensor_parallel(model, full["tp"], self.tp_size)

        if activation_checkpointing:
            if not hasattr(model, "gradient_checkpointing_enable"):
                raise ParallelConfigError(
                    f"activation_checkpointing needs an HF PreTrainedModel; {type(model).__name__} has no "
                    "gradient_checkpointing_enable()"
                )
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "config"):
                model.config.use_cache = False
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.mixed_precision else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
        shard = {"mesh": self.mesh, "mp_policy": policy, "offload_policy": offload}
        blocks = block_modules(model)
        if not blocks:
            raise ParallelConfigError(
                f"fsdp2 found no transformer blocks in {type(model).__name__} (model._no_split_modules is "
                "empty); use strategy 'hf' for this model or give it _no_split_modules"
            )
        for block in blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward, **shard)
        fully_shard(model, reshard_after_forward=reshard_after_forward, **shard)
        if not cpu_offload and not on_cuda:
            model.to(self.device)
        self.model = model
        self.optimizer: torch.optim.Optimizer | None = None
        if trainable:
            self.optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
                foreach=not cpu_offload,
            )
        else:
            model.requires_grad_(False)
        model.train(trainable)
        # with cpu_offload the shards and AdamW state live in host memory already: nothing to move
        self.residency = Residency(self.device, {} if cpu_offload else state_movers(model, self.optimizer),
                                   owner=f"fsdp2 rank {self.rank}")

    # ------------------------------------------------------------------ micro-batches
    def _micro_batches(self, batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches, padded in count to the max over ranks (see ``split_micro_batches``)."""
        return split_micro_batches(batch, self.micro_batch_size, self.device, same_count_on_all_ranks=True)

    def _run(self, micro: Mapping[str, torch.Tensor], with_entropy: bool) -> ForwardOutput:
        from trainer.strategies.hf import token_logprobs

        out = self.model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
        if self.kind == "value":
            values = out.float()
            return ForwardOutput(logprobs=values * 0.0, values=values)
        logprobs, entropy = token_logprobs(out.logits, micro["input_ids"], with_entropy)
        return ForwardOutput(logprobs=logprobs, entropy=entropy)

    # ------------------------------------------------------------------ forward
    def forward(self, batch: Mapping[str, torch.Tensor], *, with_entropy: bool = False) -> ForwardOutput:
        """Per-token outputs for this rank's batch, no gradients, padded back to the batch width."""
        import torch

        self.residency.require("params")
        width = batch["input_ids"].shape[1]
        batch, mine = gather_group_rows(batch, self.tp_group, self.tp_size)
        parts: list[ForwardOutput] = []
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for micro in self._micro_batches(batch):
                out = self._run(micro, with_entropy)
                if "_dummy" not in micro:
                    parts.append(out)
        self.model.train(was_training)

        def cat(field: str) -> torch.Tensor | None:
            tensors = [getattr(p, field) for p in parts]
            if not tensors or tensors[0] is None:
                return None
            full = batch["input_ids"].shape[1]
            return torch.cat([torch.nn.functional.pad(t.float().cpu(), (0, full - t.shape[1]))
                              for t in tensors])[mine, :width]

        return ForwardOutput(logprobs=cat("logprobs"), entropy=cat("entropy"), values=cat("values"))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ train
    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, with_entropy: bool = False) -> dict[str, float]:
        """One or more optimiser steps over this rank's ``batch`` (``grad_accumulation`` micro-batches each)."""
        import torch

        if self.optimizer is None:
            raise RuntimeError("train_step on a frozen model; build the strategy with trainable=True")
        self.residency.require("params", "optimizer")
        batch, _ = gather_group_rows(batch, self.tp_group, self.tp_size)  # TP peers train on the same rows
        micros = self._micro_batches(batch)
        real = sum(1 for m in micros if "_dummy" not in m)
        per_step = self.grad_accumulation or len(micros)
        dp_size = self.world_size // self.tp_size
        scales = micro_batch_scales(micros, per_step, getattr(loss_fn, "agg_mode", "token-mean"),
                                    group=self.mesh.get_group(), replicas=dp_size)
        totals: dict[str, float] = {}
        steps = 0
        self.model.train()
        for first in range(0, len(micros), per_step):
            group = micros[first:first + per_step]
            self.optimizer.zero_grad(set_to_none=True)
            for index, micro in enumerate(group):
                self.model.set_requires_gradient_sync(index == len(group) - 1)
                out = self._run(micro, with_entropy)
                if "_dummy" in micro:
                    loss = out.logprobs.sum() * 0.0 if self.kind == "lm" else out.values.sum() * 0.0  # type: ignore[union-attr]
                    metrics: dict[str, float] = {}
                else:
                    loss, metrics = loss_fn(out, micro)
                if not torch.isfinite(loss.detach()):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise NonFiniteLossError(
                        f"the loss became {loss.item()} on rank {self.rank} (metrics {metrics}); the update was "
                        "not applied. Lower train.lr, raise the loss clip, or check the rewards"
                    )
                (loss * scales[first + index]).backward()
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value / max(real, 1)
            norm = self._clip()
            if not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteLossError(
                    f"the gradient norm became {norm}; the update was not applied. Lower train.lr or set "
                    "train.max_grad_norm"
                )
            self.optimizer.step()
            steps += 1
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + norm
        self.model.set_requires_gradient_sync(True)
        totals["grad_norm"] = totals.get("grad_norm", 0.0) / max(steps, 1)
        totals["optimizer_steps"] = float(steps)
        return totals

    def _clip(self) -> float:
        """Clip the global gradient norm (over all shards); returns the norm before clipping."""
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        limit = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        if self.tp_size == 1:
            norm = torch.nn.utils.clip_grad_norm_(params, limit, foreach=not self.cpu_offload)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            return float(norm)
        # with TP, gradients live on two meshes (dp x tp for TP weights, dp for the rest): one norm per mesh
        by_mesh: dict[Any, list[Any]] = {}
        for param in params:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
        squares = 0.0
        for group in by_mesh.values():
            part = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=not self.cpu_offload)
            squares += float(part.full_tensor() if hasattr(part, "full_tensor") else part) ** 2
        norm = math.sqrt(squares)
        if math.isfinite(norm) and norm > limit:
            for group in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(group, limit, torch.tensor(norm), foreach=not self.cpu_offload)
        return norm

    def set_lr(self, lr: float) -> None:
        """Change the learning rate of every parameter group."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    # ------------------------------------------------------------------ weights and state
    def full_weights(self, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: every parameter/buffer gathered to a full tensor, HF names, one at a time.

        Every rank must iterate to the end (each ``full_tensor()`` is an all-gather). Tensors are
        on ``device`` (default: the training device; ``"cpu"`` for host copies).
        """
        self.residency.require("params")
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            full = full.detach()
            yield name, (full.to(device) if device is not None else full)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model as full CPU tensors on rank 0 (empty dict on other ranks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def state_dict(self) -> dict[str, Any]:
        """Collective: model + optimiser as full tensors (rank 0 receives them; others get empty dicts)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        self.residency.require("params", "optimizer")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.optimizer is None:
            return {"model": self.full_state_dict()}
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_state, "optimizer": optim_state}

    def save_pretrained(self, path: str) -> None:
        """Collective: gather the full model and let rank 0 write it as an HF folder."""
        state = self.full_state_dict()
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: load full tensors (present on every rank) back into the shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        self.residency.require("params", "optimizer")
        options = StateDictOptions(full_state_dict=True)
        if self.optimizer is not None and state.get("optimizer"):
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=options)
        else:
            set_model_state_dict(self.model, state["model"], options=options)

    def offload(self, *, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters and/or optimiser state to host memory (colocation); a tracked no-op on CPU.

        See ``trainer.strategies.offload``: the next call that needs a state reloads it.
        """
        self.residency.offload(params=params, optimizer=optimizer)

    def reload(self) -> None:
        """Bring every offloaded state back onto the device."""
        self.residency.reload()
