"""A run on the local backend gives its weight-sync shared memory back when its clusters shut
down: a notebook or a sweep running several trainings in one process does not keep one host
copy of the model (and two file descriptors) per run until it exits."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.weights import sync_setup as S
from trainer.weights.segments import PREFIX
from trainer.weights.sync import WeightSync
from trainer.weights.versioned import PolicyVersion


def held_segments() -> set[str]:
    """The weight-sync segments this process still maps or holds open (deleted or not)."""
    gc.collect()
    names = set()
    with open("/proc/self/maps") as maps:
        names |= {line.split()[-2] for line in maps if PREFIX in line and "(deleted)" in line}
        maps.seek(0)
        names |= {line.split()[-1] for line in maps if PREFIX in line and "(deleted)" not in line}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own fd)
            continue
        if PREFIX in target and not target.endswith(".lock"):
            names.add(target.removesuffix(" (deleted)"))
    return {Path(name).name for name in names}


def test_shutting_down_the_clusters_unmaps_the_weight_sync_memory(model_dir: Path) -> None:
    before = held_segments()
    actor, infer = S.make_clusters(model_dir)
    try:
        WeightSync(
            actor, infer, policy=PolicyVersion(), transport="shared_memory", bucket_mb=0.1
        ).sync()
        assert held_segments() - before, "the sync used no shared memory: nothing is tested"
    finally:
        actor.shutdown()
        infer.shutdown()
    assert held_segments() - before == set()


def test_a_closed_segment_pool_is_not_kept_alive_until_exit(model_dir: Path) -> None:
    """Nothing of a finished run's sync stays reachable (its exit handler is dropped on close)."""
    from trainer.weights.transport import SegmentPool

    def pools() -> dict[int, weakref.ref[SegmentPool]]:
        gc.collect()
        return {id(o): weakref.ref(o) for o in gc.get_objects() if type(o) is SegmentPool}

    before = pools()
    actor, infer = S.make_clusters(model_dir)
    try:
        WeightSync(
            actor, infer, policy=PolicyVersion(), transport="shared_memory", bucket_mb=0.1
        ).sync()
        made = {key: ref for key, ref in pools().items() if key not in before}
        assert made, "the sync used no segment pool: nothing is tested"
    finally:
        actor.shutdown()
        infer.shutdown()
    del actor, infer
    gc.collect()
    assert [ref() for ref in made.values() if ref() is not None] == []
