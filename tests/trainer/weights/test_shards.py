"""Shard-direct layouts: every rank's pieces, written into full HF tensors, rebuild the model
exactly (Megatron TP with grouped-query attention, q/k/v biases, padded vocab; FSDP2 row chunks)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer.weights.shards import megatron_layout, write_piece


def assemble(layouts) -> dict[str, torch.Tensor]:
    specs = layouts[0].specs
    # every rank agrees
    assert all([s.name for s in lay.specs] == [s.name for s in specs] for lay in layouts)
    full = {s.name: torch.full(s.shape, float("nan"), dtype=getattr(torch, s.dtype)) for s in specs}
    for lay in layouts:
        for name, pieces in lay.pieces.items():
            for index, piece in pieces:
                write_piece(full[name], index, piece)
    return full


@pytest.mark.parametrize(
    "tp,kv_heads,bias,tied",
    [(2, 2, False, True), (2, 2, True, False), (4, 4, True, True), (2, 4, False, False)],
)
def test_megatron_tp_shards_rebuild_the_hf_tensors_exactly(
    tp: int, kv_heads: int, bias: bool, tied: bool
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from trainer.strategies.megatron_convert import hf_to_megatron, layout_from_hf_config

    # Qwen2 has q/k/v biases, Llama none; a vocab of 203 is padded to 256 * tp rows in Megatron
    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if bias else (LlamaConfig, LlamaForCausalLM)
    )
    config = config_cls(
        vocab_size=203,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = {k: v.detach() for k, v in model_cls(config).state_dict().items()}
    layout = layout_from_hf_config(config, tp=tp)
    assert layout.qkv_bias == bias
    ranks = [
        megatron_layout(layout, hf_to_megatron(hf, layout, tp_rank=r), tp_rank=r) for r in range(tp)
    ]
    full = assemble(ranks)
    expected = {k: v for k, v in hf.items() if not (tied and k == "lm_head.weight")}
    assert sorted(full) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(full[name], tensor), name
    # a tied head travels as a second name for the embedding's bytes (vLLM needs to see it)
    assert ranks[0].aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
