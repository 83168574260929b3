"""The trainer's half of the weight sync: what every ``actor_train`` rank does for ``WeightSync``.

:class:`WeightSender` is the worker mixin (it needs ``self.strategy`` and ``self.rank``; the
``ActorWorker`` inherits it) and :class:`WeightSenderCluster` the cluster's typed calls to it.
They mirror ``trainer.weights.receiver`` on the inference side. Three ways a rank sends; the
driver picks one per sync (``trainer.weights.sync`` says when):

shard-direct (shared memory, trainer on CPU)
    ``weight_sizes`` -> ``begin_shard_sync`` -> per bucket ``write_weight_bucket`` ->
    ``confirm_weight_sync`` once every engine took the version (after a failure
    ``reset_weight_sync``). Every rank copies the pieces of full HF tensors it already
    holds (``shards.shard_layout``) straight into shared-memory segments laid out as full
    tensors (:class:`ShardSender`); nothing is gathered.
gathered (shared memory or CUDA IPC, trainer on GPUs)
    ``begin_weight_sync`` -> ``next_weight_bucket`` until it returns None -> ``end_weight_sync``
    -> ``confirm_weight_sync`` (after a failure ``reset_weight_sync``). Each bucket is a
    collective gather; rank 0 packs it into one reusable segment or CUDA buffer and returns its
    handle (:meth:`SenderState.shared_buckets`).
broadcast (disaggregated)
    ``open_weight_group`` (rank 0 listens on a port the OS picks) -> ``broadcast_weights``:
    rank 0 forms a broadcast group with every inference worker and streams the buckets; the
    other ranks only take part in the gathers.

Every path sends floating tensors in the engines' dtype (``engine_dtype``: ``model.dtype``), cast
one tensor at a time from the fp32 master weights the trainer keeps
(``trainer.workers.strategy_worker.master_dtype``); sizes and buckets are planned in it.

``only_changed`` skips a tensor only if the last *confirmed* sync delivered it: what a sync
sends counts once every engine served its version (the driver's ``confirm_weight_sync``, or
the broadcast's closing acknowledgement); a sync that failed, or was never confirmed, is
forgotten, so the next one sends every tensor again.

``close_weight_sync`` unlinks this rank's segments (the cluster calls it before shutdown); what a
killed worker left, the next process to make a segment removes (``trainer.weights.segments``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from trainer.controller.cluster import remote
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import node_address
from trainer.weights.buckets import ALIGN, TensorMeta, group_tensors, in_dtype, plan_buckets
from trainer.weights.errors import WeightSyncError
from trainer.weights.shards import ShardLayout, equal_piece, shard_layout, write_piece
from trainer.weights.transport import (
    BroadcastGroup,
    SegmentPool,
    SentWeights,
    SharedBucket,
    SharedSegment,
    check_shm_space,
    listen_for_group,
    pack_shared,
)

if TYPE_CHECKING:
    import torch

    from trainer.strategies.base import TrainStrategy

__all__ = [
    "SenderState",
    "ShardSender",
    "WeightSender",
    "WeightSenderCluster",
    "plan_shared_buckets",
]


class SenderState:
    """What a trainer rank keeps between syncs: the last-sent copy and the broadcast group.

    The copy lets ``only_changed`` syncs skip tensors that are bitwise what was sent before;
    it is trusted only once the sync that recorded it was confirmed (module docstring).
    """

    def __init__(self) -> None:
        self.sent: dict[str, torch.Tensor] = {}
        self.confirmed = True
        """Every engine took what ``sent`` records (False from a sync's start to its confirm)."""
        self.group: BroadcastGroup | None = None
        self.group_address: tuple[str, int] | None = None
        self.listening: tuple[tuple[str, int], Any] | None = None
        """The address and store :meth:`listen` opened for the next group."""
        self.segment = SharedSegment()

    def check_room(self, model: Any, bucket_bytes: int) -> None:
        """Raise ``TransportError`` unless /dev/shm can take the largest bucket of ``model``'s
        host weights (at most the whole model) beyond the segment already held."""
        tensors = list(model.state_dict().values()) if hasattr(model, "state_dict") else []
        if not tensors or tensors[0].device.type != "cpu":
            return  # CUDA IPC: no shared memory
        whole = sum(t.numel() * t.element_size() for t in tensors)
        held = 0 if self.segment.segment is None else self.segment.segment.size
        check_shm_space(min(bucket_bytes, whole) - held, "the largest weight bucket")

    def begin(self, only_changed: bool) -> None:
        """A sync starts: what an unconfirmed (failed) earlier sync recorded is forgotten."""
        if not only_changed or not self.confirmed:
            self.sent.clear()
        self.confirmed = False

    def confirm(self) -> None:
        """Every engine serves the sync's version: the next ``only_changed`` sync may skip
        what it sent."""
        self.confirmed = True

    def forget(self) -> None:
        """A sync failed: the next one sends every tensor again."""
        self.sent.clear()
        self.confirmed = True

    def _changed(
        self, group: list[tuple[str, torch.Tensor]], only_changed: bool
    ) -> list[tuple[str, torch.Tensor]]:
        if not only_changed:
            return group
        import torch

        out = []
        decided: dict[int, bool] = {}  # id(tensor) -> changed: a tied name goes with its first
        for name, tensor in group:
            changed = decided.get(id(tensor))
            if changed is None:
                previous = self.sent.get(name)
                host = tensor.detach().to("cpu")
                changed = (
                    previous is None
                    or previous.shape != host.shape
                    or not torch.equal(previous, host)
                )
                if changed:
                    self.sent[name] = host.clone()
                decided[id(tensor)] = changed
            if changed:
                out.append((name, tensor))
        return out

    def shared_buckets(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        *,
        is_sender: bool,
        only_changed: bool = False,
    ) -> Iterator[tuple[SharedBucket | None, Any]]:
        """Per bucket: ``(handle, release)`` on the sender, ``(None, None)`` on the other ranks.

        Every rank yields as many items (each bucket is a gather all ranks take part in).
        """
        for index, group in enumerate(group_tensors(weights, bucket_bytes)):
            if not is_sender:
                yield None, None
                continue
            group = self._changed(group, only_changed)
            if not group:
                yield SharedBucket([], index, 0), None
                continue
            yield pack_shared(group, index=index, segment=self.segment)

    def listen(self, host: str, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Open the next broadcast group's store (rank 0) on a port the OS picks."""
        store = listen_for_group(host, world_size, timeout_s=timeout_s)
        address = (host, int(store.port))
        self.listening = (address, store)
        return address

    def broadcast(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        address: tuple[str, int],
        world_size: int,
        *,
        is_sender: bool,
        version: int,
        bucket_bytes: int,
        only_changed: bool = False,
        timeout_s: float = 300.0,
    ) -> SentWeights:
        """Sender: join the group (once per address) and stream the buckets; others only gather.

        Returns what was sent (nothing on the other ranks). ``send_weights`` returns only
        after every engine acknowledged the version, so what it sent is confirmed then.
        """
        if not is_sender:
            for _ in weights:  # take part in every gather collective
                pass
            return SentWeights()
        host, port = address  # a list when it came through an RPC
        key = (str(host), int(port))
        group = self.group
        if group is None or self.group_address != key:
            listening, self.listening = self.listening, None
            store = listening[1] if listening is not None and listening[0] == key else None
            group = BroadcastGroup(key[0], key[1], 0, world_size, timeout_s=timeout_s, store=store)
            self.group, self.group_address = group, key

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for group in group_tensors(weights, bucket_bytes):
                yield from self._changed(group, only_changed)

        self.begin(only_changed)
        try:
            sent = group.send_weights(stream(), version=version, bucket_bytes=bucket_bytes)
        except BaseException:
            self.group, self.group_address = None, None  # a broken group is never reused
            self.forget()
            raise
        self.confirm()
        return sent


def plan_shared_buckets(layout: ShardLayout, bucket_bytes: int) -> list[SharedBucket]:
    """The buckets of a shard-direct sync: full HF tensors at fixed offsets (no segment names yet).

    Every rank computes the same plan from sizes alone. Raises ``BucketTooSmallError`` (naming
    ``weight_sync.bucket_mb`` and the size needed) when the largest tensor does not fit, before
    any segment is written.
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
        """``(segment, offset, name)`` this rank wrote since the segment was created; trusted
        only while ``confirmed``."""
        self.confirmed = True
        """Every engine took the last sync's writes (False from ``begin`` to ``confirm``)."""

    def begin(
        self,
        strategy: Any,
        *,
        rank: int,
        bucket_bytes: int,
        only_changed: bool = False,
        dtype: str | None = None,
    ) -> list[SharedBucket] | None:
        """Plan this sync; rank 0 returns the bucket handles (segments created), other ranks None.

        ``dtype``: the engines' (the full tensors are laid out in it; pieces are cast as they are
        written). None on rank 0 too when the strategy trains on a GPU: its shards are device
        memory, and the driver then takes the gathered CUDA-IPC path instead.
        """
        if str(getattr(strategy, "device", "cpu")).startswith("cuda"):
            return None  # GPU shards: the gathered CUDA-IPC path (WeightSync._sync_gathered)
        layout = shard_layout(strategy, rank=rank, dtype=dtype)
        handles = plan_shared_buckets(layout, bucket_bytes)  # too small: raised before any move
        if not self.confirmed:  # the last sync failed or was never confirmed: resend everything
            self.written.clear()
        self.layout, self.only_changed, self.confirmed = layout, only_changed, False
        if rank != 0:
            return None
        names = self.pool.ensure([handle.nbytes for handle in handles])
        for handle, name in zip(handles, names, strict=True):
            handle.shm_name = name
        return handles

    def write(self, handle: SharedBucket) -> list[str]:
        """Copy this rank's pieces of ``handle``'s tensors into its segment; returns the names.

        With ``only_changed``, a piece already bitwise equal in the segment (and written there
        by an earlier, confirmed sync) is skipped; a tensor is sent if any rank wrote to it.
        """
        import torch

        if self.layout is None:
            raise WeightSyncError(
                "write_weight_bucket before begin_shard_sync; the driver must plan the sync first"
            )
        if handle.shm_name is None:
            raise WeightSyncError(
                f"write_weight_bucket got bucket {handle.index} without a segment name; pass the "
                "handles begin_shard_sync returned on rank 0"
            )
        buffer = self.pool.buffer(handle.shm_name)
        written = []
        with torch.no_grad():
            for meta in handle.metas:
                pieces = self.layout.pieces.get(meta.name)
                if not pieces:
                    continue
                target = (
                    buffer[meta.offset : meta.offset + meta.nbytes]
                    .view(getattr(torch, meta.dtype))
                    .view(meta.shape)
                )
                key = (handle.shm_name, meta.offset, meta.name)
                if (
                    self.only_changed
                    and key in self.written
                    and all(equal_piece(target, i, p) for i, p in pieces)
                ):
                    continue
                for index, piece in pieces:
                    write_piece(target, index, piece)
                self.written.add(key)
                written.append(meta.name)
        return written

    def confirm(self) -> None:
        """Every engine serves the sync's version: its writes may be skipped when unchanged."""
        self.confirmed = True

    def reset(self) -> None:
        """Forget what was written (a failed sync: the next one sends every tensor again)."""
        self.written.clear()
        self.confirmed = True

    def close(self) -> None:
        self.pool.close()
        self.written.clear()
        self.layout = None


class WeightSender:
    """Mixin for a trainer worker: the sending half of the sync (see the module docstring).

    Gathering full weights is a collective on sharded strategies, so every method runs on every
    rank; only rank 0 hands anything over.
    """

    # provided by the worker class this is mixed into (``ActorWorker``)
    strategy: TrainStrategy
    rank: int
    engine_dtype: str | None = None
    """The engines' dtype (``model.dtype``): floating tensors are sent in it, whatever the
    strategy trains in (fp32 master weights); None sends them as they are."""

    _weight_stream: Iterator[tuple[SharedBucket | None, Any]] | None = None
    """The gathered path's bucket stream between ``begin_weight_sync`` and ``end_weight_sync``."""
    _weight_release: Callable[[], None] | None = None
    """Frees the bucket last handed out (called when the driver asks for the next one)."""
    _sender_state: SenderState | None = None
    _shard_sender: ShardSender | None = None

    def _full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.strategy.full_weights()

    def _engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``_full_weights`` as the engines hold them (``engine_dtype``)."""
        return in_dtype(self._full_weights(), self.engine_dtype)

    def _state(self) -> SenderState:
        if self._sender_state is None:
            self._sender_state = SenderState()
        return self._sender_state

    def _shards(self) -> ShardSender:
        if self._shard_sender is None:
            self._shard_sender = ShardSender()
        return self._shard_sender

    def _release_bucket(self) -> None:
        if self._weight_release is not None:
            self._weight_release()
            self._weight_release = None

    # -- gathered: a collective gather per bucket, rank 0 hands out one handle at a time
    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def begin_weight_sync(self, bucket_bytes: int, only_changed: bool = False) -> None:
        """Start streaming full weights in buckets of at most ``bucket_bytes``.

        Rank 0 with host weights first checks that /dev/shm has room for a bucket, so the
        driver can call this before the engines stop serving (``TransportError`` if not).
        """
        self.end_weight_sync()
        if self.rank == 0:
            self._state().check_room(getattr(self.strategy, "model", None), bucket_bytes)
        self._state().begin(only_changed)
        self._weight_stream = self._state().shared_buckets(
            self._engine_weights(),
            bucket_bytes,
            is_sender=self.rank == 0,
            only_changed=only_changed,
        )

    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def next_weight_bucket(self) -> SharedBucket | None:
        """Collective: free the last bucket, gather the next; rank 0 returns its handle.

        None once the stream is done (and always on the other ranks).
        """
        self._release_bucket()
        if self._weight_stream is None:
            return None
        item = next(self._weight_stream, None)
        if item is None:
            self._weight_stream = None
            return None
        handle, self._weight_release = item
        return handle

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def end_weight_sync(self) -> None:
        """Free the last shared bucket and drop an unfinished stream (safe to call twice)."""
        self._release_bucket()
        self._weight_stream = None

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def close_weight_sync(self) -> None:
        """Unlink this rank's shared-memory segments (a killed Ray worker would leak them)."""
        self.end_weight_sync()
        if self._sender_state is not None:
            self._sender_state.segment.close()
        if self._shard_sender is not None:
            self._shard_sender.close()

    # -- shard-direct: each rank writes its own shards into shared memory, no gather
    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def weight_sizes(self) -> list[tuple[str, int]]:
        """``(HF name, bytes)`` of every full tensor, known without a gather.

        The driver checks the bucket size against them before any sync starts.
        """
        layout = shard_layout(self.strategy, rank=self.rank, gather=False, dtype=self.engine_dtype)
        return layout.sizes()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def begin_shard_sync(
        self, bucket_bytes: int, only_changed: bool = False
    ) -> list[SharedBucket] | None:
        """Plan the buckets; rank 0 returns the handles.

        Raises ``BucketTooSmallError`` before anything moves.
        """
        return self._shards().begin(
            self.strategy,
            rank=self.rank,
            bucket_bytes=bucket_bytes,
            only_changed=only_changed,
            dtype=self.engine_dtype,
        )

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def write_weight_bucket(self, handle: SharedBucket) -> list[str]:
        """Copy this rank's shards of one bucket's tensors into its segment; returns the names."""
        return self._shards().write(handle)

    # -- both shared-memory paths: the driver's verdict on the sync
    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def confirm_weight_sync(self) -> None:
        """Every engine serves the sync's version: ``only_changed`` may skip what it sent."""
        if self._shard_sender is not None:
            self._shard_sender.confirm()
        if self._sender_state is not None:
            self._sender_state.confirm()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def reset_weight_sync(self) -> None:
        """A sync failed: forget what was sent (the next ``only_changed`` sync sends all)."""
        if self._shard_sender is not None:
            self._shard_sender.reset()
        if self._sender_state is not None:
            self._sender_state.forget()

    # -- broadcast: rank 0 streams to every inference worker
    @register(Dispatch.RANK_ZERO)
    def open_weight_group(self, world_size: int, timeout_s: float = 300.0) -> tuple[str, int]:
        """Rank 0 listens for the next weight broadcast group; returns its host and port."""
        return self._state().listen(node_address(), world_size, timeout_s)

    @register(Dispatch.ONE_TO_ALL, collect=Collect.FIRST)
    def broadcast_weights(
        self,
        address: tuple[str, int],
        world_size: int,
        *,
        version: int,
        bucket_bytes: int,
        only_changed: bool = False,
        timeout_s: float = 300.0,
    ) -> SentWeights:
        """Collective: rank 0 joins the weight broadcast group as its rank 0 and streams."""
        return self._state().broadcast(
            self._engine_weights(),
            address,
            world_size,
            is_sender=self.rank == 0,
            version=version,
            bucket_bytes=bucket_bytes,
            only_changed=only_changed,
            timeout_s=timeout_s,
        )


class WeightSenderCluster:
    """Mixin for the trainer cluster: typed calls to :class:`WeightSender` (all ranks at once)."""

    begin_weight_sync = remote(WeightSender.begin_weight_sync)
    next_weight_bucket = remote(WeightSender.next_weight_bucket)
    end_weight_sync = remote(WeightSender.end_weight_sync)
    close_weight_sync = remote(WeightSender.close_weight_sync)
    weight_sizes = remote(WeightSender.weight_sizes)
    begin_shard_sync = remote(WeightSender.begin_shard_sync)
    write_weight_bucket = remote(WeightSender.write_weight_bucket, per_rank=True)
    confirm_weight_sync = remote(WeightSender.confirm_weight_sync)
    reset_weight_sync = remote(WeightSender.reset_weight_sync)
    open_weight_group = remote(WeightSender.open_weight_group)
    """Trainer rank 0 listens for the weight broadcast group; its host and port."""
    broadcast_weights_async = remote(WeightSender.broadcast_weights, future=True)
    """Start ``broadcast_weights`` on all ranks; returns a ``CallFuture`` (the receivers run
    meanwhile)."""
