"""Fixtures of the weight-sync tests: the tiny policy with its weights spread out, and a trainer
and two engines over it (``sync_setup``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def model_dir(policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.trainer.weights import sync_setup as S

    return S.spread_policy(policy_dir, tmp_path_factory.mktemp("spread"))


@pytest.fixture
def clusters(model_dir: Path) -> Iterator[tuple[Any, Any, Any]]:
    """``(actor, infer, policy)``: local clusters, and the run's policy version (every sync of a
    test advances it)."""
    from tests.trainer.weights import sync_setup as S
    from trainer.weights.versioned import PolicyVersion

    actor, infer = S.make_clusters(model_dir)
    try:
        yield actor, infer, PolicyVersion()
    finally:
        actor.shutdown()
        infer.shutdown()
