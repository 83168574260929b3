"""The warm start trains tool calls as the model's chat template writes them: under a template
that renders tools natively in its own syntax (Mistral ``[TOOL_CALLS]``, Llama 3 JSON, Qwen2.5
hermes), the SFT-trained ids of a call are the template's rendering of the structured call, so
the family's parser (``rollout.tool_parser``, ``ChatRenderer.read_turn``) reads them back in RL.
The plain-text protocol (``tool_parser: none``) keeps envhub's ``<tool_call>`` form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from envhub.parsing import parse_tool_calls
from tests.trainer.rollout.test_template_fidelity import (
    LLAMA_SPECIALS,
    MISTRAL,
    MISTRAL_SPECIALS,
    QWEN25,
    with_specials,
)
from trainer.models import env_corpus
from trainer.rollout.chat_messages import dict_arguments
from trainer.rollout.trajectory import ChatRenderer, Trajectory
from trainer.sft import expert_trajectories, load_jsonl

CALC = "tools/calculator-v0"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "abcdefghi",  # nine letters: Mistral's template refuses other ids
    "type": "function",
    "function": {"name": "calculate", "arguments": json.dumps({"expression": "2 + 2"})},
}
RECORD = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "what is 2 + 2"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "4"},
        {"role": "assistant", "content": "It is 4"},
    ],
}
LLAMA31_TOOLS = (
    "{{- bos_token }}{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.tool_calls %}{%- set call = message.tool_calls[0].function %}"
    "{{- '{\"name\": \"' + call.name + '\", \"parameters\": ' + call.arguments | tojson + '}' }}"
    "{%- else %}{{- message['content'] | trim }}{%- endif %}{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3.1's JSON tool calls (abridged): a call is ``{"name": ..., "parameters": {...}}``."""

FAMILIES = {  # template, special tokens, eos, bos, rollout.tool_parser, the call as written
    "mistral": (
        MISTRAL,
        MISTRAL_SPECIALS,
        "</s>",
        "<s>",
        "mistral",
        '[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "2 + 2"}}]</s>',
    ),
    "llama3_json": (
        LLAMA31_TOOLS,
        LLAMA_SPECIALS,
        "<|eot_id|>",
        "<|begin_of_text|>",
        "llama3_json",
        '{"name": "calculate", "parameters": {"expression": "2 + 2"}}<|eot_id|>',
    ),
    "qwen25": (
        QWEN25,
        [],
        "<|im_end|>",
        None,
        "hermes",
        (
            '\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 2"}}\n'
            "</tool_call><|im_end|>"
        ),
    ),
}


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return env_corpus(CALC, episodes=4)


def family_tokenizer(corpus: list[str], family: str) -> Any:
    template, specials, eos, bos, _, _ = FAMILIES[family]
    tokenizer = with_specials(corpus, specials, template)
    tokenizer.eos_token = eos
    if bos:
        tokenizer.bos_token = bos
    return tokenizer


def rows(trajectory: Trajectory) -> list[Any]:
    """What SFT trains: the per-turn samples, or the one sequence."""
    return list(trajectory.samples) or [trajectory]


def trained_turns(row: Any) -> list[list[int]]:
    """The row's trained ids, one list per run of ``response_mask`` ones (one per turn)."""
    turns: list[list[int]] = []
    previous = 0
    for token, mask in zip(row.token_ids, row.response_mask, strict=True):
        if mask and not previous:
            turns.append([])
        if mask:
            turns[-1].append(token)
        previous = mask
    return turns


def calls(turn: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, call.arguments) for call in turn.tool_calls]


