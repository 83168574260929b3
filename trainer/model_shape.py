"""The tensors of a causal LM, from its ``config.json`` alone: no weights, no torch.

The memory estimate (``trainer.memory``) and ``envhub train --dry-run``'s weight-sync buckets
need to know how many parameters a model has, how they split into transformer blocks and
linear maps, what one token of KV cache costs, and which linear maps LoRA adapts. For the
dense decoder families the trainer runs, all of it follows from a few config fields:

==========  ==============================================================================
family      block (per layer)
==========  ==============================================================================
``llama``   RMSNorm, q/k/v/o projections (grouped-query), RMSNorm, SwiGLU gate/up/down;
            ``attention_bias`` / ``mlp_bias`` add biases. ``mistral`` is the same block.
``qwen2``   the llama block with q/k/v biases.
``qwen3``   the llama block with per-head RMSNorms on q and k (``q_norm``, ``k_norm``).
``gpt2``    LayerNorm, fused ``c_attn`` (q, k, v), ``c_proj``, LayerNorm, GELU MLP
            (``c_fc``, ``c_proj``); learnt positions; Conv1D weights stored (in, out).
==========  ==============================================================================

Tensor names are the HF checkpoint's (``model.layers.3.self_attn.q_proj.weight``), so the
shapes here feed ``trainer.weights.buckets.plan_buckets`` exactly as the real weights would.
``ModelShape.from_config`` refuses any other ``model_type`` with :class:`UnknownModelShape`
(its message lists the families above), so an estimate is never silently made up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "TINY_VOCAB_BOUND",
    "Linear",
    "ModelShape",
    "UnknownModelShape",
    "lora_matches",
]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
"""``model_type`` values whose tensors this module knows."""

TINY_VOCAB_BOUND = 2048
"""The default bound of ``model.tiny.vocab_size``: ``trainer.models.build_tokenizer`` learns at
most that many tokens from the env's texts (the real size is known only once it is built)."""


class UnknownModelShape(ValueError):
    """A config whose tensors this module cannot derive (another ``model_type``, missing
    fields)."""


@dataclass(frozen=True)
class Linear:
    """One linear map of a transformer block, named relative to the block."""

    name: str
    """``self_attn.q_proj``, ``mlp.down_proj``, ``attn.c_attn``, ..."""
    in_features: int
    out_features: int
    bias: bool
    input_group: str
    """Linears reading the same input share it: ``attn_in``, ``attn_out``, ``mlp_in``, ``mlp_mid``
    (the activation estimate saves one copy per group)."""
    tensor_parallel: bool = True
    """Split over tensor-parallel ranks (every block linear of these families is)."""


