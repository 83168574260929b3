"""Exact converters between HF Qwen2/Llama state dicts and Megatron-Core ``GPTModel`` shards.

Megatron-Core keeps a decoder layer as fused, tensor-parallel pieces; HF keeps separate
projections. For tensor-parallel size ``tp`` and rank ``r`` (local layer spec names):

==============================================  ==============================================
Megatron (rank r)                               HF
==============================================  ==============================================
``embedding.word_embeddings.weight`` [Vp/tp,H]  ``model.embed_tokens.weight`` [V,H], rows split,
                                                vocab zero-padded to Vp (a multiple of 128*tp)
``decoder.layers.i.input_layernorm.weight``     ``model.layers.i.input_layernorm.weight`` (copy)
``...self_attention.linear_qkv.weight``         q/k/v_proj, interleaved per KV group:
  [(G/tp)*(Q/G+2)*D, H]                         ``[q_g0..., k_g0, v_g0, q_g1..., k_g1, v_g1]``;
                                                groups split over ranks (also ``.bias``)
``...self_attention.linear_proj.weight``        ``o_proj`` [H, Q*D], columns split
``decoder.layers.i.pre_mlp_layernorm.weight``   ``post_attention_layernorm`` (copy)
``...mlp.linear_fc1.weight`` [2F/tp, H]         ``cat(gate_proj[r], up_proj[r])``: each split, then
                                                the rank's halves stacked
``...mlp.linear_fc2.weight`` [H, F/tp]          ``down_proj``, columns split
``decoder.final_layernorm.weight``              ``model.norm.weight`` (copy)
``output_layer.weight`` [Vp/tp, H]              ``lm_head.weight`` (absent when embeddings are tied)
==============================================  ==============================================

(Q query heads, G KV groups, D head dim, H hidden, F MLP width.) Pipeline stage ``p`` of
``pp`` holds a contiguous slice of layers renumbered from 0, the embedding on the first stage
and the final norm/output layer on the last. Every operation is a reshape, slice or
concatenation, so ``megatron_to_hf(hf_to_megatron(sd))`` is bit-exact (tested).

What is not mapped raises ``UnsupportedModelError`` (another ``model_type``, rope scaling,
biases outside q/k/v, q/k norms, sliding windows): a silent partial conversion would train
a different model than the one served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.strategies.parallel_errors import ParallelConfigError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "MegatronLayout",
    "hf_to_megatron",
    "layout_from_hf_config",
    "megatron_to_hf",
]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class MegatronLayout:
    """The shapes and parallel sizes a conversion needs (derived from an HF config)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    qkv_bias: bool
    tied_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tp: int = 1
    pp: int = 1
    vocab_divisible_by: int = 128

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of ``vocab_divisible_by * tp`` (Megatron's padding)."""
        step = self.vocab_divisible_by * self.tp
        return -(-self.vocab_size // step) * step

    def stage_layers(self, pp_rank: int) -> range:
        """Global layer indices held by pipeline stage ``pp_rank``."""
        per = self.num_layers // self.pp
        return range(pp_rank * per, (pp_rank + 1) * per)

    def check(self) -> None:
        """Raise ``ParallelConfigError`` listing every size that ``tp``/``pp`` does not divide."""
        problems = []
        for what, value in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.ffn_hidden_size),
        ):
            if value % self.tp:
                problems.append(
                    f"{what}={value} is not divisible by tensor_parallel_size={self.tp}"
                )
        if self.num_layers % self.pp:
            problems.append(
                f"num_hidden_layers={self.num_layers} is not divisible by "
                f"pipeline_parallel_size={self.pp}"
            )
        if problems:
            raise ParallelConfigError(
                "megatron layout impossible for this model: "
                + "; ".join(problems)
                + ". Choose a tensor/pipeline parallel size that divides them"
            )


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not mapped to Megatron-Core by this converter; only "
            "plain RoPE ('default') round-trips exactly. Use strategy 'fsdp2' for this model"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return float(theta)


