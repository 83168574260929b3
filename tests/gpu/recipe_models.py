"""Random policies with the shape of a GPU recipe's checkpoint, built offline (no download).

A GPU recipe (``examples/qwen2.5-0.5b-*.yaml``) points ``model.path`` at a real checkpoint,
which cannot be fetched here. :func:`random_policy` saves a folder that loads through the very
same ``from_pretrained`` path: a ``Qwen2ForCausalLM`` with the checkpoint's config (width,
depth, heads, GQA, vocabulary, tied embeddings, dtype), randomly initialised, and a tokenizer
that ``AutoTokenizer`` loads as ``Qwen2Tokenizer`` (the class it always picks for model_type
``qwen2``): byte-level BPE learnt on the recipe's env texts, saved as ``vocab.json`` /
``merges.txt``, with ChatML special tokens and chat template. The tokenizer is small; the
model's embedding keeps the checkpoint's 151,936 rows (as Qwen's own has more rows than tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.rollout.sim_engine import QWEN2_5_7B as SIM_QWEN2_5_7B

__all__ = ["QWEN2_5_0_5B", "QWEN2_5_7B", "SHAPES", "config_json", "random_policy"]

QWEN2_5_0_5B: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
"""``config.json`` of Qwen/Qwen2.5-0.5B-Instruct (the shape the 0.5B GPU recipes train)."""

QWEN2_5_7B: dict[str, Any] = {k: v for k, v in SIM_QWEN2_5_7B.items() if k != "model_type"}
"""``config.json`` of Qwen/Qwen2.5-7B-Instruct (the LoRA recipe's shape)."""

SHAPES = {"qwen2.5-0.5b": QWEN2_5_0_5B, "qwen2.5-7b": QWEN2_5_7B}
"""Recipe file name prefix -> the checkpoint shape it trains."""

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer(corpus: list[str], folder: Path) -> Any:
    """Byte-level BPE in Qwen2Tokenizer's layout (``vocab.json``, ``merges.txt``), ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trainer.models import CHATML_TEMPLATE

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=4096,
            special_tokens=_SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(folder)
    backend.model.save(str(folder))  # vocab.json + merges.txt: what Qwen2Tokenizer is built from
    return tokenizer


def config_json(folder: Path, shape: dict[str, Any], dtype: str = "bfloat16") -> Path:
    """A folder holding only the checkpoint's ``config.json``: what ``envhub train --dry-run``
    and the config's memory check read (no weights, no tokenizer)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "torch_dtype": dtype,
        **shape,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def random_policy(
    folder: Path,
    shape: dict[str, Any],
    *,
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """Save a random ``Qwen2ForCausalLM`` of ``shape``, a Qwen2 tokenizer of ``env_id``'s texts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from trainer.models import env_corpus

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(env_corpus(env_id, env_kwargs, episodes=40, seed=seed), folder)
    config = Qwen2Config(
        **shape,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    loaded = AutoTokenizer.from_pretrained(folder)
    if (
        type(loaded).__name__ != "Qwen2Tokenizer"
        or loaded.decode(loaded("Push the box up.")["input_ids"]) != "Push the box up."
    ):
        raise RuntimeError(
            f"the tokenizer in {folder} does not load back as a working Qwen2Tokenizer "
            f"({type(loaded).__name__})"
        )
    return folder
