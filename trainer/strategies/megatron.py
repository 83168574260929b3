"""``MegatronTrainStrategy``: tensor-, pipeline- and data-parallel training with Megatron-Core.

The model is an HF Qwen2/Llama one, converted to a Megatron-Core ``GPTModel`` and back.

A ``TrainStrategy`` (see ``base.py``). Each rank is handed the same HF model; the strategy

1. joins the process group (gloo on CPU, NCCL on CUDA; ``distributed.py``) and initialises
   Megatron's model-parallel groups (``tensor_parallel_size`` x data-parallel = world);
2. builds a Megatron-Core ``GPTModel`` with the *local* layer spec (no Transformer Engine or
   Apex needed) from the HF config, and loads this TP rank's shard of the HF weights through
   ``megatron_convert.hf_to_megatron`` (exact);
3. trains it: fp32 master weights and AdamW (the ``GPTModel`` is built in fp32 and
   ``torch.optim.AdamW`` steps it: no Megatron ``Float16Module`` or distributed optimiser, so no
   separate main-param copy is needed), autocast to ``compute_dtype`` (``model.dtype``; bf16 when
   that is float32) on CUDA, per-token log-probs from
   vocab-parallel logits gathered over the TP group, gradients averaged over data-parallel
   replicas and the global norm clipped over TP shards and PP stages;
4. gives the weight sync full HF-named tensors (``full_weights``, a collective over the TP
   group and, with pipeline stages, the PP group: one layer at a time) via
   ``megatron_convert.megatron_to_hf``.

Pipeline parallelism (``pipeline_parallel_size`` = PP > 1): each stage builds only its slice
of layers (``pre_process`` = embedding on the first stage, ``post_process`` = final norm and
output layer on the last) and micro-batches run through Megatron-Core's own 1F1B schedule
(``get_forward_backward_func``; activations and their gradients cross stages by point-to-point
send/receive, gloo on CPU). Every micro-batch of one schedule is padded to one shape
[rows, width] (the schedule's send/receive buffers have a fixed shape); outputs are cut back
to the real rows and tokens before the loss, so padding never reaches it. The loss and the
log-probs are computed on the last stage and broadcast to the other stages of the pipeline.
Tied embeddings (``tie_word_embeddings``) with PP > 1: the last stage keeps its own copy of
the embedding as its output layer (the converter hands it the same tensor) and, after each
backward, the two copies' gradients are summed over Megatron's embedding group - so both
apply the same update and stay equal (the tie HF computes in one process). Megatron's own
tied-PP setup is not used: it moves the copy with ``.cuda()``.

Attention: ``attention="sdpa"`` (default) swaps Megatron's unfused ``DotProductAttention``
for ``megatron_model.SDPACoreAttention`` (``torch.nn.functional.scaled_dot_product_attention``,
flash kernels on GPU); ``"local"`` keeps Megatron's own. Both are causal; batches are
right-padded, so padding never leaks into real tokens.

Data: the cluster splits a batch over *all* ranks, but a TP group (and the stages of one
pipeline) must see the same rows. So each rank all-gathers its model-parallel (TP x PP)
peers' rows, the group runs the union, and each rank returns the outputs of its own rows -
the caller's data-parallel split stays correct for any TP and PP.

On CPU, ``megatron_cpu_shim.activate`` is called (CPU RNG tracker, CPU allocation, the
schedules' CUDA token counter); on GPU it never is.

Checkpoints: ``state_dict`` (a collective) gives rank 0 the model as full HF tensors plus
every rank's optimiser shard (``optimizer_ranks``, by global rank); ``load_state_dict``
re-slices the model and hands each rank its own optimiser shard, so a resumed run must use
the same world size. ``save_pretrained`` writes an HF folder (safetensors + config) from rank 0.
Offload/reload (AutoDeviceMapping colocation) move parameters and/or AdamW state to host
memory and back on CUDA, as the role's ``offload_params``/``offload_optimizer`` say; on CPU they
are tracked no-ops (``trainer.strategies.offload``: the state already lives in host memory).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Unpack

from trainer.resume import check_saved_strategy, keep_optimizer_settings, strategy_stamp
from trainer.strategies.base import BaseTrainStrategy, ForwardOutput, LossFn, TrainOptions
from trainer.strategies.distributed import ensure_process_group, gather_group_rows
from trainer.strategies.megatron_convert import (
    hf_to_megatron,
    layout_from_hf_config,
    megatron_to_hf,
)
from trainer.strategies.megatron_model import build_gpt_model
from trainer.strategies.parallel_errors import ParallelConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["MegatronTrainStrategy"]


class _GatherLastDim:
    """All-gather along the last dim over a group; backward keeps this rank's slice."""

    @staticmethod
    def apply(tensor: torch.Tensor, group: Any) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
                parts = [torch.empty_like(x) for _ in range(ctx.size)]
                dist.all_gather(parts, x.contiguous(), group=group)
                return torch.cat(parts, dim=-1)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous()

        return Fn.apply(tensor)


