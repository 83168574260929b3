"""Weight transport: shared memory and a gloo broadcast group into a real HFEngine in another
process; after each sync its greedy outputs equal the trainer's; half syncs are never served."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.weights import procs
from trainer.weights.buckets import iter_buckets
from trainer.weights.errors import StaleWeightsError, TransportError
from trainer.weights.transport import BroadcastGroup, listen_for_group, share_bucket
from trainer.weights.versioned import VersionedEngine, confirm_versions


def trainer_weights(seed: int) -> tuple[list[tuple[str, torch.Tensor]], list[list[int]]]:
    engine = procs.make_engine(seed)
    seen: set[int] = set()
    named = []
    for name, tensor in engine.engine.model.state_dict().items():
        if tensor.data_ptr() not in seen:  # tied lm_head sent once, as the sync does
            seen.add(tensor.data_ptr())
            named.append((name, tensor))
    return named, procs.greedy(engine.engine)


def test_shared_memory_and_broadcast_syncs_reproduce_the_trainer_outputs() -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=procs.receiver, args=(inbox, outbox), daemon=True)
    proc.start()
    try:
        first, first_out = trainer_weights(seed=1)
        second, second_out = trainer_weights(seed=2)
        tag, before = outbox.get(timeout=120)
        assert tag == "before" and before != first_out
        # colocated: shared-memory buckets through a queue
        inbox.put((1, [n for n, _ in first]))
        releases = []
        for bucket in iter_buckets(first, 8192):
            handle, release = share_bucket(bucket)
            inbox.put(handle)
            releases.append(release)
        inbox.put(None)
        message = outbox.get(timeout=120)
        assert message[0] == "shm", message
        assert message[1] == 1 and message[2] == first_out
        for release in releases:
            release()
        # disaggregated: a broadcast group between this process (rank 0) and the engine; rank 0
        # listens first on a port the OS picks, and the engine is told that port
        store = listen_for_group("127.0.0.1", 2, timeout_s=30)
        inbox.put(store.port)
        group = BroadcastGroup("127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)
        assert group.send_weights(second, version=2, bucket_bytes=8192).tensors == len(second)
        message = outbox.get(timeout=120)
        assert message[0] == "broadcast", message
        assert message[1] == 2 and message[2] == second_out
        confirm_versions([message[1]], 2)
        # the engine dies after the first bucket: the sender gets a TransportError, not a hang
        store = listen_for_group("127.0.0.1", 2, timeout_s=5)
        inbox.put(store.port)
        group = BroadcastGroup("127.0.0.1", store.port, 0, 2, timeout_s=5, store=store)
        with pytest.raises(TransportError, match="a member of the group died or timed out"):
            group.send_weights(second, version=3, bucket_bytes=8192)
        proc.join(timeout=30)
        assert outbox.empty(), outbox.get()
    finally:
        if proc.is_alive():
            proc.kill()


def test_half_updated_engine_refuses_to_generate_until_a_full_sync() -> None:
    from trainer.strategies.base import GenerationRequest

    engine = procs.make_engine(seed=5)
    named, _ = trainer_weights(seed=6)
    buckets = list(iter_buckets(named, 8192))

    def dies_half_way():
        yield buckets[0]
        raise ConnectionError("trainer went away")

    with pytest.raises(ConnectionError):
        engine.load(dies_half_way(), version=1, expected_names=[n for n, _ in named])
    request = GenerationRequest("r", [1, 2, 3], max_new_tokens=2, temperature=0.0)
    with pytest.raises(StaleWeightsError, match="half-updated"):
        asyncio.run(engine.generate(request))
    with pytest.raises(StaleWeightsError, match=r"delivered \d+ of \d+ tensors"):
        engine.load(buckets[:1], version=1, expected_names=[n for n, _ in named])
    assert engine.load(buckets, version=1, expected_names=[n for n, _ in named]) == 1
    result = asyncio.run(engine.generate(request))
    assert result.policy_version == 1 and len(result.token_ids) == 2
    with pytest.raises(StaleWeightsError, match="engines \\[1\\] serve \\[None\\]"):
        confirm_versions([1, None], 1)


def test_engine_that_ignores_updates_is_caught() -> None:
    class Deaf:
        version = 0

        def update_weights(self, weights):
            for _ in weights:
                pass

    named, _ = trainer_weights(seed=7)
    with pytest.raises(StaleWeightsError, match="Deaf.update_weights did not bump its version"):
        VersionedEngine(Deaf()).load(
            iter_buckets(named, 1 << 20), version=1, expected_names=[n for n, _ in named]
        )


def test_a_segment_this_process_cannot_see_points_to_the_broadcast_transport() -> None:
    """Another host, or a container without the trainer's /dev/shm: rerunning cannot help."""
    from trainer.weights.transport import SegmentPool

    with pytest.raises(TransportError, match=r"weight_sync\.transport: broadcast") as caught:
        SegmentPool().buffer("psm_envhub_test_missing")
    assert "rerun the sync" not in str(caught.value)


def test_auto_picks_broadcast_when_any_trainer_rank_is_on_another_host() -> None:
    """The shard-direct sync needs every trainer rank to map the segments, not rank 0 alone."""
    from trainer.weights.sync import WeightSync

    class Cluster:
        backend = "ray"

        def __init__(self, hosts: list[str]) -> None:
            self.hosts = hosts

        def node_info(self) -> list[dict[str, str]]:
            return [{"hostname": host} for host in self.hosts]

    def resolved(trainer_hosts: list[str]) -> str:
        actor, infer = Cluster(trainer_hosts), Cluster(["a", "a"])
        return WeightSync(actor, infer, transport="auto").transport  # type: ignore[arg-type]

    assert resolved(["a", "a"]) == "shared_memory"
    assert resolved(["a", "b"]) == "broadcast"


OWNER = """
import sys
from multiprocessing import resource_tracker

import torch

from trainer.weights.transport import SharedSegment

# as in a Ray worker killed with the driver: no resource tracker survives to unlink the segment
resource_tracker.register = lambda name, rtype: None
segment = SharedSegment()
print(segment.pack([("w", torch.ones(1000))]).shm_name, flush=True)
sys.stdin.read()  # holds the segment until its stdin closes
"""


def test_segments_a_killed_trainer_left_are_removed_by_the_next_one_and_live_ones_kept() -> None:
    """A trainer rank killed hard (``kill -9`` of a Ray run's driver kills its worker and the
    worker's resource tracker) leaves a model-sized segment in /dev/shm; the next process that
    makes a segment removes it, and never one whose owner is alive."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    shm = Path("/dev/shm")
    owners: list[subprocess.Popen[str]] = []

    def owner() -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        owners.append(proc)
        assert proc.stdout is not None
        return proc, proc.stdout.readline().strip()

    try:
        killed, killed_segment = owner()
        _, live_segment = owner()
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        assert (shm / killed_segment).exists()  # left behind

        _, later_segment = owner()  # a later trainer: its first segment collects what was left
        assert not (shm / killed_segment).exists()
        assert (shm / live_segment).exists()
    finally:
        for proc in owners:
            proc.communicate(timeout=60)
    assert not (shm / live_segment).exists() and not (shm / later_segment).exists()
