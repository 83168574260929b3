"""The train -> infer weight sync: bucketed, versioned, through shared memory or a broadcast group.

After each train step the driver calls :meth:`WeightSync.sync`. The full HF-named tensors
are grouped into buckets of at most ``bucket_mb`` (the grouping depends only on sizes, so
all ranks agree; a bucket smaller than the largest tensor raises ``BucketTooSmallError``
naming ``weight_sync.bucket_mb`` and the size needed *before* any engine is told a sync
starts) and each engine receives full HF tensors, which it re-slices for its own layout
(``engine.update_weights`` runs once per sync, fed bucket by bucket).

Transports (``weight_sync.transport``)

``shared_memory``  colocated, shard-direct: no gather. Every trainer rank copies the part
                   of each full HF tensor it already holds (``shards.shard_layout``: FSDP2
                   row chunks; Megatron TP column/row blocks with q/k/v and gate/up split
                   as the converter does) straight into the right slice of a shared-memory
                   bucket laid out as full tensors (``transport.SegmentPool``, one segment
                   per bucket, reused from sync to sync). Per bucket the driver makes one
                   call to the trainer ranks (``write_weight_bucket``) and one to the
                   inference workers (``load_weight_bucket``, a small handle), which queue
                   zero-copy views for the engine's load and return at once, so the engine
                   loads bucket k while the trainer writes bucket k+1. No segment is
                   rewritten before the engines finished (``finish_weight_load``), so the
                   engine's own load is the only copy on its side. Host memory: one model
                   copy in shared memory while the trainer lives. A trainer on GPUs takes
                   the gathered path instead: rank 0 gathers each bucket into one CUDA
                   buffer whose CUDA IPC handle the engine maps (``_sync_gathered``).
``broadcast``      disaggregated: a gloo/NCCL group of trainer rank 0 and every inference
                   worker (``transport.BroadcastGroup``); rank 0 broadcasts each bucket and
                   a MIN all-reduce of the served versions closes the sync.
``auto``           ``shared_memory`` when trainer rank 0 and every inference worker share a
                   host, else ``broadcast``.

Versions: each sync announces ``version = last + 1``. The inference workers wrap their
engine in ``versioned.VersionedEngine``: from the first bucket until every announced tensor
arrived they refuse to generate, and afterwards report the version; the driver checks that
every worker serves exactly the new version (``confirm_versions``) before rollouts resume.
A failure in the middle (an engine died) raises ``WeightSyncError``; the engines keep
refusing to serve until a later sync completes.

``only_changed``: shared memory - each rank compares its pieces with what the segment holds
from the last confirmed sync and skips bitwise-equal ones (frozen layers, LoRA bases); a
tensor is sent when any rank wrote to it; after a failed sync everything is sent again.
Broadcast - trainer rank 0 keeps a CPU copy of what it last sent (one model copy of host
memory). Engines that reload whole layers (vLLM) need every tensor, so leave it off for them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.errors import WorkerCallError
from trainer.weights.buckets import ALIGN, TensorMeta, group_tensors, plan_buckets
from trainer.weights.errors import BucketTooSmallError, TransportError, WeightSyncError
from trainer.weights.shards import ShardLayout, equal_piece, shard_layout, write_piece
from trainer.weights.transport import (
    BroadcastGroup,
    SegmentPool,
    SharedBucket,
    SharedSegment,
    VersionedEngine,
    confirm_versions,
    open_bucket,
    pack_shared,
)

if TYPE_CHECKING:
    import torch

__all__ = ["SenderState", "ShardSender", "SyncReport", "WeightReceiver", "WeightReceiverCluster", "WeightSync",
           "auto_bucket_bytes", "plan_shared_buckets"]

Transport = Literal["auto", "shared_memory", "broadcast"]


# --------------------------------------------------------------------------- trainer side


class SenderState:
    """What a trainer rank keeps between syncs: the last-sent copy (``only_changed``) and the broadcast group."""

    def __init__(self) -> None:
        self.sent: dict[str, torch.Tensor] = {}
        self.group: BroadcastGroup | None = None
        self.group_address: tuple[str, int] | None = None
        self.segment = SharedSegment()

    def _changed(self, group: list[tuple[str, torch.Tensor]], only_changed: bool) -> list[tuple[str, torch.Tensor]]:
        if not only_changed:
            return group
        import torch

        out = []
        for name, tensor in group:
            previous = self.sent.get(name)
            host = tensor.detach().to("cpu")
            if previous is None or previous.shape != host.shape or not torch.equal(previous, host):
                out.append((name, tensor))
                self.sent[name] = host.clone()
        return out

    def shared_buckets(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, is_sender: bool,
                       only_changed: bool = False) -> Iterator[tuple[SharedBucket | None, Any]]:
        """Per bucket: ``(handle, release)`` on the sender; ``(None, None)`` on the other ranks (same count)."""
        for index, group in enumerate(group_tensors(weights, bucket_bytes)):
            if not is_sender:
                yield None, None
                continue
            group = self._changed(group, only_changed)
            if not group:
                yield SharedBucket([], index, 0), None
                continue
            yield pack_shared(group, index=index, segment=self.segment)

    def broadcast(self, weights: Iterable[tuple[str, torch.Tensor]], address: tuple[str, int], world_size: int, *,
                  is_sender: bool, version: int, bucket_bytes: int, only_changed: bool = False,
                  timeout_s: float = 300.0) -> int:
        """Sender: join the group (once per address) and stream the buckets; others only gather. Tensors sent."""
        if not is_sender:
            for _ in weights:  # take part in every gather collective
                pass
            return 0
        if self.group_address != tuple(address):
            self.group = BroadcastGroup(address[0], address[1], 0, world_size, timeout_s=timeout_s)
            self.group_address = tuple(address)

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for group in group_tensors(weights, bucket_bytes):
                yield from self._changed(group, only_changed)

        try:
            return self.group.send_weights(stream(), version=version, bucket_bytes=bucket_bytes)  # type: ignore[union-attr]
        except BaseException:
            self.group, self.group_address = None, None  # a broken group is never reused
            raise


DEFAULT_BUCKET_MB = 256.0
"""The bucket size when ``weight_sync.bucket_mb`` is unset and every tensor fits in it."""


def auto_bucket_bytes(sizes: Iterable[tuple[str, int]]) -> int:
    """``weight_sync.bucket_mb`` unset: 256 MiB, or the largest tensor (aligned) when it is bigger
    (Qwen2.5-0.5B's bf16 embedding is 260 MiB), so a default config never fails at the first sync."""
    largest = max((nbytes for _, nbytes in sizes), default=0)
    return max(int(DEFAULT_BUCKET_MB * 2**20), -(-largest // ALIGN) * ALIGN)


def plan_shared_buckets(layout: ShardLayout, bucket_bytes: int) -> list[SharedBucket]:
    """The buckets of a shard-direct sync: full HF tensors at fixed offsets (no segment names yet).

    Raises ``BucketTooSmallError`` (naming ``weight_sync.bucket_mb`` and the size needed) when
    the largest tensor does not fit, before any segment is written.
    """
    specs = {spec.name: spec for spec in layout.specs}
    tied: dict[str, list[str]] = {}
    for alias, name in layout.aliases.items():
        tied.setdefault(name, []).append(alias)
    handles = []
    for index, names in enumerate(plan_buckets(layout.sizes(), bucket_bytes)):
        metas, offset = [], 0
        for name in names:
            spec = specs[name]
            for each in [name, *tied.get(name, [])]:  # a tied name: same bytes, second meta
                metas.append(TensorMeta(each, spec.dtype, spec.shape, offset, spec.nbytes))
            offset += -(-spec.nbytes // ALIGN) * ALIGN
        handles.append(SharedBucket(metas, index, offset, stable=True))
    return handles


class ShardSender:
    """A trainer rank's half of the shard-direct colocated sync (see the module docstring).

    ``begin`` plans the buckets from the model's tensor specs (every rank computes the same
    plan; rank 0 also creates or reuses the segments and returns the handles); ``write`` copies
    this rank's pieces of one bucket's tensors into its segment - no collective, no gather.
    """

    def __init__(self) -> None:
        self.pool = SegmentPool()
        self.layout: ShardLayout | None = None
        self.only_changed = False
        self.written: set[tuple[str, int, str]] = set()
        """(segment, offset, name) this rank wrote since the segment was created and the engines confirmed."""

    def begin(self, strategy: Any, *, rank: int, bucket_bytes: int, only_changed: bool = False
              ) -> list[SharedBucket] | None:
        """Plan this sync; rank 0 returns the bucket handles (segments created), other ranks None.

        None on rank 0 too when the strategy trains on a GPU: its shards are device memory, and
        the driver then takes the gathered CUDA-IPC path instead.
        """
        if str(getattr(strategy, "device", "cpu")).startswith("cuda"):
            return None  # GPU shards: the gathered CUDA-IPC path (WeightSync._sync_gathered)
        layout = shard_layout(strategy, rank=rank)
        handles = plan_shared_buckets(layout, bucket_bytes)  # too small: raised before anything moves
        self.layout, self.only_changed = layout, only_changed
        if rank != 0:
            return None
        names = self.pool.ensure([handle.nbytes for handle in handles])
        for handle, name in zip(handles, names, strict=True):
            handle.shm_name = name
        return handles

    def write(self, handle: SharedBucket) -> list[str]:
        """Copy this rank's pieces of ``handle``'s tensors into its segment; returns the names written.

        With ``only_changed``, a piece already bitwise equal in the segment (and written there
        by an earlier, confirmed sync) is skipped; a tensor is sent if any rank wrote to it.
        """
        import torch

        if self.layout is None:
            raise WeightSyncError("write_weight_bucket before begin_shard_sync")
        buffer = self.pool.buffer(handle.shm_name)  # type: ignore[arg-type]
        written = []
        with torch.no_grad():
            for meta in handle.metas:
                pieces = self.layout.pieces.get(meta.name)
                if not pieces:
                    continue
                target = buffer[meta.offset:meta.offset + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape)
                key = (handle.shm_name or "", meta.offset, meta.name)
                if self.only_changed and key in self.written and all(equal_piece(target, i, p) for i, p in pieces):
                    continue
                for index, piece in pieces:
                    write_piece(target, index, piece)
                self.written.add(key)
                written.append(meta.name)
        return written

    def reset(self) -> None:
        """Forget what was written (a failed sync: the next one sends every tensor again)."""
        self.written.clear()

    def close(self) -> None:
        self.pool.close()
        self.written.clear()
        self.layout = None


# --------------------------------------------------------------------------- inference side


class WeightReceiver:
    """Mixin for an inference worker holding ``self.engine``: the receiving half of the sync.

    The first sync wraps the engine in a :class:`VersionedEngine`, so from then on a
    half-updated engine refuses to generate and results carry the served weights version.
    """

    def _versioned(self) -> VersionedEngine:
        engine = self.engine  # type: ignore[attr-defined]
        if not isinstance(engine, VersionedEngine):
            engine = VersionedEngine(engine, weights_version=0)
            self.engine = engine  # type: ignore[attr-defined]
        return engine

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def begin_weight_load(self, version: int) -> None:
        """A sync to ``version`` starts: stop serving until it completes."""
        self._versioned().begin(version)
        self._weight_segments_used: set[str] = set()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_weight_bucket(self, handle: SharedBucket) -> None:
        """Hand one shared-memory / CUDA-IPC bucket to the engine.

        A ``stable`` bucket (the trainer's segment pool) is passed as zero-copy views of a
        mapping kept from sync to sync: the engine's own load is the only copy. Otherwise the
        tensors are copied before the handle closes. Returns once the engine has the bucket
        queued (it loads while the trainer writes the next one).
        """
        if handle.stable and handle.shm_name is not None:
            from trainer.weights.buckets import Bucket

            pool = getattr(self, "_weight_segments", None)
            if pool is None:
                pool = self._weight_segments = SegmentPool()
            self._weight_segments_used.add(handle.shm_name)
            bucket = Bucket(pool.buffer(handle.shm_name)[:handle.nbytes], handle.metas, handle.index)
            self._versioned().load_part(bucket.tensors(), copy=False)
            return
        bucket, close = open_bucket(handle)
        try:
            self._versioned().load_part(bucket.tensors())
        finally:
            close()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def finish_weight_load(self, version: int, names: list[str]) -> int | None:
        """Close the sync; returns the served version. Raises ``StaleWeightsError`` if the engine failed."""
        try:
            return self._versioned().finish(version, names)
        finally:
            pool = getattr(self, "_weight_segments", None)
            if pool is not None:  # the engine holds no views now: unmap segments the trainer replaced
                pool.keep_only(getattr(self, "_weight_segments_used", ()))

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def receive_weights(self, address: tuple[str, int], world_size: int, timeout_s: float = 300.0) -> int:
        """Join the broadcast group as rank ``1 + self.rank`` (once per address) and load one whole sync."""
        if getattr(self, "_weight_group_address", None) != tuple(address):
            self._weight_group = BroadcastGroup(address[0], address[1], 1 + self.rank, world_size,  # type: ignore[attr-defined]
                                                timeout_s=timeout_s)
            self._weight_group_address = tuple(address)
        try:
            return self._weight_group.receive_into(self._versioned())
        except BaseException:
            self._weight_group_address = None
            raise

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_weights_file(self, path: str) -> None:
        """Load a ``save_pretrained`` folder's safetensors into the engine (the naive disk path; benchmarks)."""
        from pathlib import Path

        from safetensors.torch import load_file

        weights: dict[str, Any] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(str(file)))
        engine = self._versioned()
        engine.load([_MappingBucket(weights)], version=(engine.weights_version or 0) + 1,
                    expected_names=list(weights))

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def weights_version(self) -> int | None:
        """The version this worker serves (None: half-updated)."""
        engine = self.engine  # type: ignore[attr-defined]
        return engine.weights_version if isinstance(engine, VersionedEngine) else 0


class _MappingBucket:
    """A received set of tensors presented as one bucket (``VersionedEngine.load`` reads ``tensors()``)."""

    def __init__(self, weights: dict[str, Any]) -> None:
        self.weights = weights

    def tensors(self) -> Iterator[tuple[str, Any]]:
        yield from self.weights.items()


class WeightReceiverCluster:
    """Mixin for the inference cluster: typed calls to :class:`WeightReceiver` methods."""

    def begin_weight_load(self, version: int) -> None:
        self._call("begin_weight_load", version)  # type: ignore[attr-defined]

    def load_weight_bucket(self, handle: SharedBucket) -> None:
        self._call("load_weight_bucket", handle)  # type: ignore[attr-defined]

    def finish_weight_load(self, version: int, names: list[str]) -> list[int | None]:
        return self._call("finish_weight_load", version, names)  # type: ignore[attr-defined]

    def receive_weights_async(self, address: tuple[str, int], world_size: int, timeout_s: float = 300.0) -> Any:
        return self._call_async("receive_weights", address, world_size, timeout_s)  # type: ignore[attr-defined]

    def weights_version(self) -> list[int | None]:
        return self._call("weights_version")  # type: ignore[attr-defined]

    def load_weights_file(self, path: str) -> None:
        self._call("load_weights_file", path)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- driver


@dataclass
class SyncReport:
    """What one sync moved."""

    version: int
    transport: str
    tensors: int
    nbytes: int
    buckets: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    """Driver wall seconds per phase (shared memory: ``plan``, ``write`` on the trainer ranks, ``hand_over``
    to the engines, ``finish`` = waiting for the engines' last loads and the version check)."""

    def metrics(self) -> dict[str, float]:
        return {"sync/tensors": float(self.tensors), "sync/megabytes": self.nbytes / 2**20,
                "sync/buckets": float(self.buckets), "sync/gb_per_s": self.nbytes / 1e9 / max(self.seconds, 1e-9)}


class WeightSync:
    """The driver's weight sync from an ``ActorCluster`` into an ``InferCluster`` (see the module docstring)."""

    def __init__(self, actor: Any, infer: Any, engine: Any = None, *, transport: Transport = "auto",
                 bucket_mb: float | None = None, only_changed: bool = False, timeout_s: float = 300.0) -> None:
        if transport not in ("auto", "shared_memory", "broadcast"):
            raise ValueError(f"weight_sync.transport={transport!r}; use 'auto', 'shared_memory' or 'broadcast'")
        if bucket_mb is not None and bucket_mb <= 0:
            raise BucketTooSmallError(f"weight_sync.bucket_mb must be positive, got {bucket_mb}")
        self.actor, self.infer, self.engine = actor, infer, engine
        self.bucket_mb = bucket_mb
        self.bucket_bytes = int((bucket_mb or DEFAULT_BUCKET_MB) * 2**20)
        self.only_changed, self.timeout_s = only_changed, timeout_s
        self.transport = self._resolve(transport)
        self.version = 0
        self._address: tuple[str, int] | None = None
        self._sizes: list[tuple[str, int]] | None = None

    @classmethod
    def from_config(cls, roles: Any, config: Any) -> WeightSync:
        """From a run's ``Roles`` and its ``weight_sync`` config section."""
        return cls(roles.actor, roles.infer, roles.engine, transport=config.transport, bucket_mb=config.bucket_mb,
                   only_changed=config.only_changed)

    def _resolve(self, transport: Transport) -> str:
        if transport != "auto":
            return transport
        if self.actor.backend == "local" and self.infer.backend == "local":
            return "shared_memory"
        hosts = {info["hostname"] for info in self.actor.node_info()[:1] + self.infer.node_info()}
        return "shared_memory" if len(hosts) == 1 else "broadcast"

    def sync(self) -> SyncReport:
        """Move the current trained weights into every engine; returns what moved. Raises ``WeightSyncError``."""
        if self.engine is not None:  # a resumed run restores the engine's version: continue from it
            self.version = max(self.version, int(self.engine.version))
        version = self.version + 1
        started = time.perf_counter()
        self._phases: dict[str, float] = {}
        if self.bucket_mb is None and self._sizes is None:  # automatic: large enough for the largest tensor
            self.check_buckets()
        if self.transport == "shared_memory":
            tensors, nbytes, buckets = self._sync_shared(version)
        else:
            tensors, nbytes, buckets = self._sync_broadcast(version)
        self.version = version
        if self.engine is not None:
            self.engine.version = version  # the driver-side front reports what the workers serve
        return SyncReport(version, self.transport, tensors, nbytes, buckets, time.perf_counter() - started,
                          self._phases)

    def _timed(self, phase: str, started: float) -> float:
        now = time.perf_counter()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - started
        return now

    def _sync_shared(self, version: int) -> tuple[int, int, int]:
        clock = time.perf_counter()
        handles = self._trainer_call(self.actor.begin_shard_sync, self.bucket_bytes, self.only_changed)
        if handles is None:  # the trainer's shards live on GPUs: gathered buckets through CUDA IPC
            return self._sync_gathered(version)
        names: list[str] = []
        nbytes = buckets = 0
        self.infer.begin_weight_load(version)  # only now: a bad plan above left the engines serving
        clock = self._timed("plan", clock)
        try:
            for handle in handles:
                written = self._trainer_call(self.actor.write_weight_bucket, handle)
                clock = self._timed("write", clock)
                if self.only_changed:
                    changed = {(m.offset, m.nbytes) for m in handle.metas if m.name in set().union(*written)}
                    handle = replace(handle, metas=[m for m in handle.metas if (m.offset, m.nbytes) in changed])
                if not handle.metas:
                    continue
                self._load_bucket(handle, version)
                names += [meta.name for meta in handle.metas]
                nbytes += sum({meta.offset: meta.nbytes for meta in handle.metas}.values())  # tied: counted once
                buckets += 1
                clock = self._timed("hand_over", clock)
            try:
                served = self.infer.finish_weight_load(version, names)
            except WorkerCallError as error:
                raise TransportError(f"an inference worker failed to complete weights version {version} ({error}); "
                                     "the engines refuse to generate until a complete sync") from error
            confirm_versions(served, version)
            self._timed("finish", clock)
        except BaseException:
            self.actor.reset_shard_sync()  # only_changed: the next sync sends everything again
            raise
        return len(names), nbytes, buckets

    def _load_bucket(self, handle: SharedBucket, version: int) -> None:
        """Hand one bucket to every inference worker; a failure names the half-finished version."""
        try:
            self.infer.load_weight_bucket(handle)
        except WorkerCallError as error:
            raise TransportError(
                f"an inference worker failed while loading bucket {handle.index} of weights version "
                f"{version} ({error}); the engines refuse to generate until a complete sync - restart the "
                "failed worker or rerun the sync"
            ) from error

    def _sync_gathered(self, version: int) -> tuple[int, int, int]:
        """Shared memory for trainers on GPUs: rank 0 gathers each bucket into one CUDA buffer
        and hands its CUDA IPC handle over (the engine maps it; no host round trip)."""
        names: list[str] = []
        nbytes = buckets = 0
        self.check_buckets()
        self.infer.begin_weight_load(version)
        self.actor.begin_weight_sync(self.bucket_bytes, self.only_changed)
        try:
            while (handle := self._trainer_call(self.actor.next_weight_bucket)) is not None:
                if not handle.metas:
                    continue
                self._load_bucket(handle, version)
                names += [meta.name for meta in handle.metas]
                nbytes += handle.nbytes
                buckets += 1
        finally:
            self.actor.end_weight_sync()
        try:
            served = self.infer.finish_weight_load(version, names)
        except WorkerCallError as error:
            raise TransportError(f"an inference worker failed to complete weights version {version} ({error}); the "
                                 "engines refuse to generate until a complete sync") from error
        confirm_versions(served, version)
        return len(names), nbytes, buckets

    def _trainer_call(self, method: Any, *args: Any) -> Any:
        """A call on every trainer rank; a sync error raised there surfaces as itself."""
        try:
            return method(*args)
        except WorkerCallError as error:
            if isinstance(error.__cause__, WeightSyncError):
                raise error.__cause__ from error
            raise

    def check_buckets(self) -> None:
        """Raise ``BucketTooSmallError`` now if ``bucket_mb`` cannot hold the model's largest tensor.

        Uses the tensor sizes the trainer knows up front, so it runs before any engine is told a
        sync starts: a bad setting leaves every engine serving its current weights.
        """
        if self._sizes is None:
            self._sizes = [tuple(item) for item in self._trainer_call(self.actor.weight_sizes)]
            if self.bucket_mb is None:
                self.bucket_bytes = auto_bucket_bytes(self._sizes)
        plan_buckets(self._sizes, self.bucket_bytes)

    def _sync_broadcast(self, version: int) -> tuple[int, int, int]:
        self.check_buckets()
        if self._address is None:
            self._address = tuple(self.actor.weight_group_address())
        world = 1 + self.infer.world_size
        receivers = self.infer.receive_weights_async(self._address, world, self.timeout_s)
        sender = self.actor.broadcast_weights_async(self._address, world, version=version,
                                                    bucket_bytes=self.bucket_bytes, only_changed=self.only_changed,
                                                    timeout_s=self.timeout_s)
        try:
            tensors = sender.result()
            served = receivers.result()
        except WorkerCallError as error:
            self._address = None  # the group is broken: the next sync builds a fresh one
            if isinstance(error.__cause__, BucketTooSmallError):
                raise error.__cause__ from error
            raise TransportError(
                f"weight broadcast of version {version} failed ({error}); the engines refuse to generate until a "
                "complete sync - rerun the sync, or restart the failed worker"
            ) from error
        confirm_versions(served, version)
        return tensors, 0, 0
