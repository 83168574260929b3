"""Handing weight buckets from the trainer to inference engines, and never serving a half sync.

Two ways a bucket (``buckets.Bucket``: one flat buffer + tensor metadata) travels:

Colocated (trainer and engine on the same host / GPU)
    :func:`share_bucket` turns a bucket into a small picklable :class:`SharedBucket` handle:
    a CUDA IPC handle when the buffer is on a GPU (``torch.multiprocessing.reductions``;
    the receiver maps the sender's memory, no host round trip), or a named POSIX
    shared-memory segment for CPU buffers. The handle goes through any RPC (a Ray call, a
    ``multiprocessing`` queue); :func:`open_bucket` on the other side gives zero-copy views.
    The sender keeps the buffer alive until the receiver acknowledges (``release``).
    :class:`SegmentPool` is the shard-direct variant on CPU: one segment per bucket, kept
    from sync to sync, every trainer rank writing its own shards in; its handles are
    ``stable`` (unchanged until the sync finishes), so receivers pass views without copying.

Disaggregated (engines on other hosts)
    :class:`BroadcastGroup`: a stand-alone process group (its own ``TCPStore``; gloo on CPU,
    NCCL on GPU) of trainer rank 0 (rank 0 here) and every inference worker. Rank 0
    broadcasts each bucket's header then its buffer; receivers unpack and load; a final
    MIN all-reduce of every engine's served version is the acknowledgement, so the trainer
    learns of an engine that died or failed mid-sync (``TransportError``/``StaleWeightsError``).
    It is independent of the trainer's own default group, so engines need not join that.
    Rank 0 listens first, on a port the OS picks (:func:`listen_for_group`), and the others are
    told that port: a port chosen "free" and bound later can be taken in between.

Versioning (``VersionedEngine``, ``confirm_versions``, ``PolicyVersion``) is in
``trainer.weights.versioned``.
"""

from __future__ import annotations

import atexit
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from trainer.weights.buckets import Bucket, TensorMeta, distinct_nbytes, iter_buckets
from trainer.weights.errors import StaleWeightsError, TransportError
from trainer.weights.segments import attach_segment, create_segment

if TYPE_CHECKING:
    import torch

    from trainer.weights.versioned import VersionedEngine

__all__ = [
    "BroadcastGroup",
    "SegmentPool",
    "SentWeights",
    "SharedBucket",
    "SharedSegment",
    "check_shm_space",
    "listen_for_group",
    "open_bucket",
    "pack_shared",
    "share_bucket",
    "shm_free_bytes",
]


# --------------------------------------------------------------------------- colocated


@dataclass
class SharedBucket:
    """A picklable reference to a bucket in shared memory (CPU) or CUDA IPC memory (GPU)."""

    metas: list[TensorMeta]
    index: int
    nbytes: int
    shm_name: str | None = None
    cuda_ipc: tuple[Any, tuple[Any, ...]] | None = None
    """``(rebuild_fn, args)`` from ``torch.multiprocessing.reductions.reduce_tensor``."""
    stable: bool = False
    """The segment stays unchanged until the sync finishes (``SegmentPool``): receivers may hand
    the engine views of it without copying. Otherwise it is reused once the load call returns."""


