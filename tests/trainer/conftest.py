"""Fixtures for trainer tests: one tiny policy folder built once per session (no downloads)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

LAKE = "games/frozen-lake-v0"
LAKE_KWARGS = {"action_format": "raw", "size": 3}


@pytest.fixture(scope="session", autouse=True)
def ray_without_token_auth() -> Iterator[None]:
    """Every Ray these tests start listens on loopback only, and the `ray start` clusters they
    join run with ``RAY_AUTH_MODE=disabled``. A process whose first ``ray.init`` started a local
    Ray in token mode cannot start actors on another cluster after ``ray.shutdown()`` (Ray's
    own state; a plain-Ray script shows it), so a run's local Ray must not be the first in token
    mode either, whatever order the tests run in."""
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = previous or "disabled"
    yield
    if previous is None:
        os.environ.pop("RAY_AUTH_MODE", None)


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~0.1M-parameter Llama with a BPE tokenizer over Frozen Lake texts, saved to a folder."""
    pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
    pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")
    from transformers.utils import logging

    from trainer.models import build_policy, env_corpus

    logging.disable_progress_bar()
    folder = tmp_path_factory.mktemp("policy")
    return build_policy(
        folder,
        env_corpus(LAKE, LAKE_KWARGS, episodes=60),
        tokenizer_kind="bpe",
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        seed=0,
    )


@pytest.fixture(scope="session")
def vllm_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with attention head size 32 (vLLM's CPU kernels need 32, 64, ...)."""
    from trainer.models import build_policy, env_corpus

    return build_policy(
        tmp_path_factory.mktemp("vllm_policy"),
        env_corpus(LAKE, LAKE_KWARGS, episodes=60),
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=128,
        seed=0,
    )


@pytest.fixture(scope="session")
def policy(policy_dir: Path):
    from trainer.models import load_policy

    return load_policy(policy_dir)
