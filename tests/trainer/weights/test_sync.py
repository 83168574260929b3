"""``WeightSync`` between in-process clusters: bucketed shared-memory and broadcast syncs reproduce
the trainer's greedy outputs, only-changed skips frozen tensors; failures are loud, never stale."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.weights import sync_setup as S
from trainer.weights.errors import BucketTooSmallError, StaleWeightsError, TransportError
from trainer.weights.sync import WeightSync


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_sync_makes_every_engine_generate_what_the_trainer_would(
    clusters, model_dir: Path, transport: str
) -> None:
    actor, infer, policy = clusters
    S.train_away(actor, model_dir)
    weights = actor.get_weights()
    expected = S.trainer_greedy(weights, model_dir)
    # the engines still hold the old weights
    assert [r.token_ids for r in S.engine_greedy(infer)] != expected

    # ~100 KiB: several buckets
    sync = WeightSync(actor, infer, policy=policy, transport=transport, bucket_mb=0.1)
    report = sync.sync()
    results = S.engine_greedy(infer)
    assert [r.token_ids for r in results] == expected
    assert {r.policy_version for r in results} == {
        1
    } and policy.value == sync.version == report.version == 1
    assert infer.weights_version() == [1, 1]
    if transport == "shared_memory":
        assert report.buckets > 1 and report.tensors == len(weights)
    for got, want in zip(S.trainer_logprobs(actor, results), (r.logprobs for r in results)):
        assert got == pytest.approx(want, abs=1e-4)


def test_both_transports_report_the_same_tensors_bytes_and_buckets(clusters) -> None:
    """``sync/megabytes`` and ``sync/buckets`` read 0 for every broadcast sync."""
    actor, infer, policy = clusters
    reports = [
        WeightSync(actor, infer, policy=policy, transport=transport, bucket_mb=0.1).sync()
        for transport in ("shared_memory", "broadcast")
    ]
    moved = [(r.tensors, r.nbytes, r.buckets) for r in reports]
    assert moved[0] == moved[1] and moved[0][1] > 0 and moved[0][2] > 1
    assert all(r.metrics()["sync/gb_per_s"] > 0 for r in reports)


def test_only_changed_sends_nothing_when_nothing_trained(clusters, model_dir: Path) -> None:
    actor, infer, policy = clusters
    sync = WeightSync(
        actor, infer, policy=policy, transport="shared_memory", bucket_mb=0.1, only_changed=True
    )
    first = sync.sync()
    assert first.tensors > 0
    again = sync.sync()
    assert again.tensors == 0 and again.version == 2 and infer.weights_version() == [2, 2]
    S.train_away(actor, model_dir)
    third = sync.sync()
    assert 0 < third.tensors and [r.token_ids for r in S.engine_greedy(infer)] == S.trainer_greedy(
        actor.get_weights(), model_dir
    )


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_a_bucket_smaller_than_the_largest_tensor_fails_before_anything_moves(
    clusters, transport: str
) -> None:
    actor, infer, policy = clusters
    before = [r.token_ids for r in S.engine_greedy(infer)]
    largest = max(t.numel() * t.element_size() for t in actor.get_weights().values())
    with pytest.raises(BucketTooSmallError, match=r"weight_sync\.bucket_mb=\d+") as caught:
        WeightSync(actor, infer, policy=policy, transport=transport, bucket_mb=0.001).sync()
    assert f"{largest:,} bytes" in str(caught.value)  # names the size the largest tensor needs
    # no engine was told a sync started: each still serves its weights, unchanged
    assert infer.weights_version() == [0, 0]
    assert [r.token_ids for r in S.engine_greedy(infer)] == before
    WeightSync(
        actor, infer, policy=policy, transport=transport, bucket_mb=1
    ).sync()  # the fixed setting works
    assert infer.weights_version() == [1, 1]


def test_an_engine_that_dies_during_the_sync_is_reported_and_refuses_to_serve(
    clusters, model_dir: Path
) -> None:
    actor, infer, policy = clusters
    worker = infer._workers[1]
    worker.engine.update_weights = S.dying_at(worker.engine.update_weights, 12)
    with pytest.raises(TransportError, match="engine process died"):
        WeightSync(actor, infer, policy=policy, transport="shared_memory", bucket_mb=0.1).sync()
    with pytest.raises(StaleWeightsError, match="half-updated"):
        worker.engine.check()
    assert infer.weights_version()[1] is None
    assert policy.value == 0  # a failed sync does not advance the run's version


@pytest.mark.parametrize(
    ("transport", "lora"),
    [("shared_memory", None), ("broadcast", None), ("shared_memory", "merged")],
    ids=["shared_memory", "broadcast", "lora_merged_gathered"],
)
def test_after_a_failed_only_changed_sync_the_next_one_resends_every_tensor(
    model_dir: Path, transport: str, lora: str | None
) -> None:
    """A retry after a failed sync must not trust what the failed one "sent": every engine ends
    up holding exactly the trainer's weights (LoRA ``sync: merged`` takes the gathered path)."""
    from trainer.config import LoraConfig

    extra = {"lora": LoraConfig(rank=4, sync=lora)} if lora else {}
    actor, infer = S.make_clusters(model_dir, **extra)
    try:
        sync = WeightSync(
            actor, infer, transport=transport, bucket_mb=0.1, only_changed=True, timeout_s=30
        )
        sync.sync()
        S.train_away(actor, model_dir)
        inner = infer._workers[1].engine.engine  # the engine inside the worker's VersionedEngine
        inner.update_weights = S.dying_at(inner.update_weights, 3)
        with pytest.raises(TransportError):
            sync.sync()  # engine 1 took only its first tensors
        del inner.update_weights  # the real method again
        healed = sync.sync()
        trainer = S.trainer_engine_weights(actor)
        assert healed.tensors == len(trainer)  # everything again
        assert [S.differing(trainer, infer, rank) for rank in (0, 1)] == [[], []]
    finally:
        actor.shutdown()
        infer.shutdown()


def test_a_restored_policy_version_is_where_the_next_sync_continues(clusters) -> None:
    """A resumed run restores the version once; the sync announces the next and each engine
    serves it."""
    actor, infer, policy = clusters
    policy.restore(7)
    report = WeightSync(
        actor, infer, policy=policy, transport="shared_memory", bucket_mb=0.1
    ).sync()
    assert report.version == policy.value == 8 and infer.weights_version() == [8, 8]
    assert {r.policy_version for r in S.engine_greedy(infer)} == {8}


def test_an_engine_failing_mid_broadcast_fails_the_sync_with_its_own_error(
    clusters, model_dir: Path
) -> None:
    """The failing engine stays in the protocol until the stream ends, so the sync fails with
    the engine's error at once rather than a group timeout (60 s here) blaming the trainer."""
    actor, infer, policy = clusters
    inner = infer._workers[1].engine
    inner.update_weights = S.dying_at(inner.update_weights, 3)
    sync = WeightSync(
        actor, infer, policy=policy, transport="broadcast", bucket_mb=0.1, timeout_s=60
    )
    with pytest.raises(TransportError, match="engine process died"):
        sync.sync()
    assert infer.weights_version()[1] is None and policy.value == 0
    del inner.update_weights  # the real method again: the next sync heals the engine
    assert sync.sync().version == 1 and infer.weights_version() == [1, 1]
