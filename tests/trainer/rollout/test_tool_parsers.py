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
    # the ids the env answers: 9 letters and digits, as Mistral's template and API take
    assert [c.id for c in turn.tool_calls] == ["call00000", "call00001"]
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


HOSTILE = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {[1]: 2}}</tool_call>', "not valid JSON"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": {[1]}}}</tool_call>', "JSON"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {("a",): 1}}</tool_call>', "string"),
    ("hermes", "<tool_call>{'name': 'f', 'arguments': {'a': {1, 2}}}</tool_call>", "list"),
    ("mistral", "[TOOL_CALLS]" + "[" * 100_000, "nested too deeply"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": "' + "[" * 100_000 + '"}]', "deeply"),
    ("llama3_json", '{"name": "f", "parameters": ' + "[" * 100_000 + "}", "nested too deeply"),
    ("llama3_json", "<|python_tag|>" + "[" * 100_000, "nested too deeply"),
    ("pythonic", "[f(a={1, 2})]", "list"),
    ("pythonic", "[f(a=b'x')]", "string"),
    ("pythonic", "[f(a=1j)]", "number"),
    ("pythonic", '[f(a=1, **{"b": 2})]', "name=value"),
    ("pythonic", "[f(a={[1]: 2})]", "literals"),
    ("pythonic", "[f(a={1: 2})]", "string"),
    ("pythonic", '[f(a="x\x00")]', "not Python"),
    ("pythonic", "[f(a=" + "-" * 100_000 + "1)]", "not Python"),
    ("pythonic", "[f(a=" + "-" * 1_000 + "1)]", "must be one of the literals JSON holds"),
]


@pytest.mark.parametrize(
    "name, text, hint", HOSTILE, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(HOSTILE)]
)
def test_hostile_call_text_is_an_error_on_the_turn_never_an_exception(
    name: str, text: str, hint: str
) -> None:
    """Whatever the model writes, the turn comes back (the episode, its group and the eval go
    on) with an ``error`` that tells the model what to write, and the env gets the raw text."""
    turn = make_tool_parser(name, prefer_vllm=False).parse(text)
    assert turn.error and not turn.tool_calls
    assert hint in turn.error
    assert turn.message() == {"role": "assistant", "content": text}
    assert env_action(turn) == text


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
@pytest.mark.parametrize(
    "name, text, hint", HOSTILE, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(HOSTILE)]
)
def test_hostile_call_text_never_raises_out_of_the_vllm_wrapped_parser(
    name: str, text: str, hint: str
) -> None:
    """The parser the renderer builds (vLLM's, falling back to the embedded one when vLLM finds
    no call) turns the same text into an error, never an exception, and never a call whose
    arguments cannot be written back."""
    from tokenizers import AddedToken

    from trainer.models import build_tokenizer

    tokenizer = build_tokenizer(["name arguments parameters f a"] * 10, kind="bpe")
    tags = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
    tokenizer.add_tokens([AddedToken(t, special=False) for t in tags])
    turn = make_tool_parser(name, tokenizer).parse(text)
    turn.message()
    action = env_action(turn)
    assert turn.error or (action != text and ToolCallParser().parse(action))


@pytest.mark.parametrize(
    "name, text, calls, content",
    [
        (
            "llama3_json",
            '<|python_tag|>{"name": "sql", "parameters": {"query": "SELECT 1; SELECT 2"}}',
            [("sql", {"query": "SELECT 1; SELECT 2"})],
            "",
        ),
        (
            "llama3_json",
            (
                '<|python_tag|>{"name": "a", "parameters": {"s": ";"}} ; {"name": "b", '
                '"parameters": {}};'
            ),
            [("a", {"s": ";"}), ("b", {})],
            "",
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Paris"}} I will wait for the result.',
            [("get_weather", {"city": "Paris"})],
            "I will wait for the result.",
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] Done.',
            [("f", {"a": 1})],
            "Done.",
        ),
        (
            "hermes",
            (
                '<tool_call>{"name": "write", "arguments": {"text": "close with </tool_call>"}}'
                "</tool_call>"
            ),
            [("write", {"text": "close with </tool_call>"})],
            "",
        ),
        (
            "hermes",
            (
                '<think>Use <tool_call>{"name": "no", "arguments": {}}</tool_call>?</think>Sure.\n'
                '<tool_call>{"name": "yes", "arguments": {}}</tool_call>'
            ),
            [("yes", {})],
            '<think>Use <tool_call>{"name": "no", "arguments": {}}</tool_call>?</think>Sure.',
        ),
    ],
    ids=[
        "llama3-semicolon-in-string",
        "llama3-several",
        "llama3-bare-then-prose",
        "mistral-then-prose",
        "hermes-closing-tag-in-string",
        "hermes-call-after-thinking",
    ],
)
def test_calls_are_read_as_the_model_wrote_them(
    name: str, text: str, calls: list[tuple[str, dict]], content: str
) -> None:
    turn = make_tool_parser(name, prefer_vllm=False).parse(text)
    assert turn.error is None
    assert [(c.name, c.arguments) for c in turn.tool_calls] == calls
    assert turn.content == content
    assert [(c.name, c.arguments) for c in ToolCallParser().parse(env_action(turn))] == calls


def test_pythonic_positional_arguments_are_an_error_not_dropped() -> None:
    turn = make_tool_parser("pythonic", prefer_vllm=False).parse("[add(1, 2)]")
    assert not turn.tool_calls and env_action(turn) == "[add(1, 2)]"
    assert "use keyword arguments: add(x=1)" in (turn.error or "")


def test_pythonic_tuples_reach_the_tool_as_the_lists_a_json_schema_accepts() -> None:
    from jsonschema import Draft202012Validator

    [call] = make_tool_parser("pythonic", prefer_vllm=False).parse("[f(at=(1, 2))]").tool_calls
    assert call.arguments == {"at": [1, 2]}
    assert Draft202012Validator({"type": "array"}).is_valid(call.arguments["at"])


def test_a_hermes_call_only_mentioned_in_thinking_does_not_run() -> None:
    text = (
        '<think>The format is <tool_call>{"name": "delete_all", "arguments": {}}</tool_call>, '
        "but I will not call it.</think>The answer is 4."
    )
    turn = make_tool_parser("hermes", prefer_vllm=False).parse(text)
    assert turn.error is None and not turn.tool_calls and turn.content == text
    assert env_action(turn) == text and ToolCallParser().parse(text) == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_hermes_does_not_run_a_call_only_mentioned_in_thinking() -> None:
    from trainer.models import build_tokenizer

    tokenizer = build_tokenizer(["get_weather Paris add"], kind="char")
    parser = make_tool_parser("hermes", tokenizer)
    assert type(parser).__name__ == "_VLLMParser"
    text = '<think>Maybe <tool_call>{"name": "delete_all", "arguments": {}}</tool_call>.</think>No.'
    turn = parser.parse(text)
    assert turn.error is None and not turn.tool_calls and env_action(turn) == text
