"""The weight-sync bucket fits the model: chosen from it by default, checked against it when set.

Qwen2.5-0.5B's bf16 embedding (151,936 x 896 x 2 bytes = 259.7 MiB) is larger than the old fixed
256 MiB default, so the shipped GPU recipes failed at their first sync.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.weights.buckets import ALIGN, largest_tensor
from trainer.weights.errors import BucketTooSmallError
from trainer.weights.sync import WeightSync, auto_bucket_bytes

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted(glob.glob(str(REPO / "examples" / "qwen2.5-0.5b-*.yaml")))
EMBEDDING = 151_936 * 896 * 2
QWEN_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


@pytest.fixture
def qwen_dir(tmp_path: Path) -> Path:
    """A folder with Qwen2.5-0.5B's config.json (the weights are not needed to size the buckets)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    return tmp_path


class FakeActor:
    backend = "local"

    def __init__(self, sizes: list[tuple[str, int]]) -> None:
        self.sizes = sizes

    def weight_sizes(self) -> list[tuple[str, int]]:
        return self.sizes


def test_the_default_bucket_grows_to_the_largest_tensor() -> None:
    sync = WeightSync(
        FakeActor([("model.embed_tokens.weight", EMBEDDING), ("norm", 1792)]),
        None,
        transport="broadcast",
    )
    sync.check_buckets()  # raised BucketTooSmallError with the fixed 256 MiB default
    assert sync.bucket_bytes == -(-EMBEDDING // ALIGN) * ALIGN
    assert auto_bucket_bytes([("small", 1000)]) == 256 * 2**20


def test_an_explicit_bucket_that_is_too_small_still_fails_before_anything_moves() -> None:
    sync = WeightSync(
        FakeActor([("model.embed_tokens.weight", EMBEDDING)]),
        None,
        transport="broadcast",
        bucket_mb=256,
    )
    with pytest.raises(BucketTooSmallError, match=r"weight_sync\.bucket_mb=260"):
        sync.check_buckets()


def test_largest_tensor_is_read_from_the_model_config(qwen_dir: Path, tmp_path_factory) -> None:
    assert largest_tensor(str(qwen_dir), "bfloat16") == ("model.embed_tokens.weight", EMBEDDING)
    assert largest_tensor(str(tmp_path_factory.mktemp("empty")), "bfloat16") is None


@pytest.mark.skipif(not RECIPES, reason="no GPU recipes shipped")
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: Path(p).name)
def test_gpu_recipes_fit_the_model_and_a_too_small_bucket_is_refused_at_config_time(
    recipe: str, qwen_dir: Path
) -> None:
    cfg = load_config(recipe, [f"model.path={qwen_dir}"])
    assert cfg.weight_sync.bucket_mb is None  # sized from the model at the first sync
    with pytest.raises(
        ConfigError, match=r"weight_sync\.bucket_mb.*259\.7 MiB in bfloat16.*>= 260"
    ):
        load_config(recipe, [f"model.path={qwen_dir}", "weight_sync.bucket_mb=256"])
