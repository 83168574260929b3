"""``WeightSync`` between in-process clusters: bucketed shared-memory and broadcast syncs reproduce
the trainer's greedy outputs, only-changed skips frozen tensors; failures are loud, never stale."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.weights import sync_setup as S
from trainer.config import RoleConfig
from trainer.weights.errors import BucketTooSmallError, StaleWeightsError, TransportError
from trainer.weights.sync import WeightSync
from trainer.weights.versioned import PolicyVersion
from trainer.workers.actor import ActorCluster
from trainer.workers.infer import InferCluster


@pytest.fixture(scope="module")
def model_dir(policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return S.spread_policy(policy_dir, tmp_path_factory.mktemp("spread"))


@pytest.fixture
def clusters(model_dir: Path):
    common = {"model_path": str(model_dir)}
    actor = ActorCluster(
        "actor_train",
        RoleConfig(strategy="hf", device_mapping=[]),
        backend="local",
        worker_kwargs={**common, "optim": {"lr": 0.05}},
    )
    infer = InferCluster(
        "actor_infer",
        RoleConfig(strategy="hf", device_mapping=[], num_workers=2),
        backend="local",
        worker_kwargs=common,
    )
    try:
        # the run's policy version: every sync of a test advances it
        yield actor, infer, PolicyVersion()
    finally:
        actor.shutdown()
        infer.shutdown()


def train_away(actor: ActorCluster, model_dir: Path) -> None:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    for _ in range(3):
        actor.sft_step(S.random_batch(vocab))


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_sync_makes_every_engine_generate_what_the_trainer_would(
    clusters, model_dir: Path, transport: str
) -> None:
    actor, infer, policy = clusters
    train_away(actor, model_dir)
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


def test_only_changed_sends_nothing_when_nothing_trained(clusters, model_dir: Path) -> None:
    actor, infer, policy = clusters
    sync = WeightSync(
        actor, infer, policy=policy, transport="shared_memory", bucket_mb=0.1, only_changed=True
    )
    first = sync.sync()
    assert first.tensors > 0
    again = sync.sync()
    assert again.tensors == 0 and again.version == 2 and infer.weights_version() == [2, 2]
    train_away(actor, model_dir)
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
    real_update = worker.engine.update_weights

    def dying_update(weights):
        def first_few():
            for index, item in enumerate(weights):
                if index == 12:
                    raise RuntimeError("engine process died")
                yield item

        return real_update(first_few())

    worker.engine.update_weights = dying_update
    with pytest.raises(TransportError, match="engine process died"):
        WeightSync(actor, infer, policy=policy, transport="shared_memory", bucket_mb=0.1).sync()
    with pytest.raises(StaleWeightsError, match="half-updated"):
        worker.engine.check()
    assert infer.weights_version()[1] is None
    assert policy.value == 0  # a failed sync does not advance the run's version


def test_after_a_failed_only_changed_sync_the_next_one_resends_every_tensor(
    clusters, model_dir: Path
) -> None:
    actor, infer, policy = clusters
    sync = WeightSync(
        actor, infer, policy=policy, transport="shared_memory", bucket_mb=0.1, only_changed=True
    )
    sync.sync()
    train_away(actor, model_dir)
    inner = infer._workers[1].engine.engine  # the engine inside the worker's VersionedEngine
    real_update = inner.update_weights

    def dying_update(weights):
        def first_few():
            for index, item in enumerate(weights):
                if index == 3:
                    raise RuntimeError("engine process died")
                yield item

        return real_update(first_few())

    inner.update_weights = dying_update
    with pytest.raises(TransportError, match="engine process died"):
        sync.sync()  # the trainer's segments now hold the new weights, engine 1 does not
    inner.update_weights = real_update
    healed = sync.sync()
    # everything again, though the segments already match
    assert healed.tensors == len(actor.get_weights())
    assert [r.token_ids for r in S.engine_greedy(infer)] == S.trainer_greedy(
        actor.get_weights(), model_dir
    )


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