def shm_free_bytes() -> int | None:
    """Bytes free in ``/dev/shm``, where Linux keeps POSIX shared memory; None without one."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def check_shm_space(nbytes: int, what: str) -> None:
    """Raise ``TransportError`` unless ``/dev/shm`` has room for ``nbytes`` more.

    A shared-memory segment gets its pages only when written; a write past a full ``/dev/shm``
    kills the writer with SIGBUS, no Python error. So every segment is checked before it is
    created: the sync fails with the sizes and the fixes, and nothing is half-created.
    """
    free = shm_free_bytes()
    if free is None or nbytes <= free:
        return
    gib = -(-nbytes // 2**30) + 1  # the need, rounded up, plus room for everything else
    raise TransportError(
        f"/dev/shm has {free:,} bytes ({free / 2**20:.1f} MiB) free but the colocated weight sync "
        f"needs {nbytes:,} bytes ({nbytes / 2**20:.1f} MiB) for {what}; set "
        "weight_sync.transport: broadcast, or give /dev/shm more room (docker run "
        f"--shm-size={gib}g, or a Kubernetes emptyDir with medium: Memory at /dev/shm)"
    )


def share_bucket(bucket: Bucket) -> tuple[SharedBucket, Callable[[], None]]:
    """A handle another process can open, and ``release()`` to call once it acknowledged."""
    if bucket.buffer.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return SharedBucket(
            bucket.metas, bucket.index, bucket.nbytes, cuda_ipc=reduce_tensor(bucket.buffer)
        ), lambda: None

    import torch

    check_shm_space(bucket.nbytes, f"bucket {bucket.index}")
    segment = create_segment(bucket.nbytes)
    torch.frombuffer(segment.buf, dtype=torch.uint8, count=bucket.nbytes).copy_(bucket.buffer)

    def release() -> None:
        segment.close()
        segment.unlink()

    return SharedBucket(bucket.metas, bucket.index, bucket.nbytes, shm_name=segment.name), release


class SharedSegment:
    """A reusable POSIX shared-memory segment a sender packs buckets into (no new pages per bucket).

    Writing into new shared memory costs a page fault per 4 KiB; reusing one segment for every
    bucket of every sync pays that once. One bucket at a time: the caller packs the next bucket
    only after the receiver has loaded (copied) the previous one. ``close()`` unlinks it.
    """

    def __init__(self) -> None:
        import atexit

        self.segment: Any = None
        # unlink at exit (a killed process leaves it to Python's resource tracker)
        atexit.register(self.close)

    def pack(self, named: list[tuple[str, torch.Tensor]], *, index: int = 0) -> SharedBucket:
        """Pack host tensors into the segment (grown when too small); returns the handle to send."""

        import torch

        from trainer.weights.buckets import pack, packed_bytes

        nbytes = packed_bytes(named)
        if self.segment is None or self.segment.size < nbytes:
            held = 0 if self.segment is None else self.segment.size
            check_shm_space(nbytes - held, f"bucket {index} (grown from {held:,} bytes)")
            self.close()
            self.segment = create_segment(nbytes)
        buffer = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=max(nbytes, 1))
        bucket = pack(named, index=index, buffer=buffer)
        handle = SharedBucket(bucket.metas, index, bucket.nbytes, shm_name=self.segment.name)
        del bucket, buffer  # no views may outlive a later close()
        return handle

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None


class SegmentPool:
    """Shared-memory segments of one colocated sync, one per bucket, kept from sync to sync.

    The trainer rank that owns the pool (rank 0) creates them (``ensure``); every trainer rank
    maps them by name (``buffer``) and writes its own shard of each tensor straight in. Kept
    across syncs, a segment's pages are faulted in once, not per sync; and since no segment is
    rewritten before the engine finished the whole update, the engine reads views of it with no
    copy of its own. The price: one copy of the model in host shared memory while the trainer lives.
    ``close()`` unlinks what this process created and unmaps the rest; the interpreter's exit
    closes a pool not closed before, and forgets a closed one (nothing then keeps it alive).
    """

    def __init__(self) -> None:
        self.owned: list[Any] = []
        self.mapped: dict[str, tuple[Any, Any]] = {}  # name -> (SharedMemory, uint8 tensor over it)
        self._closed_at_exit = False

    def _close_at_exit(self) -> None:
        """Have the interpreter's exit close this pool (once it makes or maps a segment)."""
        if not self._closed_at_exit:
            atexit.register(self.close)
            self._closed_at_exit = True

    def ensure(self, sizes: Sequence[int]) -> list[str]:
        """Segment names for buckets of ``sizes`` bytes (existing ones reused when big enough).

        Raises ``TransportError`` before creating any when ``/dev/shm`` lacks room for the new
        ones (``check_shm_space``); a replaced segment's room is not counted, since an engine
        may still map it.
        """

        new = [
            index
            for index, size in enumerate(sizes)
            if index >= len(self.owned) or self.owned[index].size < size
        ]
        check_shm_space(
            sum(max(sizes[index], 1) for index in new),
            f"{len(new)} of its {len(sizes)} buckets (one copy of the model's weights)",
        )
        self._close_at_exit()
        for index in new:
            size = sizes[index]
            segment = create_segment(size)
            if index < len(self.owned):
                old, self.owned[index] = self.owned[index], segment
                self.mapped.pop(old.name, None)
                try:
                    old.close()
                except BufferError:  # a view is still alive: the mapping goes with the process
                    pass
                old.unlink()
            else:
                self.owned.append(segment)
        return [segment.name for segment in self.owned[: len(sizes)]]

    def buffer(self, name: str) -> torch.Tensor:
        """The whole segment ``name`` as a ``uint8`` tensor (mapped once per process)."""
        import torch

        if name not in self.mapped:
            self._close_at_exit()
            own = next((s for s in self.owned if s.name == name), None)
            try:
                segment = own if own is not None else attach_segment(name)
            except FileNotFoundError as error:
                raise TransportError(
                    f"this process cannot see the weight-sync shared-memory segment {name!r}: it "
                    "runs on another host than trainer rank 0, or in a container without that "
                    "/dev/shm (or that trainer rank exited); set weight_sync.transport: "
                    "broadcast, or run trainer and engines on one host with a shared /dev/shm"
                ) from error
            self.mapped[name] = (
                segment,
                torch.frombuffer(segment.buf, dtype=torch.uint8, count=segment.size),
            )
        return self.mapped[name][1]

    def keep_only(self, names: Iterable[str]) -> None:
        """Unmap the segments this process attached that are not in ``names`` (recreated since)."""
        keep = set(names)
        for name in [n for n in self.mapped if n not in keep]:
            self._forget(name)

    def _forget(self, name: str) -> None:
        entry = self.mapped.pop(name, None)
        if entry is None:
            return
        segment, tensor = entry
        del entry, tensor
        if all(segment is not own for own in self.owned):
            try:
                segment.close()
            except (
                BufferError
            ):  # a view is still alive somewhere: the mapping goes with the process
                pass

    def close(self) -> None:
        for name in list(self.mapped):
            self._forget(name)
        for segment in self.owned:
            try:
                segment.close()
            except BufferError:
                pass
            try:
                segment.unlink()
            except FileNotFoundError:
                pass
        self.owned = []
        if self._closed_at_exit:  # a registered close would keep the pool alive until exit
            atexit.unregister(self.close)
            self._closed_at_exit = False


