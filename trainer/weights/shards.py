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

    from trainer.strategies.megatron_convert import MegatronLayout

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


def shard_layout(
    strategy: Any, *, rank: int = 0, gather: bool = True, dtype: str | None = None
) -> ShardLayout:
    """This rank's :class:`ShardLayout` for ``strategy``: ``fsdp2``, ``megatron`` or unsharded.

    ``gather=False`` skips the collective gathers of tensors that are not shard-direct (2-D
    FSDP2 meshes): their specs are listed, their pieces are not (for size checks only).
    ``dtype``: the full tensors' dtype where they are floating (the engines' ``model.dtype``;
    the fp32 master pieces are cast as they are written); None keeps the strategy's.
    """
    kind = type(strategy).__name__
    if kind == "MegatronTrainStrategy":
        layout = _megatron(strategy)
    elif kind == "FSDP2TrainStrategy":
        layout = _fsdp2(strategy, gather=gather)
    else:
        model = getattr(strategy, "model", None)
        if model is None:
            raise TypeError(
                f"the shared-memory weight sync cannot read the shards of {kind} (no .model); "
                "use weight_sync.transport=broadcast"
            )
        layout = _whole(model, write=rank == 0)
    if dtype is not None:
        layout.specs = [_in_dtype(spec, dtype) for spec in layout.specs]
    return layout


def _in_dtype(spec: TensorSpec, dtype: str) -> TensorSpec:
    """``spec`` in ``dtype`` if it is floating (integer buffers keep theirs)."""
    import torch

    return (
        TensorSpec(spec.name, spec.shape, dtype)
        if spec.dtype != dtype and getattr(torch, spec.dtype).is_floating_point
        else spec
    )


def _unique(model: Any, layout: ShardLayout) -> Iterator[tuple[str, Any]]:
    """``model.state_dict()`` items, each tied parameter once (the others: ``layout.aliases``)."""
    from trainer.strategies.tied import tied_names

    for name, aliases in tied_names(model).items():
        layout.aliases.update(dict.fromkeys(aliases, name))
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
    lay: MegatronLayout,
    local: dict[str, torch.Tensor],
    *,
    tp_rank: int,
    pp_rank: int = 0,
    write: bool = True,
) -> ShardLayout:
    """The layout of one Megatron rank.

    ``local`` is the rank's ``GPTModel`` state dict and ``lay`` its ``MegatronLayout``;
    ``write=False`` lists the specs only (a data-parallel replica other than 0).
    """
    layout = ShardLayout(_megatron_specs(lay, _dtype(next(iter(local.values())))))
    if lay.tied_embeddings:
        layout.aliases["lm_head.weight"] = "model.embed_tokens.weight"
    if write:
        layout.pieces.update(_megatron_pieces(lay, local, tp_rank=tp_rank, pp_rank=pp_rank))
    return layout


def _megatron_specs(lay: MegatronLayout, dtype: str) -> list[TensorSpec]:
    """Every full HF tensor of the model, in HF ``state_dict`` order."""
    h, vocab = lay.hidden_size, lay.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, h), dtype)]
    for i in range(lay.num_layers):
        specs += _layer_specs(lay, f"model.layers.{i}.", dtype)
    specs.append(TensorSpec("model.norm.weight", (h,), dtype))
    if not lay.tied_embeddings:
        specs.append(TensorSpec("lm_head.weight", (vocab, h), dtype))
    return specs


def _layer_specs(lay: MegatronLayout, prefix: str, dtype: str) -> list[TensorSpec]:
    """The full HF tensors of one decoder layer (``prefix``: ``model.layers.<i>.``)."""
    h, f = lay.hidden_size, lay.ffn_hidden_size
    qd, kvd = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("self_attn.q_proj.weight", (qd, h)),
        ("self_attn.k_proj.weight", (kvd, h)),
        ("self_attn.v_proj.weight", (kvd, h)),
    ]
    if lay.qkv_bias:
        shapes += [
            ("self_attn.q_proj.bias", (qd,)),
            ("self_attn.k_proj.bias", (kvd,)),
            ("self_attn.v_proj.bias", (kvd,)),
        ]
    shapes += [
        ("self_attn.o_proj.weight", (h, qd)),
        ("mlp.gate_proj.weight", (f, h)),
        ("mlp.up_proj.weight", (f, h)),
        ("mlp.down_proj.weight", (h, f)),
        ("input_layernorm.weight", (h,)),
        ("post_attention_layernorm.weight", (h,)),
    ]
    return [TensorSpec(prefix + name, shape, dtype) for name, shape in shapes]


