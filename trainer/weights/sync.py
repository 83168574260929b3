"""The train -> infer weight sync: bucketed, versioned, through shared memory or a broadcast group.

After each train step the driver calls :meth:`WeightSync.sync`. Every ``actor_train`` rank
walks its strategy's ``full_weights()`` (FSDP2 all-gathers each parameter, Megatron gathers
each layer over TP and converts it to HF names) in lockstep; tensors are grouped into
buckets of at most ``bucket_mb`` (the grouping depends only on sizes, so all ranks agree)
and trainer rank 0 hands each bucket to every inference worker, whose engine re-slices the
full HF tensors for its own layout (``engine.update_weights`` is called once per bucket).

Transports (``weight_sync.transport``)

``shared_memory``  colocated: rank 0 packs a bucket into a POSIX shared-memory segment (a
                   CUDA IPC handle on GPU), the driver passes the small handle to the
                   inference workers, which load zero-copy views; the segment is freed when
                   the next bucket is requested. One bucket in flight: memory is bounded.
``broadcast``      disaggregated: a gloo/NCCL group of trainer rank 0 and every inference
                   worker (``transport.BroadcastGroup``); rank 0 broadcasts each bucket and
                   a MIN all-reduce of the served versions closes the sync.
``auto``           ``shared_memory`` when trainer rank 0 and every inference worker share a
                   host, else ``broadcast``.

Versions: each sync announces ``version = last + 1``. The inference workers wrap their
engine in ``transport.VersionedEngine``: from the first bucket until every announced tensor
arrived they refuse to generate, and afterwards report the version; the driver checks that
every worker serves exactly the new version (``confirm_versions``) before rollouts resume.
A failure in the middle (an engine died, a bucket too small) raises ``WeightSyncError``;
the engines keep refusing to serve until a later sync completes.

``only_changed``: trainer rank 0 keeps a CPU copy of what it last sent and skips tensors
that are bitwise equal (frozen layers, LoRA bases); costs one model copy of host memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.errors import WorkerCallError
from trainer.weights.buckets import group_tensors
from trainer.weights.errors import BucketTooSmallError, TransportError, WeightSyncError
from trainer.weights.transport import (
    BroadcastGroup,
    SharedBucket,
    SharedSegment,
    VersionedEngine,
    confirm_versions,
    open_bucket,
    pack_shared,
)

if TYPE_CHECKING:
    import torch

__all__ = ["SenderState", "SyncReport", "WeightReceiver", "WeightReceiverCluster", "WeightSync"]

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

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_weight_bucket(self, handle: SharedBucket) -> None:
        """Load one shared-memory / CUDA-IPC bucket into the engine (copied before the handle closes)."""
        bucket, close = open_bucket(handle)
        try:
            self._versioned().load_part(bucket.tensors())
        finally:
            close()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def finish_weight_load(self, version: int, names: list[str]) -> int | None:
        """Close the sync; returns the served version. Raises ``StaleWeightsError`` if the engine failed."""
        return self._versioned().finish(version, names)

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

    def metrics(self) -> dict[str, float]:
        return {"sync/tensors": float(self.tensors), "sync/megabytes": self.nbytes / 2**20,
                "sync/buckets": float(self.buckets), "sync/gb_per_s": self.nbytes / 1e9 / max(self.seconds, 1e-9)}


class WeightSync:
    """The driver's weight sync from an ``ActorCluster`` into an ``InferCluster`` (see the module docstring)."""

    def __init__(self, actor: Any, infer: Any, engine: Any = None, *, transport: Transport = "auto",
                 bucket_mb: float = 256.0, only_changed: bool = False, timeout_s: float = 300.0) -> None:
        if transport not in ("auto", "shared_memory", "broadcast"):
            raise ValueError(f"weight_sync.transport={transport!r}; use 'auto', 'shared_memory' or 'broadcast'")
        if bucket_mb <= 0:
            raise BucketTooSmallError(f"weight_sync.bucket_mb must be positive, got {bucket_mb}")
        self.actor, self.infer, self.engine = actor, infer, engine
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.only_changed, self.timeout_s = only_changed, timeout_s
        self.transport = self._resolve(transport)
        self.version = 0
        self._address: tuple[str, int] | None = None

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
        if self.transport == "shared_memory":
            tensors, nbytes, buckets = self._sync_shared(version)
        else:
            tensors, nbytes, buckets = self._sync_broadcast(version)
        self.version = version
        if self.engine is not None:
            self.engine.version = version  # the driver-side front reports what the workers serve
        return SyncReport(version, self.transport, tensors, nbytes, buckets, time.perf_counter() - started)

    def _sync_shared(self, version: int) -> tuple[int, int, int]:
        names: list[str] = []
        nbytes = buckets = 0
        self.infer.begin_weight_load(version)
        self.actor.begin_weight_sync(self.bucket_bytes, self.only_changed)
        try:
            while (handle := self._next_bucket()) is not None:
                if not handle.metas:
                    continue
                try:
                    self.infer.load_weight_bucket(handle)
                except WorkerCallError as error:
                    raise TransportError(
                        f"an inference worker failed while loading bucket {handle.index} of weights version "
                        f"{version} ({error}); the engines refuse to generate until a complete sync - restart the "
                        "failed worker or rerun the sync"
                    ) from error
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

    def _next_bucket(self) -> SharedBucket | None:
        """The actor's next bucket; a sync error raised on a trainer rank surfaces as itself."""
        try:
            return self.actor.next_weight_bucket()
        except WorkerCallError as error:
            if isinstance(error.__cause__, WeightSyncError):
                raise error.__cause__ from error
            raise

    def _sync_broadcast(self, version: int) -> tuple[int, int, int]:
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
