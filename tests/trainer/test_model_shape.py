"""``ModelShape``: a model's tensors from its config.json alone, checked against the model HF
builds from the same config (on the meta device: no memory, no weights)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gpu.recipe_models import QWEN2_5_0_5B, QWEN2_5_7B
from trainer.model_shape import ModelShape, UnknownModelShape

torch = pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

SMALL = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama-biases-untied": (
        "llama",
        {
            **SMALL,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    "qwen2": ("qwen2", {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3": (
        "qwen3",
        {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    ),
    "mistral": ("mistral", {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 1}),
    "gpt2": (
        "gpt2",
        {
            "vocab_size": 300,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 96,
            "n_positions": 128,
        },
    ),
}


def hf_model(model_type: str, fields: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), config.to_dict()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_tensor_and_the_parameter_count_match_the_model_hf_builds(name: str) -> None:
    model, config = hf_model(*CONFIGS[name])
    shape = ModelShape.from_config(config)
    assert shape.num_params == model.num_parameters()
    state = {name: t.numel() for name, t in model.state_dict().items()}
    if shape.tied_embeddings:
        state.pop("lm_head.weight")
    state = {k: n for k, n in state.items() if not k.endswith((".attn.bias", "masked_bias"))}
    assert dict(shape.tensors()) == state


def test_qwen2_5_sizes_are_the_published_ones() -> None:
    small = ModelShape.from_config({"model_type": "qwen2", **QWEN2_5_0_5B})
    large = ModelShape.from_config({"model_type": "qwen2", **QWEN2_5_7B})
    assert small.num_params == 494_032_768  # "0.49B"
    assert large.num_params == 7_615_616_512  # "7.61B"
    assert large.kv_bytes_per_token(2) == 28 * 4 * 128 * 2 * 2


TARGETS: list[Any] = [
    "all-linear",
    ["q_proj", "v_proj"],
    ["mlp.down_proj"],
    ["q_proj", "v_proj", "embed_tokens"],
]


@pytest.mark.parametrize(
    ("name", "targets"),
    [(name, t) for name in ("qwen2", "gpt2") for t in TARGETS]
    # an output head: only untied (LoRA on a tied one is refused, lora.tied_head_refusal)
    + [("llama-biases-untied", ["q_proj", "lm_head"])],
)
def test_lora_adapters_are_the_ones_peft_adds(name: str, targets: Any) -> None:
    peft = pytest.importorskip("peft")
    if name == "gpt2" and targets != "all-linear":
        gpt2 = {"q_proj": "c_attn", "mlp.down_proj": "mlp.c_proj", "embed_tokens": "wte"}
        targets = sorted({gpt2[t] for t in targets if t in gpt2})
    model, config = hf_model(*CONFIGS[name])
    lora = peft.LoraConfig(r=8, target_modules=targets, fan_in_fan_out=name == "gpt2")
    wrapped = peft.get_peft_model(model, lora)
    trainable, _ = wrapped.get_nb_trainable_parameters()
    shape = ModelShape.from_config(config)
    assert shape.lora_params(8, targets) == trainable
    adapters = {n: p.numel() for n, p in wrapped.named_parameters() if p.requires_grad}
    assert dict(shape.lora_tensors(8, targets)) == {
        n.replace(".default", ""): k for n, k in adapters.items()
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_layer_names_lora_may_target_are_the_models(name: str) -> None:
    """What ``model.lora.target_modules`` may name, from config.json alone: the names the adapter
    code reads off the built model (``lora.adaptable_module_names``)."""
    from trainer.strategies.lora import adaptable_module_names

    model, config = hf_model(*CONFIGS[name])
    assert ModelShape.from_config(config).adaptable_module_names() == adaptable_module_names(model)


def test_another_family_is_refused_with_the_ones_known() -> None:
    with pytest.raises(UnknownModelShape, match="qwen2_moe.*llama, mistral, qwen2, qwen3, gpt2"):
        ModelShape.from_config({"model_type": "qwen2_moe", "hidden_size": 8})
    with pytest.raises(UnknownModelShape, match="lacks a size field"):
        ModelShape.from_config({"model_type": "llama", "hidden_size": 8})
