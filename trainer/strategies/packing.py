"""Micro-batches by token budget, and sequence packing: no compute spent on padding.

A rollout batch is right-padded rows of very different lengths (a few long episodes among many
short ones), each micro-batch trimmed to its longest row. By default a micro-batch is
``train.micro_batch_size`` rows taken longest first within the rows of its optimiser step (all
the batch, or ``train.grad_accumulation`` micro-batches' worth), so short rows are not padded to a
long one's width and each step trains the rows it would in batch order. Two settings change how a
strategy cuts the batch (``BaseTrainStrategy._micro_batches``); neither changes what the loss sees:

``train.micro_batch_tokens: N``
    Rows are grouped, longest first, so that each micro-batch holds about ``N`` tokens (rows x
    the longest row's length, padding included; with packing, packed rows x their width) instead
    of ``micro_batch_size`` rows. A row longer than ``N`` is a micro-batch of its own. With
    ``train.grad_accumulation`` the optimiser steps follow that order too: the first steps take
    the longest rows (each step's gradient is still exactly its rows' loss).
``train.packing: true``
    The rows of a micro-batch are packed, first fit by decreasing length, into rows as wide as
    its longest sequence: ``[a a a b b c c c c]``. Positions restart at each sequence, and the
    attention mask is block-diagonal (causal within a sequence, nothing across), so every token's
    log-prob is what it would be in its own row. The model runs on the packed rows; the outputs
    are unpacked to the original rows before the loss, so losses, masks and the micro-batch
    weights (``distributed.micro_batch_scales``) are untouched.

Each micro-batch keeps its rows' original indices (``_rows``) so that ``forward`` returns rows
in the caller's order whatever the grouping. How the model is told where sequences start depends
on its attention implementation (``config._attn_implementation``), from an allow-list:

``eager``, ``sdpa`` (:data:`MASKED_ATTENTION`)
    An additive float mask of shape ``(packed rows, 1, width, width)``, which transformers takes
    as given. A sliding-window layer (Mistral; Qwen2 with ``use_sliding_window``; any
    ``layer_types`` entry ``sliding_attention``) also masks keys ``sliding_window`` or more
    positions back, as transformers' own window does; a model mixing full and sliding layers gets
    one mask per layer type (a dict keyed by layer type, which transformers' decoders take).
``flash_attention_2``, ``flash_attention_3`` (:data:`VARLEN_ATTENTION`)
    No mask: the packed rows go as one flat row, and transformers runs varlen attention from the
    restarting positions instead (it does so only for a batch of one row).

Anything else - another attention implementation, a layer type other than full or sliding
attention, mixed layers in a model that takes one mask for all, ALiBi position biases
(:func:`uses_alibi`: Bloom, MPT, Falcon with ``alibi``; they are built from a 2-D padding mask,
one sequence per row) - is refused with a ``ModelError`` naming ``train.packing``: packed rows
would give wrong log-probs. What the model's config.json tells is refused at config load
(``trainer._config_model_checks``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.errors import ModelError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIBI_FAMILIES",
    "MASKED_ATTENTION",
    "VARLEN_ATTENTION",
    "MicroPlan",
    "alibi_refusal",
    "build_micro",
    "pack_bins",
    "packed_model_inputs",
    "plan_micro_batches",
    "unpack",
    "uses_alibi",
]

MASKED_ATTENTION = ("eager", "sdpa")
"""Attention implementations given the packed rows' 4-D mask (they use it as it is)."""
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
"""Attention implementations given ONE flat row whose restarting positions delimit sequences."""
ALIBI_FAMILIES = ("bloom", "mpt")
"""``model_type`` values whose attention always adds ALiBi position biases (Falcon does with its
``alibi`` flag): packed rows are refused (:func:`uses_alibi`)."""
FULL, SLIDING = "full_attention", "sliding_attention"
"""The layer types (``config.layer_types``) a packed mask can be built for."""

