"""Where each training rank's own shard lands in the full HF-named tensors (no gather needed).

The colocated weight sync does not all-gather parameters: every trainer rank copies the
part of each full HF tensor it already holds straight into the shared-memory bucket that
the engine reads (``sender.ShardSender``). This module describes that part.

:func:`shard_layout` returns a :class:`ShardLayout` for a strategy:

``specs``   every full HF tensor of the model, in HF ``state_dict`` order: name, shape, dtype.
            The same list on every rank, known before anything moves (so a bucket size too
            small for the largest tensor fails up front).
``pieces``  ``name -> [(index, source)]``: this rank's data for that tensor; ``full[index]``
            receives ``source`` (viewed to ``source.shape`` when it is a row block). Pieces
            of all ranks are disjoint and together cover every tensor exactly once.

Layouts
    ``fsdp2``     DTensor ``Shard(0)`` on a 1-D mesh: rank ``r`` holds rows
                  ``chunk(full, world)[r]`` of every parameter (torch.chunk sizes);
                  replicated tensors are written by rank 0. Other placements (FSDP2 with
                  DTensor tensor parallel on a 2-D mesh) are gathered when the layout is
                  built and written whole by rank 0: correct, not shard-direct.
    ``megatron``  TP rank ``r`` of pipeline stage ``p`` (data-parallel replica 0 only):
                  column-parallel (vocab rows, q/k/v groups, gate/up rows) land as row
                  blocks, row-parallel (o_proj, down_proj) as column blocks; the fused
                  ``linear_qkv`` is split per KV group into q/k/v and ``linear_fc1`` into
                  gate/up exactly as ``megatron_convert`` does; vocab padding is dropped;
                  layer norms are written by TP rank 0.
    otherwise     a strategy holding a plain (unsharded) ``model``: rank 0 writes whole tensors.

Tied weights (``lm_head.weight`` sharing the embedding) are stored once, under the first
name, and listed in ``aliases`` (``lm_head.weight -> model.embed_tokens.weight``): the bucket
carries a second name for the same bytes. The engine still receives the tied name - vLLM
on CPU rebuilds the LM head's packed kernel only when ``lm_head.weight`` arrives, so leaving
it out would serve new layers with a stale head.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "Piece",
    "ShardLayout",
    "TensorSpec",
    "equal_piece",
    "megatron_layout",
    "shard_layout",
    "write_piece",
]

Index = tuple[slice, ...]
Piece = tuple[Index, "torch.Tensor"]


@dataclass(frozen=True)
class TensorSpec:
    """One full HF tensor of the model."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """``torch`` dtype name, e.g. ``"float32"``."""

    @property
    def nbytes(self) -> int:
        import torch

        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class ShardLayout:
    """The full tensors of a model and this rank's pieces of them (see the module docstring)."""

    specs: list[TensorSpec]
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    """A tied tensor's other name -> the name it is stored under."""

    def sizes(self) -> list[tuple[str, int]]:
        return [(spec.name, spec.nbytes) for spec in self.specs]


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def shard_layout(strategy: Any, *, rank: int = 0, gather: bool = True) -> ShardLayout:
    """This rank's :class:`ShardLayout` for ``strategy`` (``fsdp2``, ``megatron`` or an unsharded one).

    ``gather=False`` skips the collective gathers of tensors that are not shard-direct (2-D
    FSDP2 meshes): their specs are listed, their pieces are not (for size checks only).
    """
    kind = type(strategy).__name__
    if kind == "MegatronTrainStrategy":
        return _megatron(strategy)
    if kind == "FSDP2TrainStrategy":
        return _fsdp2(strategy, gather=gather)
    model = getattr(strategy, "model", None)
    if model is None:
        raise TypeError(
            f"the shared-memory weight sync cannot read the shards of {kind} (no .model); use "
            "weight_sync.transport=broadcast"
        )
    return _whole(model, write=rank == 0)


def _unique(model: Any, layout: ShardLayout) -> Iterator[tuple[str, Any]]:
    """``model.state_dict()`` items, each tied parameter once (the others go to ``layout.aliases``).

    Ties are found on the parameters themselves: a sharded ``state_dict`` may hand out a new
    wrapper per name for one parameter.
    """
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            layout.aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    for name, tensor in model.state_dict().items():
        if name not in layout.aliases:
            yield name, tensor


