"""Tiny policies: built from a config, saved, loaded through the same from_pretrained path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

import envhub
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


# ------------------------------------------------------------------------ the corpus of a bad env


class _CorpusEnv(envhub.TextEnv):
    """Says "win" to win; misbehaves the way ``flaw`` names on seeds >= 3 (winning turn only)."""

    def __init__(self, flaw: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flaw, self.seed_ = flaw, 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        self.seed_ = seed or 0
        return super().reset(seed=seed, options=options)

    def on_reset(self, options: dict) -> Any:
        if self.flaw == "huge":
            return [{"role": "user", "content": "x" * 900_000} for _ in range(12)], {}
        return "Say win.", {}

    def on_step(self, action: str) -> envhub.Turn:
        if action != "win":
            return self.invalid_action("Say win.") if self.flaw != "endless" else envhub.Turn("go")
        if self.seed_ >= 3 and self.flaw == "raise":
            raise KeyError("best")
        if self.seed_ >= 3 and self.flaw == "bad-obs":
            return envhub.Turn({"role": "user", "content": 42}, terminated=True)  # type: ignore[dict-item]
        return envhub.Turn("You won.", reward=1.0, terminated=True, success=True)

    def expert_action(self) -> str | None:
        return None if self.done or self.flaw == "endless" else "win"


CORPUS_ENV = "test/corpus-v0"


@pytest.fixture(scope="module", autouse=True)
def _corpus_env() -> None:
    envhub.register(CORPUS_ENV, _CorpusEnv, max_turns=4, override=True)


@pytest.mark.parametrize(
    "flaw, cause",
    [
        ("raise", "step raised KeyError: 'best' (at test_models.py:"),
        ("bad-obs", "step returned an observation that is not a list of chat messages"),
    ],
)
def test_an_env_error_while_building_the_corpus_names_the_env_seed_and_check(flaw, cause) -> None:
    with pytest.raises(ModelError) as caught:
        env_corpus(CORPUS_ENV, {"flaw": flaw}, episodes=300, seed=0)
    message = str(caught.value)
    assert message.startswith(f"building the tokenizer corpus from {CORPUS_ENV}: seed 3 ")
    assert cause in message
    assert f"envhub check {CORPUS_ENV} --seed 3 -k flaw={flaw}" in message


def test_the_corpus_of_an_env_with_huge_observations_is_bounded() -> None:
    texts = env_corpus(CORPUS_ENV, {"flaw": "huge"}, episodes=300)
    assert max(map(len, texts)) <= 20_000
    assert sum(map(len, texts)) <= 4_000_000  # unbounded, 300 resets held 3.2 GB of text


def test_the_corpus_of_an_episode_that_never_ends_is_bounded() -> None:
    envhub.register("test/corpus-endless-v0", _CorpusEnv, kwargs={"flaw": "endless"})
    texts = env_corpus("test/corpus-endless-v0", episodes=2)
    assert 0 < len(texts) < 4_000


def test_envhub_train_with_a_tiny_model_reports_the_corpus_error(tmp_path: Path) -> None:
    from trainer.config import load_config
    from trainer.roles import prepare_policy

    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    cfg = load_config(
        quickstart,
        [f"env.id={CORPUS_ENV}", "env.kwargs={flaw: raise}", f"output_dir={tmp_path / 'run'}"],
    )
    with pytest.raises(ModelError, match=f"envhub check {CORPUS_ENV} --seed 3"):
        prepare_policy(cfg)
    assert not (tmp_path / "run" / "initial_policy").exists()
