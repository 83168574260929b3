"""``torch.distributed`` plumbing shared by the parallel strategies: one process group per worker.

The same code runs on CPU and GPU: the backend is ``gloo`` when the strategy's device is
``cpu`` and ``nccl`` on CUDA (``cpu:gloo,cuda:nccl`` so CPU-side collectives still work).
A worker started by the trainer's cluster finds ``MASTER_ADDR``/``RANK``/``WORLD_SIZE`` set
(``Worker._set_distributed_env``) and joins with ``env://``; a strategy built in a plain
process (a notebook, a benchmark) without those variables gets a one-rank group on a free
loopback port, so FSDP2 and Megatron-Core work there too.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from trainer.algos.losses import AggregationMode

__all__ = [
    "all_max",
    "backend_for",
    "dummy_row",
    "ensure_process_group",
    "free_port",
    "gather_group_rows",
    "micro_batch_scales",
    "pad_micro_count",
    "resolve_device",
    "shutdown_process_group",
    "summed_over_group",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def backend_for(device: str) -> str:
    """``gloo`` for CPU training, ``cpu:gloo,cuda:nccl`` for CUDA training."""
    return "gloo" if device.startswith("cpu") else "cpu:gloo,cuda:nccl"


def resolve_device(device: str | None) -> str:
    """``auto``/None: ``cuda:<LOCAL_RANK>`` when CUDA is present, else ``cpu``.

    A bare ``cuda`` gets the local rank's index too.
    """
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank % max(torch.cuda.device_count(), 1)}"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} but this torch has no CUDA; use device='cpu'")
        torch.cuda.set_device(torch.device(device))
    return device


def ensure_process_group(device: str) -> tuple[int, int]:
    """Join (or create) the default process group; returns ``(rank, world_size)``."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "MASTER_ADDR" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
            }
        )
    import torch

    dist.init_process_group(
        backend=backend_for(device),
        init_method="env://",
        device_id=torch.device(device) if device.startswith("cuda") else None,
    )
    return dist.get_rank(), dist.get_world_size()


def shutdown_process_group() -> None:
    """Barrier, then destroy the default group (without the barrier a rank may abort)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_max(value: int, device: torch.device | str = "cpu") -> int:
    """The maximum of an int over all ranks (micro-batch counts must agree before collectives)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def pad_micro_count(
    micros: list[dict[str, torch.Tensor]],
    batch: Mapping[str, torch.Tensor],
    device: torch.device | str,
) -> list[dict[str, torch.Tensor]]:
    """``micros`` padded with one-row dummies (marked ``_dummy``, which losses ignore) up to the
    largest count over ranks, so every rank runs the same number of forward/backward
    collectives. A rank given no rows at all (a ragged split of a chunk smaller than the world
    size) still takes part: its dummy is ``dummy_row`` of the batch's width."""
    total = all_max(len(micros), device)
    while len(micros) < total:
        source = batch if batch["input_ids"].shape[0] else dummy_row(batch)
        dummy = {k: v[:1].to(device) for k, v in source.items()}
        dummy["_dummy"] = dummy["input_ids"].new_ones(())
        micros.append(dummy)
    return micros


def dummy_row(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One all-zero row with ``batch``'s keys, dtypes and width (at least 1), attending to its first
    token only: a forward over a row that attends to nothing could give NaN, which a zero
    weight does not cancel."""
    import torch

    width = max(1, batch["input_ids"].shape[1]) if batch["input_ids"].dim() >= 2 else 1
    row: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        shape = (1, width, *value.shape[2:]) if value.dim() >= 2 else (1, *value.shape[1:])
        row[key] = torch.zeros(shape, dtype=value.dtype, device=value.device)
    row["attention_mask"][:, 0] = 1
    return row


def micro_batch_scales(
    micros: list[dict[str, torch.Tensor]],
    per_step: int,
    mode: AggregationMode = "token-mean",
    *,
    group: ProcessGroup | None = None,
    replicas: int = 1,
) -> list[float]:
    """What each micro-batch's loss is multiplied by before ``backward``, so that an optimiser
    step's gradient is that of the loss aggregated over the *whole step* (``trainer.algos.losses``).

    ``scale = units / units of its step * replicas``: ``units`` is what ``mode`` averages over
    (response tokens, or sequences), summed over the ``per_step`` micro-batches of the same
    optimiser step on every rank of ``group`` (one ``all_reduce``; ranks hold equally many
    micro-batches, see ``pad_micro_count``); ``replicas`` undoes the gradient *average* over
    data-parallel replicas (FSDP's reduce-scatter, Megatron's all-reduce). Dummy micro-batches
    weigh 0. Per-micro-batch means averaged instead would weigh a 2-token row like a 200-token one.
    """
    import torch
    import torch.distributed as dist

    from trainer.algos.losses import aggregation_units

    units = [
        0.0
        if "_dummy" in m
        else float(aggregation_units(m.get("response_mask", m["attention_mask"]), mode))
        for m in micros
    ]
    totals = torch.zeros(-(-len(micros) // per_step), dtype=torch.float64)
    for index, value in enumerate(units):
        totals[index // per_step] += value
    if replicas > 1:
        dist.all_reduce(totals, group=group)
    return [
        value / float(totals[index // per_step]) * replicas if value else 0.0
        for index, value in enumerate(units)
    ]


def gather_group_rows(
    batch: Mapping[str, torch.Tensor], group: ProcessGroup | None, size: int
) -> tuple[dict[str, torch.Tensor], slice]:
    """The union of the rows every rank of ``group`` (``size`` ranks) was given, right-padded to one
    width, and where this rank's own rows sit in it. Model-parallel peers (tensor-parallel ranks,
    pipeline stages) must run the same rows while the cluster splits a batch over all ranks: they
    run the union, and each returns its own rows, so the caller's data-parallel split holds."""
    import torch
    import torch.distributed as dist

    cpu = {k: v.cpu() for k, v in batch.items()}
    if size == 1:
        return cpu, slice(0, cpu["input_ids"].shape[0])
    me = dist.get_rank(group)
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, cpu, group=group)
    counts = [g["input_ids"].shape[0] for g in gathered]
    width = max(g["input_ids"].shape[1] for g in gathered)
    union = {
        k: torch.cat(
            [
                torch.nn.functional.pad(g[k], (0, width - g[k].shape[1]))
                if g[k].dim() >= 2
                else g[k]
                for g in gathered
            ]
        )
        for k in cpu
    }
    start = sum(counts[:me])
    return union, slice(start, start + counts[me])


def summed_over_group(totals: dict[str, float], group: Any, size: int) -> dict[str, float]:
    """``totals``' loss metrics summed over the ``size`` ranks of ``group`` (each holds its rows'
    weighted part; the gradient norm is already the global one). Gathered as dicts: a rank
    whose micro-batches are all dummies has no loss metrics of its own to name."""
    import torch.distributed as dist

    parts: list[dict[str, float] | None] = [None] * size
    mine = {name: value for name, value in totals.items() if name != "grad_norm"}
    dist.all_gather_object(parts, mine, group=group)
    summed: dict[str, float] = {}
    for part in parts:
        for name, value in (part or {}).items():
            summed[name] = summed.get(name, 0.0) + value
    return {**totals, **summed}
