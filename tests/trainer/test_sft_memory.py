"""The memory check sizes a file warm start by its demonstrations, not by the RL rollout length:
with the tokenizer's own count, before any worker starts (a line's bytes are no token count:
metadata keys and JSON escapes are never trained, so the config check does not refuse on them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.recipe_models import QWEN2_5_0_5B, config_json
from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.memory import estimate
from trainer.memory_roles import GIB


def record(words: int) -> str:
    text = "x " * words
    return json.dumps(
        {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text}]}
    )


def sft_phase(plan: Any) -> int:
    return max(load.phases.get("sft", 0) for load in plan.devices)


@pytest.fixture(scope="module")
def qwen_05b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_json(tmp_path_factory.mktemp("qwen05b"), QWEN2_5_0_5B)


def gpu_run(qwen_05b: Path, demos: Path, *extra: str) -> list[str]:
    """The reviewer's setup: short RL turns, micro-batches of 2 rows, one 80 GiB GPU."""
    return [
        f"model.path={qwen_05b}",
        "model.dtype=bfloat16",
        "cluster.device_memory_gib=80",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=64",
        "train.micro_batch_size=2",
        "sft.epochs=1",
        "sft.source=file",
        f"sft.path={demos}",
        *extra,
    ]


def test_the_sft_phase_grows_with_the_files_longest_demonstration(
    qwen_05b: Path, tmp_path: Path
) -> None:
    demos = tmp_path / "demos.jsonl"
    demos.write_text(record(10) + "\n")
    cfg = load_config(None, gpu_run(qwen_05b, demos))
    short, long = estimate(cfg, sft_tokens=40), estimate(cfg, sft_tokens=12_000)
    assert sft_phase(long) > sft_phase(short) + 5 * GIB
    rl = {load.phases["train"] for plan in (short, long) for load in plan.devices}
    assert len(rl) == 1  # RL's own phases are sized by the rollouts, as before


def test_bytes_the_warm_start_never_trains_do_not_refuse_a_file_at_load(
    qwen_05b: Path, tmp_path: Path
) -> None:
    """A line's bytes are no token count: keys the loader ignores (here 2 MB of metadata) and
    JSON escapes are never trained, so the config check does not refuse on them; the run counts
    the tokens with the tokenizer before any worker starts (the test below)."""
    demos = tmp_path / "demos.jsonl"
    padded = json.loads(record(10))
    padded["metadata"] = "m" * 2_000_000
    demos.write_text(json.dumps(padded) + "\n")
    load_config(None, gpu_run(qwen_05b, demos))  # no ConfigError


def test_demonstrations_longer_than_estimated_are_refused_before_the_workers_start(
    tmp_path: Path,
) -> None:
    """The config check can only estimate a file's tokens from its bytes; once the tokenizer has
    read the file the run checks again, and refuses before starting a worker when the real
    demonstrations do not fit (here: text the tiny tokenizer spells one token per byte)."""
    from trainer.models import load_tokenizer
    from trainer.pipeline import AgenticPipeline
    from trainer.roles import prepare_policy
    from trainer.rollout.trajectory import ChatRenderer
    from trainer.sft import load_jsonl

    demos = tmp_path / "demos.jsonl"
    demos.write_text(record(5) + "\n" + record(600).replace("x", "~") + "\n")
    common = [
        *TINY,
        "model.tiny.max_position_embeddings=4096",  # room for a demonstration of ~2.4k tokens
        "rollout.max_turns=1",  # rollouts of ~0.6k: the warm start is the largest phase
        "sft.source=file",
        f"sft.path={demos}",
        "train.steps=0",
        f"output_dir={tmp_path / 'run'}",
    ]
    loose = load_config(QUICKSTART, [*common, "cluster.device_memory_gib=100"])
    prepare_policy(loose)  # the estimate then reads the tiny policy's own config.json
    estimated = max(load.total for load in estimate(loose).devices)  # what the config check saw
    renderer = ChatRenderer(load_tokenizer(prepare_policy(loose)))
    longest = max(len(t.token_ids) for t in load_jsonl(demos, renderer))
    real = sft_phase(estimate(loose, sft_tokens=longest))
    assert real > estimated  # the bytes gave too few tokens
    capacity = (estimated + real) / 2 / GIB
    cfg = load_config(QUICKSTART, [*common, f"cluster.device_memory_gib={capacity}"])
    with pytest.raises(ConfigError) as refused:
        AgenticPipeline(cfg)
    message = str(refused.value)
    assert "in the sft phase" in message and "sft.path" in message
    assert f"{longest} tokens" in message
