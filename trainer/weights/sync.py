"""The weight sync, driver side: train -> infer, bucketed, versioned, shared memory or broadcast.

After each train step the driver calls :meth:`WeightSync.sync`. This module only
orchestrates: what each trainer rank does is ``trainer.weights.sender`` (``WeightSender``,
inherited by ``ActorWorker``), what each inference worker does is
``trainer.weights.receiver`` (``WeightReceiver``, inherited by ``InferWorker``).

The full HF-named tensors are grouped into buckets of at most ``bucket_mb`` (the grouping
depends only on sizes, so all ranks agree; a bucket smaller than the largest tensor raises
``BucketTooSmallError`` naming ``weight_sync.bucket_mb`` and the size needed *before* any
engine is told a sync starts) and each engine receives full HF tensors, which it re-slices
for its own layout (``engine.update_weights`` runs once per sync, fed bucket by bucket).

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
                   copy in shared memory while the trainer lives (checked against the free
                   space of /dev/shm before any segment is made). A trainer on GPUs takes
                   the gathered path instead: rank 0 gathers each bucket into one CUDA
                   buffer whose CUDA IPC handle the engine maps (``_sync_gathered``).
``broadcast``      disaggregated: a gloo group of trainer rank 0 and every inference
                   worker (``transport.BroadcastGroup``); rank 0 broadcasts each bucket and
                   a MIN all-reduce of the served versions closes the sync. The buckets go
                   through host memory even between GPUs: the group can run NCCL
                   (``device="cuda"``), but the run does not choose it yet (not verified: it
                   needs two GPUs).
``auto``           ``shared_memory`` when every trainer rank and every inference worker
                   share a host, else ``broadcast``.

Versions: the sync owns the run's :class:`~trainer.weights.versioned.PolicyVersion`
(``WeightSync.policy``; pass one in to share it). Each sync announces ``policy.value + 1``.
The inference workers wrap their engine in ``versioned.VersionedEngine``: from the first
bucket until every announced tensor arrived they refuse to generate, and afterwards report
the version; the driver checks that every worker serves exactly the new version
(``confirm_versions``) and only then advances the policy version, before rollouts resume.
A failure in the middle (an engine died) raises ``WeightSyncError`` and leaves the version
where it was; the engines that did not complete it refuse to serve until a later sync does.
``timeout_s`` (``weight_sync.timeout_s``) bounds every wait on a peer: the broadcast's
collectives, an engine taking a bucket or completing its update. Versions only go up: an
engine refuses a version it already served, except the retry of this sync's failed one.

``only_changed``: shared memory - each rank compares its pieces with what the segment holds
from the last confirmed sync and skips bitwise-equal ones (frozen layers, LoRA bases); a
tensor is sent when any rank wrote to it. Broadcast and gathered - trainer rank 0 keeps a CPU
copy of what it last sent (one model copy of host memory). Either way what a sync sent counts
only once every engine confirmed it: after a failed sync everything is sent again. Engines
that reload whole layers (vLLM) need every tensor, so leave it off for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from trainer.errors import WorkerCallError
from trainer.weights.buckets import ALIGN, distinct_nbytes, plan_buckets
from trainer.weights.errors import (
    BucketTooSmallError,
    TransportError,
    VersionReusedError,
    WeightSyncError,
)
from trainer.weights.versioned import PolicyVersion, SharedVersion, confirm_versions

if TYPE_CHECKING:
    from trainer.controller.cluster import CallFuture
    from trainer.weights.transport import SharedBucket
    from trainer.workers.actor import ActorCluster
    from trainer.workers.infer import InferCluster

__all__ = ["DEFAULT_BUCKET_MB", "SyncReport", "Transport", "WeightSync", "auto_bucket_bytes"]

Transport = Literal["auto", "shared_memory", "broadcast"]

_ENGINE_ERROR_GRACE_S = 10.0
"""How long a failed broadcast waits for the engines' own errors (they end right after the
trainer's) before it reports the trainer's."""

DEFAULT_BUCKET_MB = 256.0
"""The bucket size when ``weight_sync.bucket_mb`` is unset and every tensor fits in it."""


def auto_bucket_bytes(sizes: Iterable[tuple[str, int]]) -> int:
    """The bucket size when ``weight_sync.bucket_mb`` is unset: 256 MiB, or the largest tensor
    (aligned) when it is bigger (Qwen2.5-0.5B's bf16 embedding is 260 MiB), so a default config
    never fails at the first sync."""
    largest = max((nbytes for _, nbytes in sizes), default=0)
    return max(int(DEFAULT_BUCKET_MB * 2**20), -(-largest // ALIGN) * ALIGN)


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
    """Driver wall seconds per phase (shared memory: ``plan``, ``write`` on the trainer ranks,
    ``hand_over`` to the engines, ``finish`` = waiting for the engines' last loads and the version
    check)."""

    def metrics(self) -> dict[str, float]:
        """The step's ``sync/*`` metrics: tensors, megabytes and buckets moved, and
        ``sync/gb_per_s``, the rate they moved at (a rate, so not under ``timing/``, whose keys
        are seconds)."""
        return {
            "sync/tensors": float(self.tensors),
            "sync/megabytes": self.nbytes / 2**20,
            "sync/buckets": float(self.buckets),
            "sync/gb_per_s": self.nbytes / 1e9 / max(self.seconds, 1e-9),
        }


@dataclass
class _Moved:
    """What the buckets handed over so far carried (the counts of a ``SyncReport``)."""

    names: list[str] = field(default_factory=list)
    """Every tensor handed over (the engines check that each arrived)."""
    tensors: int = 0
    nbytes: int = 0
    buckets: int = 0


class WeightSync:
    """The driver's weight sync from an ``ActorCluster`` into an ``InferCluster`` (module doc).

    ``policy`` is the run's policy version; the sync creates one when none is given. Hand the
    same object to whatever on the driver reports or compares versions.
    """

    version = SharedVersion()
    """The version every engine serves after the last complete sync (``policy.value``)."""

    def __init__(
        self,
        actor: ActorCluster,
        infer: InferCluster,
        *,
        policy: PolicyVersion | None = None,
        transport: Transport = "auto",
        bucket_mb: float | None = None,
        only_changed: bool = False,
        timeout_s: float = 300.0,
        adapters: bool = False,
    ) -> None:
        if transport not in ("auto", "shared_memory", "broadcast"):
            raise ValueError(
                f"weight_sync.transport={transport!r}; use 'auto', 'shared_memory' or 'broadcast'"
            )
        if bucket_mb is not None and bucket_mb <= 0:
            raise BucketTooSmallError(f"weight_sync.bucket_mb must be positive, got {bucket_mb}")
        self.actor, self.infer = actor, infer
        self.policy = policy if policy is not None else PolicyVersion()
        self.bucket_mb = bucket_mb
        self.bucket_bytes = int((bucket_mb or DEFAULT_BUCKET_MB) * 2**20)
        self.only_changed, self.timeout_s = only_changed, timeout_s
        self.transport = self._resolve(transport)
        self._address: tuple[str, int] | None = None
        self._sizes: list[tuple[str, int]] | None = None
        self._phases: dict[str, float] = {}
        self.adapters = adapters
        """LoRA (``model.lora.sync: adapter``): after one full sync of the base, syncs send only
        the adapters (``_sync_adapter``)."""
        self._base_sent = False
        self._failed_version: int | None = None
        """The version of the last sync, if it failed: the retry announces it again, and an
        engine that completed it before another failed must accept it (``VersionedEngine``)."""

    @classmethod
    def from_config(
        cls, roles: Any, config: Any, *, policy: PolicyVersion | None = None, adapters: bool = False
    ) -> WeightSync:
        """From a run's ``Roles`` and its ``weight_sync`` config section (``adapters``: the
        policy trains LoRA adapters that the engines load beside their base)."""
        return cls(
            roles.actor,
            roles.infer,
            policy=policy,
            transport=config.transport,
            bucket_mb=config.bucket_mb,
            only_changed=config.only_changed,
            timeout_s=config.timeout_s,
            adapters=adapters,
        )

    def _resolve(self, transport: Transport) -> str:
        if transport != "auto":
            return transport
        if self.actor.backend == "local" and self.infer.backend == "local":
            return "shared_memory"
        # every trainer rank: the shard-direct path has each of them map the segments
        hosts = {info["hostname"] for info in self.actor.node_info() + self.infer.node_info()}
        return "shared_memory" if len(hosts) == 1 else "broadcast"

    def sync(self) -> SyncReport:
        """Move the current trained weights into every engine; returns what moved.

        Raises ``WeightSyncError`` when a sync cannot complete (the version stays where it was).
        """
        version = self.policy.value + 1
        started = time.perf_counter()
        self._phases = {}
        try:
            moved, transport = self._move(version)
        except VersionReusedError:
            raise  # refused before any engine changed: retrying it must be refused again
        except BaseException:
            self._failed_version = version
            raise
        self._failed_version = None
        self.policy.advance()  # every engine confirmed ``version``
        return SyncReport(
            version,
            transport,
            moved.tensors,
            moved.nbytes,
            moved.buckets,
            time.perf_counter() - started,
            self._phases,
        )

    def _retry(self, version: int) -> bool:
        """``version`` is the retry of this sync's last, failed, sync (some engines may have
        completed it: they accept it again)."""
        return version == self._failed_version

    def _move(self, version: int) -> tuple[_Moved, str]:
        """Move the weights as ``version`` by this sync's transport; what moved, and how."""
        if self.adapters and self._base_sent:
            return self._sync_adapter(version), "adapter"
        if self.bucket_mb is None and self._sizes is None:
            self.check_buckets()  # automatic: large enough for the largest tensor
        if self.transport == "shared_memory":
            moved = self._sync_shared(version)
        else:
            moved = self._sync_broadcast(version)
        if self.adapters:  # the base went over; the adapters follow in the same version
            adapter = self._sync_adapter(version)
            moved.tensors, moved.nbytes = (
                moved.tensors + adapter.tensors,
                moved.nbytes + adapter.nbytes,
            )
            self._base_sent = True
        return moved, self.transport

    def _sync_adapter(self, version: int) -> _Moved:
        """LoRA: the trainer's adapters to every engine, which keeps its base weights."""
        clock = time.perf_counter()
        adapter = self._call(self.actor.adapter_weights)
        if adapter is None:
            raise WeightSyncError(
                "an adapter sync was asked of a policy without adapters; set model.lora or "
                "build WeightSync with adapters=False"
            )
        clock = self._timed("gather", clock)
        try:
            served = self.infer.load_adapter(version, adapter)
        except WorkerCallError as error:
            raise TransportError(
                f"an inference worker failed to load the adapters of version {version} ({error}); "
                "the engines refuse to generate until a complete sync"
            ) from error
        self._timed("hand_over", clock)
        confirm_versions(served, version)
        return _Moved(
            names=list(adapter.tensors), tensors=len(adapter.tensors), nbytes=adapter.nbytes
        )

    def _timed(self, phase: str, started: float) -> float:
        now = time.perf_counter()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - started
        return now

    def _sync_shared(self, version: int) -> _Moved:
        clock = time.perf_counter()
        handles = self._call(self.actor.begin_shard_sync, self.bucket_bytes, self.only_changed)
        if handles is None:  # the trainer's shards live on GPUs: gathered buckets through CUDA IPC
            return self._sync_gathered(version)
        moved = _Moved()
        # only now: a bad plan above left the engines serving
        self._call(self.infer.begin_weight_load, version, self.timeout_s, self._retry(version))
        clock = self._timed("plan", clock)
        try:
            for handle in handles:
                written = self._call(self.actor.write_weight_bucket, handle)
                clock = self._timed("write", clock)
                if self.only_changed:
                    any_rank = set().union(*written)
                    changed = {(m.offset, m.nbytes) for m in handle.metas if m.name in any_rank}
                    handle = replace(
                        handle, metas=[m for m in handle.metas if (m.offset, m.nbytes) in changed]
                    )
                self._hand_over(handle, version, moved, distinct_nbytes(handle.metas))
                clock = self._timed("hand_over", clock)
            self._finish(version, moved)
            self._timed("finish", clock)
        except BaseException:
            self.actor.reset_weight_sync()  # only_changed: the next sync sends everything again
            raise
        self.actor.confirm_weight_sync()
        return moved

    def _sync_gathered(self, version: int) -> _Moved:
        """Shared memory for trainers on GPUs: rank 0 gathers each bucket into one CUDA buffer
        and hands its CUDA IPC handle over (the engine maps it; no host round trip)."""
        moved = _Moved()
        self.check_buckets()
        # first: a /dev/shm too small is refused while the engines still serve
        self._call(self.actor.begin_weight_sync, self.bucket_bytes, self.only_changed)
        try:
            try:
                self._call(
                    self.infer.begin_weight_load, version, self.timeout_s, self._retry(version)
                )
                while (handle := self._call(self.actor.next_weight_bucket)) is not None:
                    self._hand_over(handle, version, moved, handle.nbytes)
            finally:
                self.actor.end_weight_sync()
            self._finish(version, moved)
        except BaseException:
            self.actor.reset_weight_sync()  # only_changed: the next sync sends everything again
            raise
        self.actor.confirm_weight_sync()
        return moved

    def _hand_over(self, handle: SharedBucket, version: int, moved: _Moved, nbytes: int) -> None:
        """Hand one bucket to every inference worker (an empty one is skipped).

        A worker's failure becomes a ``TransportError`` naming the bucket and the version.
        """
        if not handle.metas:
            return
        try:
            self.infer.load_weight_bucket(handle)
        except WorkerCallError as error:
            raise TransportError(
                f"an inference worker failed while loading bucket {handle.index} of weights "
                f"version {version} ({error}); the engines refuse to generate until a complete "
                "sync - restart the failed worker or rerun the sync"
            ) from error
        moved.names += [meta.name for meta in handle.metas]
        moved.tensors += len(handle.metas)
        moved.nbytes += nbytes
        moved.buckets += 1

    def _finish(self, version: int, moved: _Moved) -> None:
        """Close the sync on every inference worker; check that each serves exactly ``version``."""
        try:
            served = self.infer.finish_weight_load(version, moved.names)
        except WorkerCallError as error:
            raise TransportError(
                f"an inference worker failed to complete weights version {version} ({error}); "
                "the engines refuse to generate until a complete sync"
            ) from error
        confirm_versions(served, version)

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        """A call on every rank of a cluster; a sync error raised there surfaces as itself."""
        try:
            return method(*args)
        except WorkerCallError as error:
            if isinstance(error.__cause__, WeightSyncError):
                raise error.__cause__ from error
            raise

    def check_buckets(self) -> None:
        """Raise ``BucketTooSmallError`` now if ``bucket_mb`` cannot hold the largest tensor.

        Uses the tensor sizes the trainer knows up front, so it runs before any engine is told a
        sync starts: a bad setting leaves every engine serving its current weights.
        """
        if self._sizes is None:
            self._sizes = [
                (str(name), int(nbytes)) for name, nbytes in self._call(self.actor.weight_sizes)
            ]
            if self.bucket_mb is None:
                self.bucket_bytes = auto_bucket_bytes(self._sizes)
        plan_buckets(self._sizes, self.bucket_bytes)

    @staticmethod
    def _engine_error(receivers: CallFuture[list[int]]) -> WorkerCallError | None:
        """An engine's own failure in a broadcast that failed, if one reports it promptly.

        A failing engine drains the stream and acknowledges -1, so by the time the trainer saw
        the failure that engine's call is ending with the error that explains it (a KeyError, a
        shape mismatch), which says more than the trainer's "an engine serves -1".
        """
        try:
            receivers.result(timeout=_ENGINE_ERROR_GRACE_S)
        except WorkerCallError as error:
            return error
        except TimeoutError:
            pass
        return None

    def _sync_broadcast(self, version: int) -> _Moved:
        self.check_buckets()
        address = self._address
        world = 1 + self.infer.world_size
        if address is None:
            host, port = self.actor.open_weight_group(world, self.timeout_s)  # a list via Ray
            address = self._address = (str(host), int(port))
        receivers = self.infer.receive_weights_async(
            address, world, self.timeout_s, version, self._retry(version)
        )
        sender = self.actor.broadcast_weights_async(
            address,
            world,
            version=version,
            bucket_bytes=self.bucket_bytes,
            only_changed=self.only_changed,
            timeout_s=self.timeout_s,
        )
        try:
            sent = sender.result()
            served = receivers.result()
        except WorkerCallError as error:
            self._address = None  # the group is broken: the next sync builds a fresh one
            if isinstance(error.__cause__, BucketTooSmallError):
                raise error.__cause__ from error
            cause = self._engine_error(receivers) or error
            if isinstance(cause.__cause__, VersionReusedError):
                raise cause.__cause__ from cause  # every engine refused before loading
            raise TransportError(
                f"weight broadcast of version {version} failed ({cause}); the engines refuse to "
                "generate until a complete sync - fix the failed worker and rerun the sync"
            ) from cause
        confirm_versions(served, version)
        return _Moved(tensors=sent.tensors, nbytes=sent.nbytes, buckets=sent.buckets)