def layout_from_hf_config(config: Any, *, tp: int = 1, pp: int = 1) -> MegatronLayout:
    """A checked ``MegatronLayout`` for an HF ``Qwen2Config``/``LlamaConfig``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"the Megatron converter does not know model_type {model_type!r}; it maps "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Use strategy 'fsdp2' or 'hf' for this model"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"hidden_act {config.hidden_act!r} is not mapped; only SwiGLU ('silu') is"
        )
    if model_type == "llama" and (
        getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
    ):
        raise UnsupportedModelError(
            "a llama config with attention_bias/mlp_bias=True has biases Megatron's GPTModel "
            "cannot hold exactly (o_proj/MLP biases); use strategy 'fsdp2'"
        )
    if model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError(
            "qwen2 with use_sliding_window=True is not mapped; use strategy 'fsdp2'"
        )
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    layout = MegatronLayout(
        model_type=model_type,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        ffn_hidden_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
        qkv_bias=model_type == "qwen2",
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rms_norm_eps=float(config.rms_norm_eps),
        rope_theta=_rope_theta(config),
        max_positions=int(config.max_position_embeddings),
        tp=int(tp),
        pp=int(pp),
    )
    layout.check()
    return layout


# --------------------------------------------------------------------------- HF -> Megatron


def _pad_vocab(weight: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    import torch

    extra = layout.padded_vocab_size - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros((extra, *weight.shape[1:]))])


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MegatronLayout, rank: int
) -> torch.Tensor:
    """q [Q*D, ...], k/v [G*D, ...] -> this rank's interleaved [(G/tp)*(Q/G+2)*D, ...]."""
    import torch

    groups, d = layout.num_kv_heads, layout.head_dim
    per_group = layout.num_heads // groups
    tail = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, per_group * d, *tail),
            k.reshape(groups, d, *tail),
            v.reshape(groups, d, *tail),
        ],
        dim=1,
    )
    mine = fused.chunk(layout.tp, dim=0)[rank]
    return mine.reshape(-1, *tail).clone()


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], layout: MegatronLayout, *, tp_rank: int = 0, pp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """The Megatron ``GPTModel`` state dict of TP rank ``tp_rank``, PP stage ``pp_rank``."""
    import torch

    def split(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.chunk(layout.tp, dim=dim)[tp_rank].clone()

    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = split(
            _pad_vocab(hf["model.embed_tokens.weight"], layout), 0
        )
    for local, index in enumerate(layout.stage_layers(pp_rank)):
        src, dst = f"model.layers.{index}.", f"decoder.layers.{local}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[attn + "q_proj.weight"],
            hf[attn + "k_proj.weight"],
            hf[attn + "v_proj.weight"],
            layout,
            tp_rank,
        )
        if layout.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf[attn + "q_proj.bias"],
                hf[attn + "k_proj.bias"],
                hf[attn + "v_proj.bias"],
                layout,
                tp_rank,
            )
        out[dst + "self_attention.linear_proj.weight"] = split(hf[attn + "o_proj.weight"], 1)
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
        mlp = src + "mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [split(hf[mlp + "gate_proj.weight"], 0), split(hf[mlp + "up_proj.weight"], 0)]
        )
        out[dst + "mlp.linear_fc2.weight"] = split(hf[mlp + "down_proj.weight"], 1)
    if pp_rank == layout.pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not layout.tied_embeddings:
            out["output_layer.weight"] = split(_pad_vocab(hf["lm_head.weight"], layout), 0)
        elif layout.pp > 1:  # the last stage keeps its own copy of the tied embedding
            out["output_layer.weight"] = split(
                _pad_vocab(hf["model.embed_tokens.weight"], layout), 0
            )
    return out


# --------------------------------------------------------------------------- Megatron -> HF


def _unfuse_qkv(
    shards: list[torch.Tensor], layout: MegatronLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    groups, d = layout.num_kv_heads, layout.head_dim
    per_group = layout.num_heads // groups
    tail = shards[0].shape[1:]
    fused = torch.cat(
        [s.reshape(groups // layout.tp, (per_group + 2) * d, *tail) for s in shards], dim=0
    )
    q, k, v = fused.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail).clone(), k.reshape(-1, *tail).clone(), v.reshape(-1, *tail).clone()


def megatron_to_hf(
    stages: Sequence[Sequence[Mapping[str, torch.Tensor]]], layout: MegatronLayout
) -> dict[str, torch.Tensor]:
    """Full HF tensors from every shard: ``stages[pp_rank][tp_rank]`` is one rank's state dict.

    Also accepts any subset of layers in a stage (what is present is converted); the result's
    names are exactly an HF ``model.state_dict()``'s (``lm_head.weight`` is the embedding when
    tied).
    """
    import torch

    if len(stages) != layout.pp or any(len(s) != layout.tp for s in stages):
        raise ParallelConfigError(
            f"megatron_to_hf got {len(stages)} pipeline stages of {[len(s) for s in stages]} "
            f"tensor ranks, but the layout says pp={layout.pp}, tp={layout.tp}; pass "
            "stages[pp_rank][tp_rank]"
        )
    vocab = layout.vocab_size

    def merge(shards: Sequence[Mapping[str, torch.Tensor]], name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    hf: dict[str, torch.Tensor] = {}
    for pp_rank, shards in enumerate(stages):
        first = shards[0]
        if "embedding.word_embeddings.weight" in first:
            hf["model.embed_tokens.weight"] = merge(shards, "embedding.word_embeddings.weight", 0)[
                :vocab
            ].clone()
        for local, index in enumerate(layout.stage_layers(pp_rank)):
            src, dst = f"decoder.layers.{local}.", f"model.layers.{index}."
            if src + "input_layernorm.weight" not in first:
                continue
            hf[dst + "input_layernorm.weight"] = first[src + "input_layernorm.weight"].clone()
            q, k, v = _unfuse_qkv(
                [s[src + "self_attention.linear_qkv.weight"] for s in shards], layout
            )
            hf.update(
                {
                    dst + "self_attn.q_proj.weight": q,
                    dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v,
                }
            )
            if layout.qkv_bias:
                q, k, v = _unfuse_qkv(
                    [s[src + "self_attention.linear_qkv.bias"] for s in shards], layout
                )
                hf.update(
                    {
                        dst + "self_attn.q_proj.bias": q,
                        dst + "self_attn.k_proj.bias": k,
                        dst + "self_attn.v_proj.bias": v,
                    }
                )
            hf[dst + "self_attn.o_proj.weight"] = merge(
                shards, src + "self_attention.linear_proj.weight", 1
            )
            hf[dst + "post_attention_layernorm.weight"] = first[
                src + "pre_mlp_layernorm.weight"
            ].clone()
            halves = [s[src + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
            hf[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
            hf[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
            hf[dst + "mlp.down_proj.weight"] = merge(shards, src + "mlp.linear_fc2.weight", 1)
        if "decoder.final_layernorm.weight" in first:
            hf["model.norm.weight"] = first["decoder.final_layernorm.weight"].clone()
        if "output_layer.weight" in first and not layout.tied_embeddings:
            hf["lm_head.weight"] = merge(shards, "output_layer.weight", 0)[:vocab].clone()
    if layout.tied_embeddings and "model.embed_tokens.weight" in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return hf
