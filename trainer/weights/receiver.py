"""The inference side of the weight sync: what every ``actor_infer`` rank does for ``WeightSync``.

:class:`WeightReceiver` is the worker mixin (it needs ``self.engine`` and ``self.rank``; the
``InferWorker`` inherits it) and :class:`WeightReceiverCluster` the cluster's typed calls to
it. They mirror ``trainer.weights.sender`` on the trainer side.

shared memory / CUDA IPC (colocated)
    ``begin_weight_load(version)`` -> per bucket ``load_weight_bucket(handle)`` ->
    ``finish_weight_load(version, names)``. The engine gets ONE ``update_weights`` call per
    sync, fed bucket by bucket (``VersionedEngine.begin/load_part/finish``).
broadcast (disaggregated)
    ``receive_weights``: join the broadcast group as rank ``1 + self.rank`` and load one
    whole sync (``BroadcastGroup.receive_into``).
adapter (LoRA)
    ``load_adapter(version, adapter)``: the engine keeps its base and serves it with the
    adapter's tensors (a few MB, sent with the call itself).

The first sync wraps the engine in a :class:`VersionedEngine`: from then on a half-updated
engine refuses to generate, and results carry the version the driver announced, which is
this worker's copy of the run's policy version (``versioned.PolicyVersion``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trainer.controller.cluster import remote
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.weights.buckets import Bucket
from trainer.weights.transport import BroadcastGroup, SegmentPool, SharedBucket, open_bucket
from trainer.weights.versioned import DEFAULT_TIMEOUT_S, VersionedEngine

if TYPE_CHECKING:
    import torch

    from trainer.strategies.lora import AdapterWeights

__all__ = ["WeightReceiver", "WeightReceiverCluster"]


class WeightReceiver:
    """Mixin for an inference worker: the receiving half of the sync (see the module docstring)."""

    # provided by the worker class this is mixed into (``InferWorker``)
    engine: Any
    """The worker's ``InferenceEngine``; the first sync wraps it in a ``VersionedEngine``."""
    rank: int

    _weight_segments: SegmentPool | None = None
    """The trainer's stable segments, mapped once and kept from sync to sync."""
    _weight_segments_used: frozenset[str] = frozenset()
    """Segments the running sync handed over (the others are unmapped when it finishes)."""
    _weight_group: BroadcastGroup | None = None
    _weight_group_address: tuple[str, int] | None = None

    def _versioned(self) -> VersionedEngine:
        engine = self.engine
        if not isinstance(engine, VersionedEngine):
            engine = VersionedEngine(engine, weights_version=0)
            self.engine = engine
        return engine

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def begin_weight_load(
        self, version: int, timeout_s: float = DEFAULT_TIMEOUT_S, again: bool = False
    ) -> None:
        """A sync to ``version`` starts: stop serving until it completes.

        ``timeout_s`` bounds each later wait on the engine; ``again``: the retry of a failed
        sync, which this engine may have completed (``VersionedEngine.begin``).
        """
        self._versioned().begin(version, timeout_s=timeout_s, again=again)
        self._weight_segments_used = frozenset()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_weight_bucket(self, handle: SharedBucket) -> None:
        """Hand one shared-memory / CUDA-IPC bucket to the engine.

        A ``stable`` bucket (the trainer's segment pool) is passed as zero-copy views of a
        mapping kept from sync to sync: the engine's own load is the only copy. Otherwise the
        tensors are copied before the handle closes. Returns once the engine has the bucket
        queued (it loads while the trainer writes the next one).
        """
        if handle.stable and handle.shm_name is not None:
            if self._weight_segments is None:
                self._weight_segments = SegmentPool()
            self._weight_segments_used |= {handle.shm_name}
            bucket = Bucket(
                self._weight_segments.buffer(handle.shm_name)[: handle.nbytes],
                handle.metas,
                handle.index,
            )
            self._versioned().load_part(bucket.tensors(), copy=False)
            return
        bucket, close = open_bucket(handle)
        try:
            self._versioned().load_part(bucket.tensors())
        finally:
            close()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def finish_weight_load(self, version: int, names: list[str]) -> int | None:
        """Close the sync; returns the served version.

        Raises ``StaleWeightsError`` if the engine failed.
        """
        try:
            return self._versioned().finish(version, names)
        finally:
            # the engine holds no views now: unmap the segments the trainer replaced
            if self._weight_segments is not None:
                self._weight_segments.keep_only(self._weight_segments_used)

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def receive_weights(
        self,
        address: tuple[str, int],
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        version: int | None = None,
        again: bool = False,
    ) -> int:
        """Load one whole sync (announcing ``version``; ``again``: a retry) from the broadcast
        group.

        Joins the group as rank ``1 + self.rank`` once per address (a broken group is rejoined).
        """
        host, port = address  # a list when it came through an RPC
        key = (str(host), int(port))
        group = self._weight_group
        if group is None or self._weight_group_address != key:
            group = BroadcastGroup(key[0], key[1], 1 + self.rank, world_size, timeout_s=timeout_s)
            self._weight_group, self._weight_group_address = group, key
        try:
            return group.receive_into(self._versioned(), version=version, again=again)
        except BaseException:
            self._weight_group_address = None  # a broken group is never reused
            raise

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def load_adapter(self, version: int, adapter: AdapterWeights) -> int:
        """Serve the base with ``adapter`` (LoRA) as ``version``; returns the served version."""
        return self._versioned().load_adapter(adapter, version=version)

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def load_weights_file(self, path: str) -> None:
        """Load a ``save_pretrained`` folder's safetensors into the engine (the naive disk path)."""
        from pathlib import Path

        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(str(file)))
        engine = self._versioned()
        engine.load(
            [_MappingBucket(weights)],
            version=engine.last_served + 1,
            expected_names=list(weights),
        )

    def close_weight_receiver(self) -> None:
        """Unmap the trainer's segments (the worker's ``close``). Their creator unlinks them, but
        a mapping keeps a deleted segment's pages (a host copy of the model) and its file open
        until this process exits: on the local backend, the driver, which may run more runs."""
        if self._weight_segments is not None:
            self._weight_segments.close()
            self._weight_segments = None
        self._weight_segments_used = frozenset()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def weights_version(self) -> int | None:
        """The version this worker serves (0 before its first sync; None: half-updated)."""
        engine = self.engine
        return engine.weights_version if isinstance(engine, VersionedEngine) else 0


class _MappingBucket:
    """Loaded tensors as one ``versioned.TensorSource`` (``VersionedEngine.load`` reads it)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()


class WeightReceiverCluster:
    """Mixin for the inference cluster: typed calls to :class:`WeightReceiver` (all ranks)."""

    begin_weight_load = remote(WeightReceiver.begin_weight_load)
    load_weight_bucket = remote(WeightReceiver.load_weight_bucket)
    finish_weight_load = remote(WeightReceiver.finish_weight_load, per_rank=True)
    receive_weights_async = remote(WeightReceiver.receive_weights, per_rank=True, future=True)
    """Start ``receive_weights`` on all ranks; returns a ``CallFuture`` (the sender runs
    meanwhile)."""
    weights_version = remote(WeightReceiver.weights_version, per_rank=True)
    load_weights_file = remote(WeightReceiver.load_weights_file)
    load_adapter = remote(WeightReceiver.load_adapter, per_rank=True)