def _get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one causal LM (see the module docstring); build with :meth:`from_config`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    tied_embeddings: bool
    linears: tuple[Linear, ...]
    """The linear maps of one block."""
    block_other: tuple[tuple[str, int], ...]
    """One block's other tensors (norms, biases of norms): ``(name, numel)``."""

    # ------------------------------------------------------------------ building
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """The shape of the model a HF ``config.json`` (as a dict) describes."""
        model_type = str(config.get("model_type") or "")
        if model_type not in FAMILIES:
            raise UnknownModelShape(
                f"no memory model for model_type {model_type or '(none)'!r}; the estimate knows "
                f"{', '.join(FAMILIES)}"
            )
        try:
            if model_type == "gpt2":
                return cls._gpt2(config)
            return cls._llama_like(model_type, config)
        except (KeyError, TypeError, ValueError) as error:
            raise UnknownModelShape(
                f"config.json of model_type {model_type!r} lacks a size field ({error})"
            ) from None

    @classmethod
    def from_path(cls, folder: str | Path) -> ModelShape:
        """The shape of the checkpoint folder's ``config.json`` (OSError when there is none)."""
        return cls.from_config(json.loads((Path(folder) / "config.json").read_text()))

    @classmethod
    def from_tiny(cls, tiny: Any, vocab_size: int = TINY_VOCAB_BOUND) -> ModelShape:
        """The shape ``model.tiny`` builds (``trainer.models._arch_config``), with the vocabulary
        at its bound unless the built tokenizer's size is given."""
        if tiny.architecture == "gpt2":
            return cls.from_config(
                {
                    "model_type": "gpt2",
                    "vocab_size": vocab_size,
                    "n_embd": tiny.hidden_size,
                    "n_layer": tiny.num_layers,
                    "n_head": tiny.num_heads,
                    "n_inner": tiny.intermediate_size,
                    "n_positions": tiny.max_position_embeddings,
                }
            )
        return cls.from_config(
            {
                "model_type": tiny.architecture,
                "vocab_size": vocab_size,
                "hidden_size": tiny.hidden_size,
                "num_hidden_layers": tiny.num_layers,
                "num_attention_heads": tiny.num_heads,
                "num_key_value_heads": tiny.num_kv_heads or tiny.num_heads,
                "intermediate_size": tiny.intermediate_size,
                "max_position_embeddings": tiny.max_position_embeddings,
                "tie_word_embeddings": True,
            }
        )

    @classmethod
    def _llama_like(cls, model_type: str, c: Mapping[str, Any]) -> ModelShape:
        h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        kv = int(_get(c, "num_key_value_heads", default=heads))
        head_dim = int(_get(c, "head_dim", default=h // heads))
        i = int(c["intermediate_size"])
        qkv_bias = model_type == "qwen2" or bool(c.get("attention_bias", False))
        o_bias = model_type != "qwen2" and bool(c.get("attention_bias", False))
        mlp_bias = bool(c.get("mlp_bias", False))
        q, k = heads * head_dim, kv * head_dim
        linears = (
            Linear("self_attn.q_proj", h, q, qkv_bias, "attn_in"),
            Linear("self_attn.k_proj", h, k, qkv_bias, "attn_in"),
            Linear("self_attn.v_proj", h, k, qkv_bias, "attn_in"),
            Linear("self_attn.o_proj", q, h, o_bias, "attn_out"),
            Linear("mlp.gate_proj", h, i, mlp_bias, "mlp_in"),
            Linear("mlp.up_proj", h, i, mlp_bias, "mlp_in"),
            Linear("mlp.down_proj", i, h, mlp_bias, "mlp_mid"),
        )
        other = [("input_layernorm.weight", h), ("post_attention_layernorm.weight", h)]
        if model_type == "qwen3":
            other += [("self_attn.q_norm.weight", head_dim), ("self_attn.k_norm.weight", head_dim)]
        return cls(
            model_type=model_type,
            vocab_size=int(c["vocab_size"]),
            hidden_size=h,
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            intermediate_size=i,
            max_positions=int(_get(c, "max_position_embeddings", default=2048)),
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            linears=linears,
            block_other=tuple(other),
        )

    @classmethod
    def _gpt2(cls, c: Mapping[str, Any]) -> ModelShape:
        h, heads = int(c["n_embd"]), int(c["n_head"])
        i = int(_get(c, "n_inner", default=4 * h))
        linears = (
            Linear("attn.c_attn", h, 3 * h, True, "attn_in"),
            Linear("attn.c_proj", h, h, True, "attn_out"),
            Linear("mlp.c_fc", h, i, True, "mlp_in"),
            Linear("mlp.c_proj", i, h, True, "mlp_mid"),
        )
        other = (("ln_1.weight", h), ("ln_1.bias", h), ("ln_2.weight", h), ("ln_2.bias", h))
        return cls(
            model_type="gpt2",
            vocab_size=int(c["vocab_size"]),
            hidden_size=h,
            num_layers=int(c["n_layer"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=h // heads,
            intermediate_size=i,
            max_positions=int(_get(c, "n_positions", default=1024)),
            tied_embeddings=bool(c.get("tie_word_embeddings", True)),
            linears=linears,
            block_other=other,
        )

    # ------------------------------------------------------------------ tensors
    def _prefix(self) -> tuple[str, str]:
        """(block prefix, top-level prefix) of the HF names."""
        return (
            ("transformer.h", "transformer")
            if self.model_type == "gpt2"
            else ("model.layers", "model")
        )

    def top_tensors(self) -> list[tuple[str, int]]:
        """``(name, numel)`` of the tensors outside the blocks (embeddings, final norm, head);
        a tied head is not listed (it is the embedding)."""
        h, v = self.hidden_size, self.vocab_size
        if self.model_type == "gpt2":
            top = [
                ("transformer.wte.weight", v * h),
                ("transformer.wpe.weight", self.max_positions * h),
                ("transformer.ln_f.weight", h),
                ("transformer.ln_f.bias", h),
            ]
        else:
            top = [("model.embed_tokens.weight", v * h), ("model.norm.weight", h)]
        if not self.tied_embeddings:
            top.append(("lm_head.weight", v * h))
        return top

    def block_tensors(self, layer: int) -> list[tuple[str, int]]:
        """``(name, numel)`` of block ``layer``'s tensors, HF names."""
        block, _ = self._prefix()
        out = []
        for linear in self.linears:
            out.append(
                (f"{block}.{layer}.{linear.name}.weight", linear.in_features * linear.out_features)
            )
            if linear.bias:
                out.append((f"{block}.{layer}.{linear.name}.bias", linear.out_features))
        out += [(f"{block}.{layer}.{name}", numel) for name, numel in self.block_other]
        return out

    def tensors(self) -> list[tuple[str, int]]:
        """Every tensor ``(name, numel)`` in checkpoint order (a tied head once, as the
        embedding)."""
        top = self.top_tensors()
        embeddings = [t for t in top if "embed" in t[0] or ".wte." in t[0] or ".wpe." in t[0]]
        rest = [t for t in top if t not in embeddings]
        blocks = [t for layer in range(self.num_layers) for t in self.block_tensors(layer)]
        return embeddings + blocks + rest

    # ------------------------------------------------------------------ counts
    @property
    def block_linear_params(self) -> int:
        """Parameters of one block's linear maps (what tensor parallelism splits)."""
        return sum(
            l.in_features * l.out_features + (l.out_features if l.bias else 0) for l in self.linears
        )

    @property
    def block_params(self) -> int:
        """Parameters of one block."""
        return self.block_linear_params + sum(n for _, n in self.block_other)

    @property
    def embedding_params(self) -> int:
        """Input embedding (and learnt positions) parameters."""
        return sum(
            n
            for name, n in self.top_tensors()
            if name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))
        )

    @property
    def head_params(self) -> int:
        """Output layer parameters when untied (0 when it is the embedding)."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter (a tied head counted once), as ``model.num_parameters()`` says."""
        return sum(n for _, n in self.top_tensors()) + self.num_layers * self.block_params

    @property
    def q_dim(self) -> int:
        """Width of the attention's query (heads x head_dim)."""
        return self.num_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache of one token over all layers: layers x kv_heads x head_dim x 2 (K and V) x
        bytes."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * dtype_bytes

    # ------------------------------------------------------------------ LoRA
    def adaptable_module_names(self) -> list[str]:
        """The distinct last name parts of the model's linear and embedding layers, sorted: what
        ``model.lora.target_modules`` may name (``lora.adaptable_module_names`` reads the same
        off a built model). The output head (``lm_head``) is a linear layer, tied or not."""
        embeddings = [
            name.removesuffix(".weight").rsplit(".", 1)[-1]
            for name, _ in self.top_tensors()
            if name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))
        ]
        blocks = [linear.name.rsplit(".", 1)[-1] for linear in self.linears]
        return sorted({*blocks, *embeddings, "lm_head"})

    def lora_linears(self, target_modules: list[str] | str) -> list[Linear]:
        """The block linears LoRA adapts: ``all-linear`` is every one (the head is never adapted),
        a list matches a linear whose name equals an entry or ends with ``.entry`` (peft's rule)."""
        return [l for l in self.linears if lora_matches(l.name, target_modules)]

    def lora_embedding(self, target_modules: list[str] | str) -> str | None:
        """The input embedding's module name when ``target_modules`` adapts it, else None."""
        for name, _ in self.top_tensors():
            if name.endswith(("wte.weight", "embed_tokens.weight")):
                module = name.removesuffix(".weight")
                if target_modules != "all-linear" and any(
                    module == t or module.endswith("." + t) for t in target_modules
                ):
                    return module
        return None

    def lora_head(self, target_modules: list[str] | str) -> bool:
        """Whether ``target_modules`` names the output head (``lm_head``; never ``all-linear``,
        which peft applies to the blocks only)."""
        return target_modules != "all-linear" and "lm_head" in target_modules

    def lora_params(self, rank: int, target_modules: list[str] | str) -> int:
        """Adapter parameters: rank x (in + out) per adapted linear, in every layer, and rank x
        (vocab + hidden) for an adapted input embedding or output head."""
        return sum(n for _, n in self.lora_tensors(rank, target_modules))

    def lora_tensors(self, rank: int, target_modules: list[str] | str) -> list[tuple[str, int]]:
        """``(name, numel)`` of every adapter tensor in peft's names, in peft's order
        (``lora_A``: rank x in, ``lora_B``: out x rank; an embedding's ``lora_embedding_A``:
        rank x vocab, ``lora_embedding_B``: hidden x rank)."""
        block, _ = self._prefix()
        out = []
        for layer in range(self.num_layers):
            for l in self.lora_linears(target_modules):
                name = f"base_model.model.{block}.{layer}.{l.name}"
                out.append((f"{name}.lora_A.weight", rank * l.in_features))
                out.append((f"{name}.lora_B.weight", l.out_features * rank))
        embedding = self.lora_embedding(target_modules)
        if embedding is not None:
            name = f"base_model.model.{embedding}"
            out.append((f"{name}.lora_embedding_A", rank * self.vocab_size))
            out.append((f"{name}.lora_embedding_B", self.hidden_size * rank))
        if self.lora_head(target_modules):
            out.append(("base_model.model.lm_head.lora_A.weight", rank * self.hidden_size))
            out.append(("base_model.model.lm_head.lora_B.weight", self.vocab_size * rank))
        return out


def lora_matches(name: str, target_modules: list[str] | str) -> bool:
    """Whether peft adapts the block linear ``name`` for ``target_modules``."""
    if target_modules == "all-linear" or "all-linear" in target_modules:
        return True
    return any(name == t or name.endswith("." + t) for t in target_modules)