PACKED_KEYS = ("_packed_ids", "_packed_positions", "_packed_mask", "_unpack")
"""What a packed micro-batch adds to the rows it keeps (meta keys start with ``_``)."""


@dataclass
class MicroPlan:
    """The rows of one micro-batch, and (packing) how they share packed rows."""

    rows: list[int]
    """Original row indices, in the order the micro-batch holds them."""
    bins: list[list[int]] = field(default_factory=list)
    """Packing: positions in ``rows`` of the sequences of each packed row (empty: not packed)."""


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into bins of at most ``capacity``
    tokens (a longer item gets a bin of its own). Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max(0, capacity - lengths[i]))
    return bins


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    rows_per_micro: int,
    tokens_per_micro: int | None = None,
    packing: bool = False,
    rows_per_step: int | None = None,
) -> list[MicroPlan]:
    """How a batch whose rows have ``lengths`` real tokens is cut into micro-batches.

    Without a token budget: ``rows_per_micro`` rows each (packed when ``packing``), taken longest
    first within each optimiser step's ``rows_per_step`` consecutive rows (None: the whole
    batch), so a micro-batch's rows are of like length while every step trains the rows it
    would in batch order. With ``tokens_per_micro``: rows longest first, each micro-batch filled
    while its cost (rows x longest row; packed: packed rows x width) stays within the budget.
    """
    if tokens_per_micro is None:
        return _by_rows(lengths, rows_per_micro, rows_per_step or len(lengths), packing)
    if packing:
        return _packed_by_tokens(lengths, tokens_per_micro)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[MicroPlan] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # longest first: the first row
        if current and (len(current) + 1) * width > tokens_per_micro:
            plans.append(MicroPlan(current))
            current = []
        current.append(i)
    if current:
        plans.append(MicroPlan(current))
    return plans


def _by_rows(lengths: Sequence[int], rows: int, per_step: int, packing: bool) -> list[MicroPlan]:
    """``rows`` rows per micro-batch, longest first within each step's ``per_step`` rows
    (deterministic: ties keep batch order), packed into rows as wide as the longest."""
    plans = []
    for first in range(0, len(lengths), max(per_step, 1)):
        step = range(first, min(first + per_step, len(lengths)))
        order = sorted(step, key=lambda i: (-lengths[i], i))
        plans += [MicroPlan(order[k : k + rows]) for k in range(0, len(order), rows)]
    if packing:
        for plan in plans:
            sub = [lengths[i] for i in plan.rows]
            plan.bins = pack_bins(sub, max(sub, default=1))
    return plans


