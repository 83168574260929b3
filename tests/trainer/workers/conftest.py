"""Fixtures of the ``actor_infer`` worker tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A single-node Ray of this test module's own (its workers import this checkout)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from trainer.controller.resources import init_local_ray

    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(1, num_cpus=2, env_vars={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        yield
    finally:
        ray.shutdown()