def _whole(model: Any, *, write: bool) -> ShardLayout:
    layout = ShardLayout([])
    for name, tensor in _unique(model, layout):
        tensor = tensor.detach()
        layout.specs.append(TensorSpec(name, tuple(tensor.shape), _dtype(tensor)))
        if write:
            layout.pieces[name] = [((), tensor)]
    return layout


# --------------------------------------------------------------------------- FSDP2


def _fsdp2(strategy: Any, *, gather: bool = True) -> ShardLayout:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank = strategy.rank
    layout = ShardLayout([])
    for name, tensor in _unique(strategy.model, layout):
        tensor = tensor.detach()
        layout.specs.append(TensorSpec(name, tuple(tensor.shape), _dtype(tensor)))
        if not isinstance(tensor, DTensor):
            if rank == 0:
                layout.pieces[name] = [((), tensor)]
            continue
        placements = tuple(tensor.placements)
        local = tensor.to_local()
        if len(placements) == 1 and isinstance(placements[0], Replicate):
            if tensor.device_mesh.get_local_rank() == 0:
                layout.pieces[name] = [((), local)]
            continue
        if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
            # a 2-D mesh (FSDP x tensor parallel, strided shards): gather this tensor (a collective
            # every rank runs in the same order) and let rank 0 write it whole
            full = tensor.full_tensor() if gather else None
            if full is not None and rank == 0:
                layout.pieces[name] = [((), full)]
            continue
        rows, world = tensor.shape[0], tensor.device_mesh.size()
        mesh_rank = tensor.device_mesh.get_local_rank()
        step = -(-rows // world)
        start = min(mesh_rank * step, rows)
        length = max(0, min(step, rows - start))
        if local.shape[0] != length:
            raise RuntimeError(
                f"{name}: FSDP2 rank {mesh_rank} holds {local.shape[0]} rows, expected {length} "
                f"(torch.chunk of {rows} rows over {world} ranks)"
            )
        if length:
            layout.pieces[name] = [((slice(start, start + length),), local)]
    return layout


# --------------------------------------------------------------------------- Megatron


def _megatron(strategy: Any) -> ShardLayout:
    from megatron.core import parallel_state as mpu

    local = {
        k: v.detach()
        for k, v in strategy.model.state_dict().items()
        if not k.endswith("_extra_state")
    }
    return megatron_layout(
        strategy.layout,
        local,
        tp_rank=strategy.tp_rank,
        pp_rank=getattr(strategy, "pp_rank", 0),
        write=mpu.get_data_parallel_rank() == 0,
    )


def megatron_layout(
    lay: Any, local: dict[str, torch.Tensor], *, tp_rank: int, pp_rank: int = 0, write: bool = True
) -> ShardLayout:
    """The layout of one Megatron rank: ``local`` is its ``GPTModel`` state dict, ``lay`` its ``MegatronLayout``."""
    tp, r = lay.tp, tp_rank
    dtype = _dtype(next(iter(local.values())))
    h, d, groups = lay.hidden_size, lay.head_dim, lay.num_kv_heads
    per_group = lay.num_heads // groups
    f, vocab = lay.ffn_hidden_size, lay.vocab_size
    qd = lay.num_heads * d

    specs: list[TensorSpec] = [TensorSpec("model.embed_tokens.weight", (vocab, h), dtype)]
    for i in range(lay.num_layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "self_attn.q_proj.weight", (qd, h), dtype),
            TensorSpec(p + "self_attn.k_proj.weight", (groups * d, h), dtype),
            TensorSpec(p + "self_attn.v_proj.weight", (groups * d, h), dtype),
        ]
        if lay.qkv_bias:
            specs += [
                TensorSpec(p + "self_attn.q_proj.bias", (qd,), dtype),
                TensorSpec(p + "self_attn.k_proj.bias", (groups * d,), dtype),
                TensorSpec(p + "self_attn.v_proj.bias", (groups * d,), dtype),
            ]
        specs += [
            TensorSpec(p + "self_attn.o_proj.weight", (h, qd), dtype),
            TensorSpec(p + "mlp.gate_proj.weight", (f, h), dtype),
            TensorSpec(p + "mlp.up_proj.weight", (f, h), dtype),
            TensorSpec(p + "mlp.down_proj.weight", (h, f), dtype),
            TensorSpec(p + "input_layernorm.weight", (h,), dtype),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), dtype),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), dtype))
    if not lay.tied_embeddings:
        specs.append(TensorSpec("lm_head.weight", (vocab, h), dtype))
    layout = ShardLayout(specs)
    if lay.tied_embeddings:
        layout.aliases["lm_head.weight"] = "model.embed_tokens.weight"
    if not write:
        return layout
    pieces = layout.pieces

    def vocab_rows(tensor: torch.Tensor) -> list[Piece]:
        block = tensor.shape[0]
        start = r * block
        length = max(0, min(block, vocab - start))
        return [((slice(start, start + length),), tensor[:length])] if length else []

    def rows(block: int) -> Index:
        return (slice(r * block, (r + 1) * block),)

    def cols(block: int) -> Index:
        return (slice(None), slice(r * block, (r + 1) * block))

    def qkv(name: str, suffix: str, tensor: torch.Tensor) -> None:
        tail = tensor.shape[1:]
        fused = tensor.view(groups // tp, (per_group + 2) * d, *tail)
        mine = groups // tp
        pieces[name + "q_proj" + suffix] = [(rows(mine * per_group * d), fused[:, : per_group * d])]
        pieces[name + "k_proj" + suffix] = [
            (rows(mine * d), fused[:, per_group * d : (per_group + 1) * d])
        ]
        pieces[name + "v_proj" + suffix] = [(rows(mine * d), fused[:, (per_group + 1) * d :])]

    if "embedding.word_embeddings.weight" in local:
        pieces["model.embed_tokens.weight"] = vocab_rows(local["embedding.word_embeddings.weight"])
    for number, index in enumerate(lay.stage_layers(pp_rank)):
        src, dst = f"decoder.layers.{number}.", f"model.layers.{index}."
        if src + "self_attention.linear_qkv.weight" not in local:
            continue
        for suffix in (".weight", ".bias") if lay.qkv_bias else (".weight",):
            qkv(dst + "self_attn.", suffix, local[src + "self_attention.linear_qkv" + suffix])
        pieces[dst + "self_attn.o_proj.weight"] = [
            (cols(qd // tp), local[src + "self_attention.linear_proj.weight"])
        ]
        fc1 = local[src + "mlp.linear_fc1.weight"]
        pieces[dst + "mlp.gate_proj.weight"] = [(rows(f // tp), fc1[: f // tp])]
        pieces[dst + "mlp.up_proj.weight"] = [(rows(f // tp), fc1[f // tp :])]
        pieces[dst + "mlp.down_proj.weight"] = [
            (cols(f // tp), local[src + "mlp.linear_fc2.weight"])
        ]
        if r == 0:
            pieces[dst + "input_layernorm.weight"] = [((), local[src + "input_layernorm.weight"])]
            pieces[dst + "post_attention_layernorm.weight"] = [
                ((), local[src + "pre_mlp_layernorm.weight"])
            ]
    if "decoder.final_layernorm.weight" in local and r == 0:
        pieces["model.norm.weight"] = [((), local["decoder.final_layernorm.weight"])]
    if "output_layer.weight" in local and not lay.tied_embeddings:
        pieces["lm_head.weight"] = vocab_rows(local["output_layer.weight"])
    return layout


def write_piece(target: torch.Tensor, index: Index, source: torch.Tensor) -> None:
    """``target[index] = source`` (a row block is viewed to ``source``'s shape, e.g. per-group q/k/v)."""
    view = target[index] if index else target
    if view.shape != source.shape:
        view = view.view(source.shape)
    view.copy_(source)


def equal_piece(target: torch.Tensor, index: Index, source: torch.Tensor) -> bool:
    """Whether ``target[index]`` already holds ``source`` bitwise (``only_changed``)."""
    import torch

    view = target[index] if index else target
    if view.shape != source.shape:
        view = view.view(source.shape)
    return bool(torch.equal(view, source))