class MegatronTrainStrategy(BaseTrainStrategy):
    """Runs and trains an HF Qwen2/Llama model as a Megatron-Core GPTModel (module docstring)."""

    name = "megatron"
    collective = True

    def __init__(
        self,
        model: Any,
        *,
        device: str | None = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        mixed_precision: bool | None = None,
        activation_checkpointing: bool = False,
        attention: Literal["sdpa", "local"] = "sdpa",
        seed: int = 0,
        compute_dtype: str | None = None,
        **common: Unpack[TrainOptions],
    ) -> None:
        super().__init__(**common)
        if self.kind != "lm":
            raise ParallelConfigError(
                "the megatron strategy trains causal LMs only; use 'fsdp2' or 'hf' for a critic"
            )
        needs_cuda = []  # options megatron runs on CUDA only: refused here, not at the first step
        if activation_checkpointing:
            needs_cuda.append(
                "megatron activation_checkpointing needs CUDA (its recompute saves CUDA RNG "
                "states); drop strategy_args.activation_checkpointing on CPU"
            )
        if attention == "local":
            needs_cuda.append(
                "megatron's own attention (strategy_args.attention: local) needs CUDA; use "
                "attention: sdpa on CPU"
            )
        on_cuda = self._use_device(device, cpu_refusal="; ".join(needs_cuda) or None)
        self.layout = layout_from_hf_config(
            model.config, tp=tensor_parallel_size, pp=pipeline_parallel_size
        )
        self.rank, self.world_size = ensure_process_group(self.device)
        self._init_model_parallel(tensor_parallel_size, pipeline_parallel_size)
        if on_cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        else:
            from trainer.strategies import megatron_cpu_shim

            megatron_cpu_shim.activate(seed, self.tp_rank)
        self.mixed_precision = on_cuda if mixed_precision is None else bool(mixed_precision)
        import torch

        from trainer.strategies.hf import half_dtype

        self.autocast_dtype = half_dtype(compute_dtype) or torch.bfloat16
        """What compute runs in under mixed precision (on CUDA)."""
        self.hf_config = model.config
        self.model = build_gpt_model(
            self.layout,
            attention=attention,
            recompute=activation_checkpointing,
            pre_process=self.first_stage,
            post_process=self.last_stage,
        )
        self._load_hf(model.state_dict())
        self.model.to(self.device)
        self._init_optimizer(f"megatron rank {self.rank}")

    def _init_model_parallel(self, tp: int, pp: int) -> None:
        """Megatron's TP x PP x DP groups (once per process), and this rank's place in them."""
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():  # (the layout itself was checked by create())
            have = (
                mpu.get_tensor_model_parallel_world_size(),
                mpu.get_pipeline_model_parallel_world_size(),
            )
            if have != (tp, pp):
                raise ParallelConfigError(
                    f"this process already runs Megatron with TP={have[0]}, PP={have[1]}, not "
                    f"TP={tp}, PP={pp}; one layout per process"
                )
        else:
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
            )
        self.tp_group, self.dp_group = (
            mpu.get_tensor_model_parallel_group(),
            mpu.get_data_parallel_group(),
        )
        self.tp_rank, self.tp_size = mpu.get_tensor_model_parallel_rank(), tp
        self.pp_group, self.mp_group = (
            mpu.get_pipeline_model_parallel_group(),
            mpu.get_model_parallel_group(),
        )
        self.pp_rank, self.pp_size = mpu.get_pipeline_model_parallel_rank(), pp
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.dp_size = mpu.get_data_parallel_world_size()

    def _load_hf(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        shard = hf_to_megatron(hf_state, self.layout, tp_rank=self.tp_rank, pp_rank=self.pp_rank)
        missing, unexpected = self.model.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ParallelConfigError(
                f"megatron shard does not fit GPTModel: missing {missing}, unexpected {unexpected}"
            )

    # ------------------------------------------------------------------ hooks of the shared loop
    def _group_rows(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], slice]:
        """The union of the model-parallel (TP x PP) group's rows, and where this rank's sit."""
        return gather_group_rows(batch, self.mp_group, self.tp_size * self.pp_size)

    def _run(
        self, micro: Mapping[str, torch.Tensor], with_entropy: bool, temperature: float
    ) -> ForwardOutput:
        import torch

        from trainer.strategies.hf import token_logprobs

        ids = micro["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        with torch.autocast(
            "cuda", dtype=self.autocast_dtype, enabled=self.mixed_precision and ids.is_cuda
        ):
            logits = self.model(input_ids=ids, position_ids=positions, attention_mask=None)
        if self.tp_size > 1:
            logits = _GatherLastDim.apply(logits, self.tp_group)
        logits = logits[..., : self.layout.vocab_size]
        logprobs, entropy = token_logprobs(logits, ids, with_entropy, temperature=temperature)
        return ForwardOutput(logprobs=logprobs, entropy=entropy)

    def _forward_micros(
        self, micros: list[dict[str, torch.Tensor]], with_entropy: bool, temperature: float
    ) -> list[ForwardOutput]:
        if self.pp_size > 1:
            return self._pipeline(micros, with_entropy, temperature, loss_fn=None)[0]
        return super()._forward_micros(micros, with_entropy, temperature)

    def _accumulate(
        self,
        group: list[dict[str, torch.Tensor]],
        scales: list[float],
        loss_fn: LossFn,
        with_entropy: bool,
        temperature: float,
    ) -> list[tuple[float, dict[str, float]]]:
        if self.pp_size > 1:
            run = self._pipeline(group, with_entropy, temperature, loss_fn=loss_fn, scales=scales)
            return run[1]
        return super()._accumulate(group, scales, loss_fn, with_entropy, temperature)

    def _reduce_gradients(self) -> None:
        self._reduce_tied_embedding()
        self._reduce_data_parallel()

    def _pipeline(
        self,
        micros: list[dict[str, torch.Tensor]],
        with_entropy: bool,
        temperature: float,
        loss_fn: LossFn | None,
        scales: list[float] | None = None,
    ) -> tuple[list[ForwardOutput], list[tuple[float, dict[str, float]]]]:
        """Run ``micros`` through Megatron-Core's pipeline schedule (PP > 1); a collective.

        With ``loss_fn`` it is a training pass (1F1B: forward and backward interleaved, gradients
        accumulated, each loss scaled by its ``scales`` entry like the PP=1 path - times
        ``len(micros)``, which the schedule divides by); without it a forward-only pass.
        Returns, on *every* stage (broadcast from the last one), the detached per-micro-batch
        outputs (forward-only) and the ``(loss, metrics)`` of each micro-batch.
        """
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from trainer.strategies.hf import token_logprobs

        rows = max(m["input_ids"].shape[0] for m in micros)
        width = max(m["input_ids"].shape[1] for m in micros)
        outputs: list[ForwardOutput] = []
        losses: list[tuple[float, dict[str, float]]] = []

        def finish(
            micro: dict[str, torch.Tensor], logits: torch.Tensor, index: int
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            n, w = micro["input_ids"].shape
            logits = logits[:n, :w]  # the real rows and tokens of this micro-batch
            if self.tp_size > 1:
                logits = _GatherLastDim.apply(logits, self.tp_group)
            logprobs, entropy = token_logprobs(
                logits[..., : self.layout.vocab_size],
                micro["input_ids"],
                with_entropy,
                temperature=temperature,
            )
            out = ForwardOutput(logprobs=logprobs, entropy=entropy)
            if loss_fn is None:
                outputs.append(
                    ForwardOutput(
                        logprobs=logprobs.detach().float().cpu(),
                        entropy=None if entropy is None else entropy.detach().float().cpu(),
                    )
                )
                return logprobs.sum() * 0.0, {}
            loss, metrics = self._micro_loss(out, micro, loss_fn)
            losses.append((float(loss.detach()), metrics))
            if not math.isfinite(losses[-1][0]):
                # keep the schedule going on every stage; the step is refused after it
                loss = logprobs.sum() * 0.0
            return loss * (scales[index] * len(micros) if scales is not None else 1.0), {}

        def step(
            data: Iterator[tuple[int, dict[str, torch.Tensor]]], model: Any
        ) -> tuple[torch.Tensor, Any]:
            index, micro = next(data)
            ids = micro["input_ids"]
            ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1], 0, rows - ids.shape[0]))
            positions = torch.arange(width, device=ids.device).expand_as(ids)
            with torch.autocast(
                "cuda", dtype=self.autocast_dtype, enabled=self.mixed_precision and ids.is_cuda
            ):
                output = model(input_ids=ids, position_ids=positions, attention_mask=None)
            return output, lambda logits: finish(micro, logits, index)

        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(enumerate(micros)),
            model=[self.model],
            num_microbatches=len(micros),
            seq_length=width,
            micro_batch_size=rows,
            forward_only=loss_fn is None,
        )
        shared: list[Any] = [(outputs, losses)]
        dist.broadcast_object_list(
            shared, src=mpu.get_pipeline_model_parallel_last_rank(), group=self.pp_group
        )
        return shared[0]

    def _reduce_tied_embedding(self) -> None:
        """PP > 1 with tied embeddings: sum the gradients of the first stage's embedding and the
        last stage's output-layer copy (Megatron's embedding group), so both take the same step."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        if not (self.layout.tied_embeddings and self.pp_size > 1) or not (
            self.first_stage or self.last_stage
        ):
            return
        param = (
            self.model.embedding.word_embeddings.weight
            if self.first_stage
            else self.model.output_layer.weight
        )
        if param.grad is not None:
            dist.all_reduce(param.grad, group=mpu.get_embedding_group())

    def _reduce_data_parallel(self) -> None:
        import torch
        import torch.distributed as dist

        if self.dp_size == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp_size
        for grad, reduced in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            grad.copy_(reduced)

    def _clip(self) -> float:
        """Global grad norm over TP shards (replicated norms counted once), then clip.

        Every parameter of this GPTModel is split over TP except the RMSNorm weights (the
        local spec has no row-parallel biases); megatron's ``tensor_model_parallel`` flag is
        not set when weights are loaded rather than initialised, so the names decide.
        """
        import torch
        import torch.distributed as dist

        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        device = named[0][1].grad.device if named else self.device
        sharded = torch.zeros((), device=device)
        replicated = torch.zeros((), device=device)
        tied_copy = self.layout.tied_embeddings and self.pp_size > 1
        for name, param in named:
            if tied_copy and name == "output_layer.weight":
                continue  # the same tensor as the first stage's embedding: counted there
            square = param.grad.float().pow(2).sum()
            if "layernorm" in name:
                replicated += square
            else:
                sharded += square
        if self.tp_size * self.pp_size > 1:
            dist.all_reduce(sharded, group=self.mp_group)  # distinct TP slices and distinct stages
        if self.pp_size > 1:  # norms: the same on a stage's TP ranks
            dist.all_reduce(replicated, group=self.pp_group)
        norm = float((sharded + replicated).sqrt())
        if self.max_grad_norm is not None and math.isfinite(norm) and norm > self.max_grad_norm:
            for _, param in named:
                param.grad.mul_(self.max_grad_norm / (norm + 1e-6))
        return norm

    # ------------------------------------------------------------------ weights and state
    def full_weights(self, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: full HF-named tensors, gathered and converted one layer at a time.

        Each layer is all-gathered over its stage's TP group and converted; with PP > 1 each
        stage's converted layers are then broadcast over the pipeline group, stage by stage,
        so every rank yields the whole model (in the same order) and rank 0 can send it.
        """
        self.residency.require("params")
        if self.pp_size == 1:
            for chunk in self._stage_chunks():
                for name, tensor in self._hf_chunk(chunk).items():
                    yield name, (tensor.to(device) if device is not None else tensor)
            return
        import torch
        import torch.distributed as dist

        for stage in range(self.pp_size):
            source = dist.get_global_rank(self.pp_group, stage)
            chunks = self._stage_chunks() if stage == self.pp_rank else []
            count = [len(chunks)]
            dist.broadcast_object_list(count, src=source, group=self.pp_group)
            for index in range(count[0]):
                hf = self._hf_chunk(chunks[index]) if stage == self.pp_rank else {}
                meta = [[(name, tuple(t.shape), t.dtype) for name, t in hf.items()]]
                dist.broadcast_object_list(meta, src=source, group=self.pp_group)
                for name, shape, dtype in meta[0]:
                    tensor = (
                        hf[name].contiguous()
                        if stage == self.pp_rank
                        else torch.empty(shape, dtype=dtype, device=self.device)
                    )
                    dist.broadcast(tensor, src=source, group=self.pp_group)
                    yield name, (tensor.to(device) if device is not None else tensor)

    def _stage_chunks(self) -> list[list[str]]:
        """This rank's Megatron parameter names per layer (embedding, each layer, norm, output)."""
        chunks: dict[str, list[str]] = {}
        for name in self.model.state_dict():
            if name.endswith("_extra_state"):
                continue
            key = ".".join(name.split(".")[:3]) if name.startswith("decoder.layers.") else name
            chunks.setdefault(key, []).append(name)
        return list(chunks.values())

    def _hf_chunk(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Collective over the TP group: the named local tensors, gathered and converted to HF."""
        import torch
        import torch.distributed as dist

        local = self.model.state_dict()
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp_size)]
        for name in names:
            tensor = local[name].detach()
            if self.tp_size == 1:
                shards[0][name] = tensor
                continue
            parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
            dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
            for rank, part in enumerate(parts):
                shards[rank][name] = part
        stages: list[Sequence[Mapping[str, torch.Tensor]]] = [
            [{}] * self.tp_size for _ in range(self.pp_size)
        ]
        stages[self.pp_rank] = shards
        return megatron_to_hf(stages, self.layout)

    def _gather_to_rank0(self) -> dict[str, torch.Tensor]:
        """Collective: full HF tensors on CPU, kept by rank 0 (the others take part, keep none)."""
        kept: dict[str, torch.Tensor] = {}
        for name, tensor in self.full_weights():
            if self.rank == 0:
                kept[name] = tensor.cpu().contiguous()
        return kept

    def state_dict(self) -> dict[str, Any]:
        """Collective: the model as full HF tensors on CPU and every rank's optimiser state.

        Rank 0 gets them, the other ranks empty dicts. Optimiser state is per shard, so it is
        gathered as a list indexed by global rank; ``load_state_dict`` gives each rank its own
        entry back.
        """
        import torch.distributed as dist

        self.residency.require("params", "optimizer")
        model = self._gather_to_rank0()
        optim = self.optimizer.state_dict() if self.optimizer is not None else None
        ranks: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        if self.world_size > 1:
            dist.gather_object(optim, ranks, dst=0)
        elif ranks is not None:
            ranks[0] = optim
        if self.rank != 0:
            return {}
        state: dict[str, Any] = {"model": model, **strategy_stamp(self.name, self._state_layout)}
        if self.optimizer is not None:
            state["optimizer_ranks"] = ranks
        return state

    @property
    def _state_layout(self) -> dict[str, int]:
        """What the per-rank optimiser shards depend on (checked on load)."""
        return {
            "ranks": self.world_size,
            "tensor_parallel_size": self.tp_size,
            "pipeline_parallel_size": self.pp_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load full HF tensors (re-sliced for this rank) and, if present, its optimiser state,
        keeping the optimiser's configured settings (``trainer.resume``); a state of another
        strategy or layout is refused."""
        self.residency.require("params", "optimizer")
        if self.optimizer is not None:
            check_saved_strategy(state, self.name, self._state_layout)
        self._load_hf(state["model"])
        if self.optimizer is None:
            return
        ranks = state.get("optimizer_ranks")
        if ranks is not None:
            if len(ranks) != self.world_size:
                raise ParallelConfigError(
                    f"the checkpoint holds optimiser state for {len(ranks)} megatron ranks but "
                    f"this run has {self.world_size}; resume with the same device_mapping and "
                    "tensor_parallel_size"
                )
            with keep_optimizer_settings(self.optimizer):
                self.optimizer.load_state_dict(ranks[self.rank])

    def save_pretrained(self, path: str) -> None:
        """Collective: gather and convert the full model; rank 0 writes an HF folder.

        The folder holds ``model.safetensors`` and the HF config.
        """
        from pathlib import Path

        from safetensors.torch import save_file

        weights = self._gather_to_rank0()
        if self.rank != 0:
            return
        if self.layout.tied_embeddings:  # HF re-ties lm_head to the embedding on load
            weights.pop("lm_head.weight", None)
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        self.hf_config.save_pretrained(str(folder))