def load(tmp_path: Path, renderer: ChatRenderer, record: dict[str, Any] = RECORD) -> Trajectory:
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (trajectory,) = load_jsonl(path, renderer)
    return trajectory


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_recorded_tool_call_trains_the_templates_own_call_syntax(
    corpus, tmp_path: Path, family: str
) -> None:
    tokenizer = family_tokenizer(corpus, family)
    renderer = ChatRenderer(tokenizer, tool_parser=FAMILIES[family][4])
    assert renderer.native_tools
    trajectory = load(tmp_path, renderer)
    turns = [turn for row in rows(trajectory) for turn in trained_turns(row)]
    if trajectory.samples:  # one sample per turn: each trains its own turn only
        assert [len(trained_turns(row)) for row in trajectory.samples] == [1, 1]
    else:
        turns = turns[-2:]
    assert len(turns) == 2
    read = renderer.read_turn(turns[0], TOOLS)
    assert read.error is None
    assert calls(read) == [("calculate", {"expression": "2 + 2"})]
    text = [tokenizer.decode(turn, skip_special_tokens=False) for turn in turns]
    assert text[0] == FAMILIES[family][5]  # the call as the template writes it, end of turn too
    assert text[1].strip().startswith("It is 4")
    assert turns[1][-1] == renderer.end_of_turn_id
    assert calls(renderer.read_turn(turns[1], TOOLS)) == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_trained_rows_are_the_templates_whole_rendering(
    corpus, tmp_path: Path, family: str
) -> None:
    """Nothing is inserted or dropped around the trained call: each row is the template's
    rendering of the conversation up to that turn (as text: the prompt and the answer are
    tokenised apart, as in RL, where the engine writes after the prompt's ids)."""
    tokenizer = family_tokenizer(corpus, family)
    renderer = ChatRenderer(tokenizer, tool_parser=FAMILIES[family][4])
    trajectory = load(tmp_path, renderer)
    messages = [dict_arguments(m) for m in RECORD["messages"]]  # as vLLM and HF pass calls
    ends = [2, 4] if trajectory.samples else [4]
    for row, end in zip(rows(trajectory), ends, strict=True):
        text = tokenizer.apply_chat_template(messages[:end], tools=TOOLS, tokenize=False)
        assert text.startswith(tokenizer.decode(row.token_ids, skip_special_tokens=False))
        assert row.token_ids[-1] == renderer.end_of_turn_id
        prompt = messages[: end - 1] if trajectory.samples else messages[:1]
        assert row.token_ids[: row.prompt_length] == renderer.prompt(prompt, TOOLS)


def test_the_plain_text_protocol_keeps_the_tool_call_tags(corpus, tmp_path: Path) -> None:
    tokenizer = family_tokenizer(corpus, "mistral")
    renderer = ChatRenderer(tokenizer, tool_parser="none")
    assert not renderer.native_tools
    trajectory = load(tmp_path, renderer)
    first = trained_turns(rows(trajectory)[0])[0]
    text = tokenizer.decode(first, skip_special_tokens=False)
    call = '<tool_call>{"arguments": {"expression": "2 + 2"}, "name": "calculate"}</tool_call>'
    assert text == f" {call}</s>"  # as before: the content answer of the call's text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_experts_tool_call_text_trains_the_templates_call_syntax(corpus, family: str) -> None:
    """The expert writes envhub's ``<tool_call>`` text; the warm start trains that call as the
    template renders it, and keeps it in the transcript as a structured call."""
    tokenizer = family_tokenizer(corpus, family)
    renderer = ChatRenderer(tokenizer, tool_parser=FAMILIES[family][4])
    (demo,) = expert_trajectories([CALC], {}, renderer, episodes=1, max_turns=6)
    assert demo.success
    tools = demo.info["tools"]
    assistant = [m for m in demo.messages if m["role"] == "assistant"]
    turns = [turn for row in rows(demo) for turn in trained_turns(row)]
    assert len(turns) == len(assistant)
    expected = [[(c.name, c.arguments) for c in parse_tool_calls(m["content"])] for m in assistant]
    assert any(expected) is False  # the calls left the content ...
    structured = [
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
        for m in assistant
        if m.get("tool_calls")
    ]
    assert structured  # ... for structured tool_calls
    read = [calls(renderer.read_turn(turn, tools)) for turn in turns]
    assert [r for r in read if r] == structured
    assert all(turn[-1] == renderer.end_of_turn_id for turn in turns)