def pack_shared(
    named: list[tuple[str, torch.Tensor]], *, index: int = 0, segment: SharedSegment | None = None
) -> tuple[SharedBucket, Callable[[], None]]:
    """A handle to ``named`` packed into shared memory or CUDA IPC, and ``release``.

    A given ``segment`` is reused for CPU tensors; otherwise a fresh one is created.
    """
    from trainer.weights.buckets import pack

    if named and named[0][1].is_cuda:
        return share_bucket(pack(named, index=index))
    if segment is not None:
        return segment.pack(named, index=index), lambda: None
    own = SharedSegment()
    return own.pack(named, index=index), own.close


def open_bucket(handle: SharedBucket) -> tuple[Bucket, Callable[[], None]]:
    """Zero-copy views of a shared bucket in this process, and ``close()`` to call when loaded."""
    import torch

    if handle.cuda_ipc is not None:
        rebuild, args = handle.cuda_ipc
        try:
            buffer = rebuild(*args)
        except RuntimeError as error:
            raise TransportError(
                f"could not open the CUDA IPC handle of bucket {handle.index} ({error}); both "
                "processes must see the same GPU (same CUDA_VISIBLE_DEVICES device) and the sender "
                "must still be alive"
            ) from error
        return Bucket(buffer, handle.metas, handle.index), lambda: None
    if handle.shm_name is None:
        raise TransportError(
            f"bucket {handle.index}'s handle names neither a CUDA IPC buffer nor a shared-memory "
            "segment; build handles with share_bucket / pack_shared"
        )
    try:
        segment = attach_segment(handle.shm_name)
    except FileNotFoundError as error:
        raise TransportError(
            f"shared-memory segment {handle.shm_name!r} of bucket {handle.index} is gone; the "
            "sender released it before this engine loaded it (release only after the receiver "
            "acknowledges)"
        ) from error
    buffer = torch.frombuffer(segment.buf, dtype=torch.uint8, count=handle.nbytes)

    def close() -> None:
        nonlocal buffer
        del buffer
        segment.close()

    return Bucket(buffer, handle.metas, handle.index), close


