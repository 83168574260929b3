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


USER = {"role": "user", "content": "x"}
ANSWER = {"role": "assistant", "content": "up"}


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ([1, 2], 'must be a JSON object with "messages"'),
        ({"messages": "hello"}, '"messages" must be a list of messages, got str'),
        ({"messages": None}, '"messages" must be a list of messages, got NoneType'),
        ({"messages": ["hi", ANSWER]}, "messages[0] must be an object"),
        ({"messages": [{"content": "x"}, ANSWER]}, 'messages[0] has no "role"'),
        (
            {"messages": [{"role": "robot", "content": "x"}, ANSWER]},
            "messages[0].role 'robot' is not a chat role; use one of system, developer, user",
        ),
        ({"messages": [USER, {"role": "assistant", "content": 5}]}, "messages[1].content"),
        ({"seed": "abc", "messages": [USER, ANSWER]}, '"seed" must be an integer'),
        ({"tools": "nope", "messages": [USER, ANSWER]}, '"tools" must be a list'),
        (
            {"messages": [USER, {"role": "assistant", "content": [{"type": "image_url"}]}]},
            "messages[1].content[0] is a 'image_url' part without text; only text parts",
        ),
    ],
)
def test_a_malformed_record_is_refused_naming_its_line_and_problem(
    policy, tmp_path: Path, record: object, problem: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [USER, ANSWER]}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(TrainerError) as refused:
        load_jsonl(bad, ChatRenderer(policy[1]))
    assert str(refused.value).startswith(f"{bad}:2: ")
    assert problem in str(refused.value)


def test_content_parts_are_trained_as_their_text(policy, tmp_path: Path) -> None:
    """OpenAI's list-of-parts content trains the joined text, not the list's Python repr."""
    _, tokenizer = policy
    parts = {"role": "assistant", "content": [{"type": "text", "text": "up"}]}
    path = tmp_path / "parts.jsonl"
    path.write_text(json.dumps({"messages": [USER, parts]}) + "\n")
    [trajectory] = load_jsonl(path, ChatRenderer(tokenizer))
    trained = [i for i, m in zip(trajectory.token_ids, trajectory.response_mask, strict=True) if m]
    assert tokenizer.decode(trained) == "up<|im_end|>"


def test_a_record_longer_than_the_context_is_refused_naming_its_line(
    policy, tmp_path: Path
) -> None:
    long_user = {"role": "user", "content": "left " * 400}
    path = tmp_path / "long.jsonl"
    path.write_text(
        json.dumps({"messages": [USER, ANSWER]})
        + "\n"
        + json.dumps({"messages": [long_user, ANSWER]})
        + "\n"
    )
    with pytest.raises(TrainerError) as refused:
        load_jsonl(path, ChatRenderer(policy[1]), max_tokens=256)
    message = str(refused.value)
    assert message.startswith(f"{path}:2: the conversation is ")
    assert "longer than the model's context of 256 tokens" in message
    assert len(load_jsonl(path, ChatRenderer(policy[1]))) == 2  # without a limit it loads
