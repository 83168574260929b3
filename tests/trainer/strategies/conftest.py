"""Fixtures shared by the strategy tests: a vLLM engine on the tiny vLLM policy (one per test
module: a module's tests may change its weights or adapters) and that policy loaded in torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def hf_policy(vllm_policy_dir: Path) -> Any:
    from trainer.models import load_policy

    return load_policy(vllm_policy_dir)


@pytest.fixture(scope="module")
def engine(vllm_policy_dir: Path) -> Iterator[Any]:
    from trainer.strategies.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(vllm_policy_dir), seed=5, max_model_len=512, kv_cache_gib=0.125)
    yield engine
    engine.shutdown()
