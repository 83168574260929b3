"""vLLM engine settings checked at config load: unknown ``strategy_args`` keys, and the rollout
context limit taking the engine's ``max_model_len``. No engine is started."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.errors import ConfigError

VLLM = [*TINY, "model.tiny.num_heads=1", "rollout.engine=vllm"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM installed")
def test_a_typo_in_vllm_strategy_args_is_refused_at_config_load_with_the_valid_key() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(
            QUICKSTART,
            [*VLLM, "roles.actor_infer.strategy_args={kv_cache_gib: 0.0625, max_model_length: 1}"],
        )
    message = str(refused.value)
    assert "roles.actor_infer.strategy_args.max_model_length" in message
    assert "did you mean max_model_len?" in message


def test_vllm_engine_and_vllm_arguments_pass_the_config_check() -> None:
    cfg = load_config(
        QUICKSTART,
        [
            *VLLM,
            (
                "roles.actor_infer.strategy_args={kv_cache_gib: 0.0625, max_model_len: 512, "
                "max_num_seqs: 8, enable_prefix_caching: false}"
            ),
        ],
    )
    assert cfg.roles.actor_infer.strategy_args["max_num_seqs"] == 8


def test_the_rollout_context_limit_is_the_engines_max_model_len_when_smaller(
    vllm_policy_dir: Path,
) -> None:
    from trainer.pipeline import AgenticPipeline

    args = "roles.actor_infer.strategy_args={kv_cache_gib: 0.0625, max_model_len: 512}"
    cfg = load_config(QUICKSTART, [*VLLM, args])
    stub = types.SimpleNamespace(model_path=str(vllm_policy_dir), cfg=cfg)
    assert AgenticPipeline._context_limit(stub) == 512
    hf = load_config(QUICKSTART, [*TINY, "model.tiny.num_heads=1"])  # hf: the model's positions
    stub.cfg = hf
    assert AgenticPipeline._context_limit(stub) > 512


@pytest.mark.parametrize("cache", ["", "kv_cache_gib: 2, "])
def test_gpu_memory_utilization_under_a_set_kv_cache_size_is_refused_naming_the_fix(
    cache: str,
) -> None:
    """vLLM sizes the KV cache from ``kv_cache_gib`` (1 GiB unless given) and then ignores
    ``gpu_memory_utilization``: a user's setting must not vanish silently."""
    args = f"roles.actor_infer.strategy_args={{{cache}gpu_memory_utilization: 0.8}}"
    with pytest.raises(ConfigError) as refused:
        load_config(QUICKSTART, [*VLLM, args])
    message = str(refused.value)
    assert "roles.actor_infer.strategy_args.gpu_memory_utilization" in message
    assert "kv_cache_gib: null" in message
    sized_by_it = "roles.actor_infer.strategy_args={kv_cache_gib: null, gpu_memory_utilization: 1}"
    # with the cache sized by it, it counts (the memory check, off here, sizes a GPU's cache)
    load_config(QUICKSTART, [*VLLM, sized_by_it, "cluster.check_memory=false"])
