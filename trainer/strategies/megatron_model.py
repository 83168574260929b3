"""The Megatron-Core model of an HF Qwen2/Llama-family policy: ``build_gpt_model``.

``MegatronTrainStrategy`` (``trainer.strategies.megatron``) builds this rank's shard (TP)
or stage (PP) with it; ``megatron_convert`` moves the HF weights in. Attention is torch's
``scaled_dot_product_attention`` behind Megatron's core-attention signature
(``SDPACoreAttention``), so no fused CUDA kernels are needed and the same model runs on CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from trainer.strategies.parallel_errors import ParallelConfigError

if TYPE_CHECKING:
    import torch

    from trainer.strategies.megatron_convert import MegatronLayout

__all__ = ["SDPACoreAttention", "build_gpt_model"]


class SDPACoreAttention:  # the real class is built lazily (torch/megatron imports) by _sdpa_class()
    """Causal ``scaled_dot_product_attention`` with Megatron's core-attention signature."""


def _sdpa_class() -> type:
    import torch
    from megatron.core.transformer.module import MegatronModule

    class _SDPACoreAttention(MegatronModule):
        """Megatron core attention via torch SDPA.

        Shapes: q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``.
        """

        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            **_: Any,
        ) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.dropout = (
                config.attention_dropout if attention_dropout is None else attention_dropout
            )

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
            if k.shape[1] != q.shape[1]:
                repeat = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                scale=self.softmax_scale,
                dropout_p=self.dropout if self.training else 0.0,
            )
            sq, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    return _SDPACoreAttention


def build_gpt_model(
    layout: MegatronLayout,
    *,
    attention: Literal["sdpa", "local"] = "sdpa",
    recompute: bool = False,
    params_dtype: Any = None,
    pre_process: bool = True,
    post_process: bool = True,
) -> Any:
    """A Megatron-Core ``GPTModel`` equal to the HF model ``layout`` describes (this rank's shard).

    With ``layout.pp > 1`` it is one pipeline stage (Megatron's parallel state decides which
    layers): ``pre_process`` on the first stage, ``post_process`` on the last. A tied model
    gets an untied output layer on the last stage; the strategy keeps the tie (module docstring).
    """
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra: dict[str, Any] = {}
    if recompute:
        extra = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    config = TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=layout.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        params_dtype=params_dtype or torch.float32,
        pipeline_dtype=params_dtype or torch.float32,
        # the CUDA sync megatron keeps for old PyTorch's batch_isend_irecv race: not needed
        batch_p2p_sync=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **extra,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = _sdpa_class()
    elif attention != "local":
        raise ParallelConfigError(
            f"unknown megatron attention {attention!r}; use 'sdpa' or 'local'"
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=layout.max_positions,
        share_embeddings_and_output_weights=layout.tied_embeddings and layout.pp == 1,
        position_embedding_type="rope",
        rotary_base=layout.rope_theta,  # a float base too (2.5): int() changed the model
        parallel_output=True,
        pre_process=pre_process,
        post_process=post_process,
    )
