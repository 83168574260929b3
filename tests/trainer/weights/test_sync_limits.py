"""``WeightSync`` at its limits: a wedged engine, a /dev/shm too small for the model, versions
that go backwards. Each fails with an error that names the cause and the fix, and leaves no
engine serving a half-loaded or mislabelled policy."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.weights import sync_setup as S
from trainer.weights.errors import StaleWeightsError, TransportError
from trainer.weights.sync import WeightSync
from trainer.weights.versioned import PolicyVersion


def wedged_at(update_weights: Any, index: int, release: threading.Event) -> Any:
    """``update_weights`` that blocks at tensor ``index`` until ``release`` is set."""

    def wedged_update(weights: Any) -> None:
        def blocking() -> Any:
            for at, item in enumerate(weights):
                if at == index:
                    release.wait()
                yield item

        update_weights(blocking())

    return wedged_update


def test_a_wedged_engine_fails_the_shared_memory_sync_after_timeout_s(clusters) -> None:
    actor, infer, _ = clusters
    sync = WeightSync(actor, infer, transport="shared_memory", bucket_mb=0.1, timeout_s=2)
    sync.sync()  # engines wrapped, both at version 1
    inner = infer._workers[1].engine.engine
    release = threading.Event()
    inner.update_weights = wedged_at(inner.update_weights, 3, release)
    hang_guard = threading.Timer(60, release.set)  # unfixed, the sync would hang forever
    hang_guard.start()
    try:
        with pytest.raises(TransportError, match=r"weight_sync\.timeout_s") as caught:
            sync.sync()
    finally:
        release.set()
        hang_guard.cancel()
    assert "worker rank 1" in str(caught.value) and "version 2" in str(caught.value)
    assert infer.weights_version()[1] is None and sync.version == 1
    # the released engine does not finish the abandoned sync into a served version
    with pytest.raises(StaleWeightsError, match="half-updated"):
        infer._workers[1].engine.check()
    del inner.update_weights
    assert sync.sync().version == 2 and infer.weights_version() == [2, 2]


def test_timeout_s_is_set_from_the_config(clusters) -> None:
    from trainer.config_cluster import WeightSyncConfig

    actor, infer, _ = clusters
    roles = type("Roles", (), {"actor": actor, "infer": infer})()
    sync = WeightSync.from_config(roles, WeightSyncConfig(timeout_s=42))
    assert sync.timeout_s == 42
    assert WeightSyncConfig().timeout_s == 300


def test_a_dev_shm_too_small_for_the_model_is_refused_before_anything_moves(
    clusters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unchecked, the first write past a full /dev/shm kills the trainer with SIGBUS."""
    from trainer.weights import transport

    actor, infer, _ = clusters
    monkeypatch.setattr(transport, "shm_free_bytes", lambda: 50_000)
    sync = WeightSync(actor, infer, transport="shared_memory", bucket_mb=0.1)
    with pytest.raises(TransportError, match="shm-size") as caught:
        sync.sync()
    message = str(caught.value)
    assert "weight_sync.transport: broadcast" in message and "50,000" in message
    assert infer.weights_version() == [0, 0] and sync.version == 0  # engines still serve
    monkeypatch.undo()
    assert sync.sync().version == 1 and infer.weights_version() == [1, 1]


def test_a_dev_shm_too_small_for_a_gathered_bucket_leaves_the_engines_serving(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gathered path (LoRA ``sync: merged``) is refused before the engines stop serving."""
    from trainer.config import LoraConfig
    from trainer.weights import transport

    actor, infer = S.make_clusters(model_dir, lora=LoraConfig(rank=4, sync="merged"))
    try:
        monkeypatch.setattr(transport, "shm_free_bytes", lambda: 50_000)
        sync = WeightSync(actor, infer, transport="shared_memory", bucket_mb=0.1)
        with pytest.raises(TransportError, match="shm-size"):
            sync.sync()
        assert infer.weights_version() == [0, 0]
        assert all(result.token_ids for result in S.engine_greedy(infer))  # still serving
        monkeypatch.undo()
        assert sync.sync().version == 1 and infer.weights_version() == [1, 1]
    finally:
        actor.shutdown()
        infer.shutdown()


def test_a_second_sync_without_the_runs_policy_cannot_reuse_a_version(clusters) -> None:
    """Two ``WeightSync``s each starting at 1 would label a different policy as version 1."""
    actor, infer, _ = clusters
    policy = PolicyVersion()
    WeightSync(actor, infer, policy=policy, transport="shared_memory").sync()
    WeightSync(actor, infer, policy=policy, transport="shared_memory").sync()
    stray = WeightSync(actor, infer, transport="shared_memory")  # its own version, at 0
    with pytest.raises(StaleWeightsError, match=r"version 1 .* already served 2") as caught:
        stray.sync()
    assert "policy=" in str(caught.value)
    with pytest.raises(StaleWeightsError, match=r"version 1 .* already served 2"):
        stray.sync()  # retrying is no way around it
    with pytest.raises(StaleWeightsError, match=r"version 1 .* already served 2"):
        WeightSync(actor, infer, transport="broadcast").sync()
    assert infer.weights_version() == [2, 2]  # refused before anything changed
    resumed = PolicyVersion()
    resumed.restore(7)  # a resume restores the run's version: it continues above it
    assert WeightSync(actor, infer, policy=resumed, transport="broadcast").sync().version == 8
