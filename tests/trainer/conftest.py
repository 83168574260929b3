"""Fixtures for trainer tests: one tiny policy folder built once per session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

LAKE = "games/frozen-lake-v0"
LAKE_KWARGS = {"action_format": "raw", "size": 3}


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
