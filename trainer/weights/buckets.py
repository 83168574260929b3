"""Size-bounded buckets of full HF-named tensors, each one flat byte buffer.

The weight sync never moves a model as one blob (twice the memory) nor tensor by tensor
(one IPC handle or collective per tensor): it packs consecutive tensors into buckets of at
most ``bucket_bytes``, each a single contiguous ``uint8`` buffer plus a small list of
:class:`TensorMeta` (name, dtype, shape, byte offset). One buffer is one CUDA IPC handle,
one shared-memory segment or one broadcast; the receiver unpacks zero-copy views.

A tensor larger than ``bucket_bytes`` cannot be split across buckets (the receiver loads
whole tensors), so :func:`plan_buckets` and :func:`iter_buckets` raise
``BucketTooSmallError`` naming that tensor and the smallest size that works. ``plan_buckets``
checks a whole model's tensor sizes *before* any bucket moves, so a bad setting fails before
the engine is touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.weights.errors import BucketTooSmallError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN",
    "Bucket",
    "TensorMeta",
    "distinct_nbytes",
    "group_tensors",
    "in_dtype",
    "iter_buckets",
    "largest_tensor",
    "pack",
    "packed_bytes",
    "plan_buckets",
]

ALIGN = 64
"""Byte alignment of each tensor inside a bucket (any dtype's views stay aligned)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket's buffer."""

    name: str
    dtype: str
    """``torch`` dtype name, e.g. ``"bfloat16"``."""
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Bucket:
    """One flat ``uint8`` buffer holding the tensors ``metas`` describes."""

    buffer: torch.Tensor
    metas: list[TensorMeta]
    index: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Zero-copy views ``(name, tensor)`` into the buffer, in packing order."""
        import torch

        for meta in self.metas:
            raw = self.buffer[meta.offset : meta.offset + meta.nbytes]
            yield meta.name, raw.view(getattr(torch, meta.dtype)).view(meta.shape)


def _too_small(name: str, nbytes: int, bucket_bytes: int) -> BucketTooSmallError:
    needed = _aligned(nbytes)
    return BucketTooSmallError(
        f"tensor {name!r} needs {nbytes:,} bytes but bucket_bytes={bucket_bytes:,}; raise the "
        f"bucket size to at least {needed:,} bytes ({needed / 2**20:.2f} MiB), "
        f"e.g. weight_sync.bucket_mb={-(-needed // 2**20)}"
    )


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def largest_tensor(model_path: str, dtype: str) -> tuple[str, int] | None:
    """``(name, bytes)`` of the largest tensor of the checkpoint at ``model_path`` as trained in
    ``dtype``, read from its ``config.json`` (embedding or MLP matrix; no weights loaded), or
    None when there is no readable HF config there. Lets the config check a bucket size early."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        hidden = int(config["hidden_size"])
        shapes = {
            "model.embed_tokens.weight": int(config["vocab_size"]) * hidden,
            "model.layers.0.mlp.up_proj.weight": int(config.get("intermediate_size", 0)) * hidden,
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None
    name = max(shapes, key=shapes.__getitem__)
    return name, shapes[name] * _DTYPE_BYTES.get(dtype, 4)


def plan_buckets(sizes: Iterable[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group ``(name, nbytes)`` into buckets, in order; raises if one exceeds ``bucket_bytes``."""
    if bucket_bytes <= 0:
        raise BucketTooSmallError(f"bucket_bytes must be positive, got {bucket_bytes}")
    sizes = list(sizes)
    largest = max(sizes, key=lambda item: item[1], default=None)
    if largest is not None and _aligned(largest[1]) > bucket_bytes:
        raise _too_small(largest[0], largest[1], bucket_bytes)
    plan: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if plan[-1] and used + _aligned(nbytes) > bucket_bytes:
            plan.append([])
            used = 0
        plan[-1].append(name)
        used += _aligned(nbytes)
    return [group for group in plan if group]


def pack(
    named: list[tuple[str, torch.Tensor]],
    *,
    index: int = 0,
    device: torch.device | str | None = None,
    buffer: torch.Tensor | None = None,
) -> Bucket:
    """Copy ``named`` tensors into one flat buffer (on ``device``, default the first tensor's).

    A tensor object listed under several names (a tied parameter, ``trainer.strategies.tied``)
    is stored once; each name gets a meta at the same offset.
    """
    import torch

    metas: list[TensorMeta] = []
    offsets: dict[int, int] = {}  # id(tensor) -> its offset: a tied name is a second meta
    copies: list[tuple[torch.Tensor, int]] = []
    end = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        offset = offsets.get(id(tensor))
        if offset is None:
            offset = offsets[id(tensor)] = end
            copies.append((tensor, len(metas)))
            end += _aligned(nbytes)
        metas.append(
            TensorMeta(
                name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes
            )
        )
    target = device if device is not None else (named[0][1].device if named else "cpu")
    if buffer is None or buffer.numel() < end:
        buffer = torch.empty(end, dtype=torch.uint8, device=target)
    bucket = Bucket(buffer[:end], metas, index)
    views = list(bucket.tensors())
    for tensor, at in copies:
        views[at][1].copy_(tensor.detach().reshape(views[at][1].shape), non_blocking=True)
    return bucket


def distinct_nbytes(metas: Iterable[TensorMeta]) -> int:
    """The bytes of a bucket's tensors, each counted once (a tied name shares its offset)."""
    return sum({meta.offset: meta.nbytes for meta in metas}.values())


def packed_bytes(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The buffer :func:`pack` needs for ``named`` (a tensor object listed twice counts once)."""
    sizes = {id(t): _aligned(t.numel() * t.element_size()) for _, t in named}
    return sum(sizes.values())


def in_dtype(
    named: Iterable[tuple[str, torch.Tensor]], dtype: str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with every floating tensor in ``dtype`` (None: as they are): the trainer's fp32
    master weights as the engines hold them (``model.dtype``), cast one tensor at a time. A
    tensor object repeated at once under another name (a tied parameter:
    ``strategies.tied.full_state``) stays one object, so a bucket still stores it once."""
    import torch

    target = getattr(torch, dtype) if dtype else None
    last: tuple[Any, Any] = (None, None)  # (the tensor given, its cast)
    for name, tensor in named:
        if target is None or not tensor.is_floating_point() or tensor.dtype == target:
            yield name, tensor
            continue
        if last[0] is not tensor:
            last = (tensor, tensor.to(target))
        yield name, last[1]


def group_tensors(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive ``(name, tensor)`` groups whose aligned sizes fit ``bucket_bytes`` (no copy).

    The grouping depends only on tensor sizes, so every rank of a sharded trainer that
    iterates the same full tensors forms the same groups (they step through a sync in lockstep).
    A name carrying the previous item's tensor object (a tied parameter's second name) joins its
    group at no cost.
    """
    items = weights.items() if isinstance(weights, Mapping) else weights
    pending: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in items:
        if pending and tensor is pending[-1][1]:  # a tied name: same bytes, packed once
            pending.append((name, tensor))
            continue
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if nbytes > bucket_bytes:
            raise _too_small(name, tensor.numel() * tensor.element_size(), bucket_bytes)
        if pending and used + nbytes > bucket_bytes:
            yield pending
            pending, used = [], 0
        pending.append((name, tensor))
        used += nbytes
    if pending:
        yield pending


def iter_buckets(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    device: torch.device | str | None = None,
) -> Iterator[Bucket]:
    """Stream ``weights`` into buckets of at most ``bucket_bytes`` (sizes checked as they come)."""
    for index, group in enumerate(group_tensors(weights, bucket_bytes)):
        yield pack(group, index=index, device=device)
