"""rollout.tool_parser: each model family's tool-call syntax becomes the same structured calls,
malformed calls become an error on the turn (never an exception), and the env reads one form."""

from __future__ import annotations

import importlib.util

import pytest

from envhub.parsing import ToolCallParser
from trainer.rollout.tool_parsers import detect_tool_parser, env_action, make_tool_parser

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
ADD = {"name": "add", "arguments": {"a": 1, "b": 2}}

WELL_FORMED = {
    "hermes": (
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
        "</tool_call>"
    ),
    "llama3_json": (
        'Let me check.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
        '"days": 2}}; {"name": "add", "parameters": {"a": 1, "b": 2}}'
    ),
    "mistral": (
        'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]'
    ),
    "pythonic": '[get_weather(city="Paris", days=2), add(a=1, b=2)]',
}


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_every_family_reads_the_same_calls(name: str) -> None:
    turn = make_tool_parser(name, prefer_vllm=False).parse(WELL_FORMED[name])
    assert turn.error is None
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        (WEATHER["name"], WEATHER["arguments"]),
        (ADD["name"], ADD["arguments"]),
    ]
    assert [c.id for c in turn.tool_calls] == ["call_0", "call_1"]  # the ids the env answers
    assert turn.content == ("" if name == "pythonic" else "Let me check.")
    message = turn.message()
    assert message["role"] == "assistant"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "add"]


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_a_tool_env_reads_the_calls_whatever_the_family(name: str) -> None:
    """``env_action`` writes calls in envhub's form, which every built-in tool env parses."""
    action = env_action(make_tool_parser(name, prefer_vllm=False).parse(WELL_FORMED[name]))
    calls = ToolCallParser().parse(action)
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("add", {"a": 1, "b": 2}),
    ]


MALFORMED = {
    "hermes": '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": [1, 2]}',
    "mistral": "[TOOL_CALLS][{'oops'",
    "pythonic": "[add(a=1, b=undefined_name)]",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_call_is_an_error_on_the_turn_and_the_env_gets_the_raw_text(
    name: str,
) -> None:
    text = MALFORMED[name]
    turn = make_tool_parser(name, prefer_vllm=False).parse(text)
    assert turn.error and not turn.tool_calls
    assert turn.content == text and env_action(turn) == text
    assert "tool_calls" not in turn.message()


def test_plain_answers_have_no_calls_and_pass_through() -> None:
    for name in [*WELL_FORMED, "none"]:
        turn = make_tool_parser(name, prefer_vllm=False).parse("<answer>42</answer>")
        assert turn.error is None and not turn.tool_calls
        assert env_action(turn) == "<answer>42</answer>"


def test_calls_beyond_the_cap_are_an_error() -> None:
    text = "".join(
        f'<tool_call>{{"name": "add", "arguments": {{"a": {i}}}}}</tool_call>' for i in range(20)
    )
    turn = make_tool_parser("hermes", prefer_vllm=False, max_calls=4).parse(text)
    assert not turn.tool_calls and "at most 4" in (turn.error or "")


def test_a_megabyte_of_call_json_is_read_or_refused_without_raising() -> None:
    huge = '<tool_call>{"name": "add", "arguments": {"a": "' + "x" * 1_000_000 + '"}}</tool_call>'
    turn = make_tool_parser("hermes", prefer_vllm=False).parse(huge)
    assert turn.error is None and len(turn.tool_calls[0].arguments["a"]) == 1_000_000
    cut = make_tool_parser("hermes", prefer_vllm=False).parse(huge[:500_000])
    assert cut.error and not cut.tool_calls


def test_unknown_parser_names_the_choices_and_the_closest() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'hermes'\?.*choices: auto, hermes"):
        make_tool_parser("hermess")


def test_auto_reads_the_template() -> None:
    assert detect_tool_parser(None) == "none"
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") == "none"
    assert detect_tool_parser("{% if tools %}<tool_call>{{ tools }}{% endif %}") == "hermes"
    assert detect_tool_parser("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_tool_parser("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_parsers_are_used_when_installed_and_read_the_same_calls() -> None:
    """With vLLM present, its own parser of the family is used where the tokenizer fits it, it
    reads what the embedded one reads, and a malformed call is flagged the same way; where
    vLLM needs a special token the tokenizer lacks, the embedded parser takes over."""
    from trainer.models import build_tokenizer

    tokenizer = build_tokenizer(["get_weather Paris add"], kind="char")
    parser = make_tool_parser("hermes", tokenizer)
    assert type(parser).__name__ == "_VLLMParser"
    turn = parser.parse(WELL_FORMED["hermes"])
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert turn.content == "Let me check."
    bad = parser.parse(MALFORMED["hermes"])
    assert bad.error and not bad.tool_calls and env_action(bad) == MALFORMED["hermes"]
    # vLLM's llama3_json parser looks up <|python_tag|> in the vocabulary: not in this one
    assert type(make_tool_parser("llama3_json", tokenizer)).__name__ == "_Llama3Json"