@dataclass(frozen=True)
class _TensorParallelRank:
    """Where TP rank ``r``'s blocks of a column- or row-parallel tensor sit in the full tensor."""

    lay: MegatronLayout
    r: int

    def rows(self, block: int) -> Index:
        return (slice(self.r * block, (self.r + 1) * block),)

    def cols(self, block: int) -> Index:
        return (slice(None), slice(self.r * block, (self.r + 1) * block))

    def vocab_rows(self, tensor: torch.Tensor) -> list[Piece]:
        """This rank's rows of a vocab-parallel tensor, Megatron's vocab padding dropped."""
        block = tensor.shape[0]
        start = self.r * block
        length = max(0, min(block, self.lay.vocab_size - start))
        return [((slice(start, start + length),), tensor[:length])] if length else []

    def qkv(self, fused: torch.Tensor) -> tuple[list[Piece], list[Piece], list[Piece]]:
        """Split this rank's fused ``linear_qkv`` per KV group into q, k and v row blocks."""
        d, per_group = self.lay.head_dim, self.lay.num_heads // self.lay.num_kv_heads
        mine = self.lay.num_kv_heads // self.lay.tp  # KV groups on this rank
        grouped = fused.view(mine, (per_group + 2) * d, *fused.shape[1:])
        q = grouped[:, : per_group * d]
        k = grouped[:, per_group * d : (per_group + 1) * d]
        v = grouped[:, (per_group + 1) * d :]
        return (
            [(self.rows(mine * per_group * d), q)],
            [(self.rows(mine * d), k)],
            [(self.rows(mine * d), v)],
        )


def _megatron_pieces(
    lay: MegatronLayout, local: dict[str, torch.Tensor], *, tp_rank: int, pp_rank: int
) -> dict[str, list[Piece]]:
    """This rank's pieces: vocab-parallel rows, its stage's layers, the final norm (TP rank 0)."""
    rank = _TensorParallelRank(lay, tp_rank)
    pieces: dict[str, list[Piece]] = {}
    if "embedding.word_embeddings.weight" in local:
        pieces["model.embed_tokens.weight"] = rank.vocab_rows(
            local["embedding.word_embeddings.weight"]
        )
    for number, index in enumerate(lay.stage_layers(pp_rank)):
        src = f"decoder.layers.{number}."
        if src + "self_attention.linear_qkv.weight" in local:
            pieces.update(_layer_pieces(rank, local, src, f"model.layers.{index}."))
    if "decoder.final_layernorm.weight" in local and tp_rank == 0:
        pieces["model.norm.weight"] = [((), local["decoder.final_layernorm.weight"])]
    if "output_layer.weight" in local and not lay.tied_embeddings:
        pieces["lm_head.weight"] = rank.vocab_rows(local["output_layer.weight"])
    return pieces


def _layer_pieces(
    rank: _TensorParallelRank, local: dict[str, torch.Tensor], src: str, dst: str
) -> dict[str, list[Piece]]:
    """One decoder layer's pieces: Megatron layer ``src`` written as HF layer ``dst``."""
    lay, tp = rank.lay, rank.lay.tp
    qd, f = lay.num_heads * lay.head_dim, lay.ffn_hidden_size
    pieces: dict[str, list[Piece]] = {}
    for suffix in (".weight", ".bias") if lay.qkv_bias else (".weight",):
        q, k, v = rank.qkv(local[src + "self_attention.linear_qkv" + suffix])
        pieces[dst + "self_attn.q_proj" + suffix] = q
        pieces[dst + "self_attn.k_proj" + suffix] = k
        pieces[dst + "self_attn.v_proj" + suffix] = v
    pieces[dst + "self_attn.o_proj.weight"] = [
        (rank.cols(qd // tp), local[src + "self_attention.linear_proj.weight"])
    ]
    fc1 = local[src + "mlp.linear_fc1.weight"]  # gate rows, then up rows
    pieces[dst + "mlp.gate_proj.weight"] = [(rank.rows(f // tp), fc1[: f // tp])]
    pieces[dst + "mlp.up_proj.weight"] = [(rank.rows(f // tp), fc1[f // tp :])]
    pieces[dst + "mlp.down_proj.weight"] = [
        (rank.cols(f // tp), local[src + "mlp.linear_fc2.weight"])
    ]
    if rank.r == 0:  # layer norms are replicated over TP: written once
        pieces[dst + "input_layernorm.weight"] = [((), local[src + "input_layernorm.weight"])]
        pieces[dst + "post_attention_layernorm.weight"] = [
            ((), local[src + "pre_mlp_layernorm.weight"])
        ]
    return pieces


def write_piece(target: torch.Tensor, index: Index, source: torch.Tensor) -> None:
    """``target[index] = source`` (cast to ``target``'s dtype); a row block is viewed to
    ``source``'s shape (per-group q/k/v)."""
    view = target[index] if index else target
    if view.shape != source.shape:
        view = view.view(source.shape)
    view.copy_(source)


def equal_piece(target: torch.Tensor, index: Index, source: torch.Tensor) -> bool:
    """Whether ``target[index]`` already holds ``source`` (in ``target``'s dtype) bitwise
    (``only_changed``)."""
    import torch

    view = target[index] if index else target
    if view.shape != source.shape:
        view = view.view(source.shape)
    return bool(torch.equal(view, source.to(view.dtype)))
