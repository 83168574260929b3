"""Warm-start data: expert demonstrations and JSONL files become masked trajectories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.conftest import LAKE, LAKE_KWARGS
from trainer.errors import TrainerError
from trainer.rollout.trajectory import ChatRenderer
from trainer.sft import expert_trajectories, load_jsonl, write_jsonl


def test_expert_demos_succeed_and_mask_only_the_answers(policy, tmp_path: Path) -> None:
    _, tokenizer = policy
    renderer = ChatRenderer(tokenizer)
    demos = expert_trajectories([LAKE], LAKE_KWARGS, renderer, episodes=5, max_turns=8)
    assert all(t.success for t in demos)  # Frozen Lake's expert walks a shortest safe path
    for t in demos:
        answers = [
            tokenizer.decode([i for i, m in zip(t.token_ids, t.response_mask, strict=True) if m])
        ]
        moves = [m["content"] for m in t.messages if m["role"] == "assistant"]
        assert answers[0] == "<|im_end|>".join(moves) + "<|im_end|>"
    path = write_jsonl(demos, tmp_path / "demos.jsonl")
    again = load_jsonl(path, renderer)
    # the file round trip rebuilds identical token ids and masks (rendering is deterministic)
    assert [t.token_ids for t in again] == [t.token_ids for t in demos]
    assert [t.response_mask for t in again] == [t.response_mask for t in demos]


def test_bad_jsonl_names_the_line(policy, tmp_path: Path) -> None:
    renderer = ChatRenderer(policy[1])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{not json\n")
    with pytest.raises(
        TrainerError, match="bad.jsonl:1: the conversation has no assistant message"
    ):
        load_jsonl(bad, renderer)
    with pytest.raises(TrainerError, match="does not exist"):
        load_jsonl(tmp_path / "missing.jsonl", renderer)