def _packed_by_tokens(lengths: Sequence[int], budget: int) -> list[MicroPlan]:
    """Packed rows as wide as the longest sequence, then as many per micro-batch as the budget
    allows (at least one)."""
    width = max(lengths, default=1)
    bins = pack_bins(list(lengths), width)
    per_micro = max(1, budget // max(width, 1))
    plans = []
    for start in range(0, len(bins), per_micro):
        group = bins[start : start + per_micro]
        rows = [i for b in group for i in b]
        position = {row: k for k, row in enumerate(rows)}
        plans.append(MicroPlan(rows, [[position[i] for i in b] for b in group]))
    return plans


def build_micro(
    batch: Mapping[str, torch.Tensor], plan: MicroPlan, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The micro-batch of ``plan``: its rows (right-trimmed to the longest) on ``device``, their
    original indices in ``_rows``, and the packed tensors when ``plan.bins`` is set."""
    import torch

    width = batch["input_ids"].shape[1]
    index = torch.tensor(plan.rows, dtype=torch.long)
    micro = {k: v[index] for k, v in batch.items()}
    used = max(1, int(micro["attention_mask"].sum(-1).max()))  # right padding: trim the tail
    micro = {
        k: (v[:, :used] if v.dim() >= 2 and v.shape[1] == width else v).to(device)
        for k, v in micro.items()
    }
    micro["_rows"] = index.to(device)
    if plan.bins:
        micro.update(_pack(micro, plan.bins))
    return micro


def _pack(micro: Mapping[str, torch.Tensor], bins: list[list[int]]) -> dict[str, torch.Tensor]:
    import torch

    ids, mask = micro["input_ids"], micro["attention_mask"]
    lengths = [int(n) for n in mask.sum(-1).tolist()]
    width = max(sum(lengths[i] for i in b) for b in bins)
    device = ids.device
    packed = torch.zeros(len(bins), width, dtype=ids.dtype, device=device)
    positions = torch.zeros(len(bins), width, dtype=torch.long, device=device)
    segments = torch.zeros(len(bins), width, dtype=torch.long, device=device)
    unpack = torch.zeros(ids.shape, dtype=torch.long, device=device)  # row, t -> flat packed index
    for p, members in enumerate(bins):
        offset = 0
        for k, row in enumerate(members, start=1):
            n = lengths[row]
            packed[p, offset : offset + n] = ids[row, :n]
            positions[p, offset : offset + n] = torch.arange(n, device=device)
            segments[p, offset : offset + n] = k
            unpack[row, :n] = p * width + offset + torch.arange(n, device=device)
            offset += n
        tail = width - offset  # padding: a segment of its own, positions from 0
        positions[p, offset:] = torch.arange(tail, device=device)
        segments[p, offset:] = len(members) + 1
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = causal & (segments[:, :, None] == segments[:, None, :])
    return {
        "_packed_ids": packed,
        "_packed_positions": positions,
        "_packed_mask": allowed[:, None],
        "_unpack": unpack,
    }


def packed_model_inputs(model: Any, micro: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Keyword arguments for an HF model's forward over a micro-batch: its rows, or its packed
    rows (block-diagonal additive mask in the model's dtype, banded on sliding-window layers).
    FlashAttention takes no mask: its packed rows go as ONE row whose positions restart at each
    sequence (transformers runs varlen attention only for a batch of one; given several rows it
    attends across sequences), and the caller reshapes the outputs back to ``_packed_ids``' shape.
    Raises ``ModelError`` for a model whose attention packed rows cannot reproduce."""
    if "_packed_ids" not in micro:
        return {"input_ids": micro["input_ids"], "attention_mask": micro["attention_mask"]}
    inputs: dict[str, Any] = {
        "input_ids": micro["_packed_ids"],
        "position_ids": micro["_packed_positions"],
    }
    lm = _language_model(model)
    if uses_alibi(lm.config):
        raise ModelError(alibi_refusal(str(lm.config.model_type)))
    attention = lm.config._attn_implementation
    if attention in VARLEN_ATTENTION:
        return {name: value.reshape(1, -1) for name, value in inputs.items()}
    if attention not in MASKED_ATTENTION:
        raise ModelError(
            f"train.packing cannot tell attn_implementation={attention!r} where packed sequences "
            f"start; packing runs {', '.join(MASKED_ATTENTION)} (a 4-D mask) and "
            f"{', '.join(VARLEN_ATTENTION)} (varlen); load the model with one of them or set "
            "train.packing: false"
        )
    windows = _windows(lm)
    dtype = next(lm.parameters()).dtype
    masks = {kind: _additive(micro["_packed_mask"], window, dtype) for kind, window in windows}
    if len(masks) > 1 and not _takes_mask_per_layer_type(lm):
        raise ModelError(
            f"train.packing: {type(lm).__name__} mixes {sorted(masks)} layers but takes one "
            "attention mask for all of them, so packed rows would attend wrongly on some; set "
            "train.packing: false for this model"
        )
    inputs["attention_mask"] = masks if len(masks) > 1 else next(iter(masks.values()))
    return inputs


def uses_alibi(config: Any) -> bool:
    """Whether a model of this HF config (or config.json's fields as attributes) adds ALiBi
    position biases to its attention scores: ``model_type`` in :data:`ALIBI_FAMILIES`, or an
    ``alibi`` flag set (Falcon)."""
    return getattr(config, "model_type", None) in ALIBI_FAMILIES or (
        getattr(config, "alibi", False) is True
    )


def alibi_refusal(model_type: str) -> str:
    """Why ``train.packing`` is refused for a model with ALiBi attention, and the fix."""
    return (
        f"train.packing cannot run {model_type}'s ALiBi attention on packed rows: its position "
        "biases are built from a 2-D padding mask, one sequence per row, so they would not "
        "restart at each packed sequence (transformers fails or attends wrongly); set "
        "train.packing: false for this model"
    )


def _language_model(model: Any) -> Any:
    """The transformers model in ``model`` (itself, or e.g. a critic's backbone): its config
    names the attention implementation and layer types."""
    from transformers import PretrainedConfig

    for module in model.modules():
        if isinstance(getattr(module, "config", None), PretrainedConfig):
            return module
    raise ModelError(
        f"train.packing needs a transformers model (whose config names its attention); "
        f"{type(model).__name__} holds none: set train.packing: false"
    )


def _windows(lm: Any) -> list[tuple[str, int | None]]:
    """``(layer type, sliding window or None)`` for each kind of attention layer the model has
    (``config.layer_types``; without them, every layer slides if ``sliding_window`` is set, as
    in Mistral)."""
    config = lm.config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
        types = [SLIDING if sliding else FULL]
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ModelError(
            f"train.packing builds masks for {FULL} and {SLIDING} layers only; "
            f"{type(lm).__name__} has {unknown} layers (config.layer_types), whose packed mask "
            "would be wrong; set train.packing: false for this model"
        )
    if SLIDING in types and window is None:
        raise ModelError(
            f"train.packing: {type(lm).__name__} has {SLIDING} layers but no "
            "config.sliding_window; set train.packing: false for this model"
        )
    return [(kind, window if kind == SLIDING else None) for kind in sorted(set(types))]


def _additive(allowed: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of the boolean ``allowed`` ``(packed rows, 1, width, width)``; with a
    ``window``, also masking keys ``window`` or more positions before the query (transformers'
    ``sliding_window_overlay``: ``k > q - window``). Query and key of one sequence are as far
    apart in its packed row as in its own row."""
    import torch

    if window is not None:
        column = torch.arange(allowed.shape[-1], device=allowed.device)
        allowed = allowed & (column[:, None] - column[None, :] < window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _takes_mask_per_layer_type(lm: Any) -> bool:
    """Whether the model's decoder reads a dict of masks keyed by layer type as its
    ``attention_mask`` (``if not isinstance(causal_mask_mapping := attention_mask, dict)`` in
    transformers' decoders); read once per decoder class."""
    import inspect
    import re

    decoder = type(lm.get_decoder() if hasattr(lm, "get_decoder") else lm)
    if decoder not in _READS_MASK_DICT:
        try:
            source = inspect.getsource(decoder.forward)
        except (OSError, TypeError):
            source = ""
        pattern = r"isinstance\(\s*(\w+\s*:=\s*)?attention_mask\s*,\s*dict\s*\)"
        _READS_MASK_DICT[decoder] = re.search(pattern, source) is not None
    return _READS_MASK_DICT[decoder]


_READS_MASK_DICT: dict[type, bool] = {}
"""Decoder class -> whether its forward takes a dict of masks (``_takes_mask_per_layer_type``)."""


def unpack(
    values: torch.Tensor, micro: Mapping[str, torch.Tensor], *, predicted: bool = True
) -> torch.Tensor:
    """Per-token ``(packed rows, width)`` values back to the micro-batch's ``(rows, T)``, zero on
    padding. ``predicted`` (log-probs, entropy: read from the previous position's logits): a
    sequence's first token gets 0, as column 0 of an unpacked row (nothing predicts it)."""
    flat = values.reshape(-1)[micro["_unpack"]]
    if predicted:
        first = micro["_packed_positions"].reshape(-1)[micro["_unpack"]] == 0
        flat = flat.masked_fill(first, 0.0)
    return flat * micro["attention_mask"].to(flat.dtype)
