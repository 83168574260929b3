"""Tiny policies: built from a config, saved, loaded through the same from_pretrained path."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.conftest import LAKE, LAKE_KWARGS
from trainer.errors import ModelError
from trainer.models import build_model, build_tokenizer, count_parameters, env_corpus, load_policy

TEXT = "You moved right.\n\nS F H\nF P F\nH F G\n\nYour next move?"


@pytest.mark.parametrize("kind", ["bpe", "word", "char"])
def test_tokenizers_round_trip_env_text(kind: str) -> None:
    tokenizer = build_tokenizer(env_corpus(LAKE, LAKE_KWARGS, episodes=20), kind)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 0


def test_bpe_makes_each_grid_row_one_token_and_compresses_prose() -> None:
    tokenizer = build_tokenizer(env_corpus(LAKE, LAKE_KWARGS, episodes=20), "bpe")
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(TEXT, add_special_tokens=False))
    assert tokens == [
        "You moved right.\n\n",
        "S F H",
        "\n",
        "F P F",
        "\n",
        "H F G",
        "\n\nYour next move?",
    ]


def test_env_corpus_and_tokenizer_are_reproducible() -> None:
    # the corpus mixes in random actions; unseeded, every run built a different tokenizer
    # (and so a different policy), so the same config gave a different step-0 eval each time
    first, second = (
        env_corpus(LAKE, LAKE_KWARGS, episodes=20),
        env_corpus(LAKE, LAKE_KWARGS, episodes=20),
    )
    assert first == second
    assert env_corpus(LAKE, LAKE_KWARGS, episodes=20, seed=1) != first
    assert build_tokenizer(first, "bpe").get_vocab() == build_tokenizer(second, "bpe").get_vocab()


def test_saved_policy_loads_through_auto_classes(policy_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 20_000 < count_parameters(model) < 2_000_000
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "up"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nup<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode(TEXT, add_special_tokens=False)) == TEXT


def test_missing_model_path_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist or is not a folder; set model.path"):
        load_policy(tmp_path / "nope")
    with pytest.raises(ModelError, match="has no config.json"):
        load_policy(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "no-such-family"}')
    with pytest.raises(ModelError, match="(?s)cannot be loaded .*complete save_pretrained folder"):
        load_policy(tmp_path)


def test_qwen2_tiny_build_explains_why_not() -> None:
    tokenizer = build_tokenizer(["up down"], "word")
    with pytest.raises(ModelError, match="Use 'llama'"):
        build_model(tokenizer, arch="qwen2")
    with pytest.raises(ModelError, match="unknown tokenizer kind 'bytes'"):
        build_tokenizer(["x"], "bytes")