# --------------------------------------------------------------------------- disaggregated

_HEADER_BYTES = 1 << 20  # pickled header (names, shapes) of one bucket; 1 MiB holds ~10k tensors


def listen_for_group(host: str, world_size: int, *, timeout_s: float = 300.0) -> Any:
    """Rank 0's rendezvous store of a :class:`BroadcastGroup`, on a port the OS picks.

    Returns the ``torch.distributed.TCPStore`` (already listening; ``store.port`` is the port
    to tell the other members). Pass it as ``BroadcastGroup(..., store=store)`` on rank 0.
    """
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            host,
            0,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as error:
        raise TransportError(
            f"weight broadcast group rank 0 could not listen on {host} ({error}); check that "
            "this host's address is one of its own interfaces"
        ) from error


@dataclass(frozen=True)
class SentWeights:
    """What one broadcast sync sent: tensors (names), their bytes (a tied tensor's once) and
    buckets; what the shared-memory path counts for ``SyncReport``."""

    tensors: int = 0
    nbytes: int = 0
    buckets: int = 0


class BroadcastGroup:
    """Rank 0 (the trainer) broadcasts buckets to ranks 1..N (inference workers); module doc.

    Rank 0 passes the ``store`` :func:`listen_for_group` opened (``port`` is then its port);
    without one, rank 0 binds ``port`` itself, which only a caller that owns the port may do.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        device: str = "cpu",
        timeout_s: float = 300.0,
        store: Any = None,
    ) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world_size, self.device = rank, world_size, device
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            try:
                store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
            except (RuntimeError, OSError) as error:
                raise TransportError(
                    f"weight broadcast group rank {rank}/{world_size} could not reach "
                    f"{host}:{port} ({error}); start every member with the same host/port and "
                    "world size within the timeout"
                ) from error
        self.store: dist.TCPStore | None = store
        # torch's stubs give the backend classes no collectives (``broadcast``, ``allreduce``
        # exist at run time only), so the group is untyped here
        self.group: Any
        if device.startswith("cuda"):
            self.group = dist.ProcessGroupNCCL(
                store, rank, world_size, dist.ProcessGroupNCCL.Options()
            )
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8, device=device)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._collective("weight broadcast", lambda: self.group.broadcast([tensor], options).wait())

    def _collective(self, what: str, run: Callable[[], Any]) -> None:
        """Run one collective of the group; a dead or timed-out member is a ``TransportError``."""
        try:
            run()
        except RuntimeError as error:
            raise TransportError(
                f"{what} failed on rank {self.rank} ({error}); a member of the group died or timed "
                "out - the engines keep refusing to serve until a complete sync succeeds"
            ) from error

    def _send_header(self, header: dict[str, Any]) -> None:
        import torch

        data = pickle.dumps(header)
        if len(data) + 8 > _HEADER_BYTES:
            raise TransportError(
                f"bucket header of {len(data)} bytes exceeds {_HEADER_BYTES}; use smaller buckets"
            )
        payload = torch.frombuffer(
            bytearray(len(data).to_bytes(8, "little") + data), dtype=torch.uint8
        )
        self._header.zero_()
        self._header[: payload.numel()].copy_(payload)
        self._broadcast(self._header)

    def _recv_header(self) -> dict[str, Any]:
        self._broadcast(self._header)
        raw = self._header.cpu().numpy().tobytes()
        size = int.from_bytes(raw[:8], "little")
        return pickle.loads(raw[8 : 8 + size])

    def send_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        bucket_bytes: int,
    ) -> SentWeights:
        """Rank 0: stream ``weights`` as buckets, then an end marker with ``version``."""
        if self.rank != 0:
            raise TransportError(
                f"send_weights on rank {self.rank}; only rank 0 (the trainer) sends"
            )
        names: list[str] = []
        nbytes = buckets = 0
        for bucket in iter_buckets(weights, bucket_bytes, device=self.device):
            self._send_header(
                {"kind": "bucket", "index": bucket.index, "metas": bucket.metas, "version": version}
            )
            self._broadcast(bucket.buffer)
            names.extend(meta.name for meta in bucket.metas)
            nbytes += distinct_nbytes(bucket.metas)
            buckets += 1
        self._send_header({"kind": "end", "version": version, "names": names})
        served = self._min_version(version)
        if served != version:
            raise StaleWeightsError(
                f"after broadcasting weights version {version}, at least one engine serves "
                f"{served} (-1: its load failed); it refuses to generate until a complete sync - "
                "rerun the sync or restart it"
            )
        return SentWeights(len(names), nbytes, buckets)

    def _min_version(self, mine: int) -> int:
        """All members' served versions, reduced by MIN (the acknowledgement closing a sync)."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([mine], dtype=torch.long, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self._collective(
            "weight sync acknowledgement", lambda: self.group.allreduce([value], options).wait()
        )
        return int(value.item())

    def receive(self) -> Iterator[Bucket | dict[str, Any]]:
        """Ranks 1..N: yield each received ``Bucket``, then the end marker (version, names)."""
        import torch

        while True:
            header = self._recv_header()
            if header["kind"] == "end":
                yield header
                return
            metas: list[TensorMeta] = header["metas"]
            nbytes = metas[-1].offset + metas[-1].nbytes if metas else 0
            size = -(-nbytes // 64) * 64
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._broadcast(buffer)
            yield Bucket(buffer, metas, header["index"])

    def receive_into(
        self, engine: VersionedEngine, *, version: int | None = None, again: bool = False
    ) -> int:
        """Ranks 1..N: stream one whole sync into ``engine``, one bucket held at a time.

        Returns the version the engine serves afterwards; ``version``, when the caller knows it,
        is refused up front if the engine served it already (unless ``again``: a retry).

        When the engine fails, this rank still takes part in every remaining broadcast
        (receiving and discarding the buckets) and then acknowledges -1, so the sync fails as
        soon as the stream ends, with the engine's error raised here, instead of the group
        waiting out its timeout.
        """
        end: dict[str, Any] = {}
        stream = self.receive()  # kept here: the engine may drop ``buckets()`` half way

        def buckets() -> Iterator[Bucket]:
            for item in stream:
                if isinstance(item, Bucket):
                    yield item
                else:
                    end.update(item)

        try:
            if version is not None:  # a used version is refused before the engine changes
                engine.check_announced(version, again=again)
            served = engine.load_stream(buckets(), lambda: (end["version"], end["names"]))
        except TransportError:
            raise  # the group itself broke: no collective of it can complete any more
        except Exception:
            for _ in stream:  # drain: stay in step with rank 0 until its end marker
                pass
            self._min_version(-1)  # tell the trainer this engine did not take the version
            raise
        self._min_version(served)
        return served

    def close(self) -> None:
        """Drop the group (and the store, on rank 0)."""
        self.group = None
        self.store = None
