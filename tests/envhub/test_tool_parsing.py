"""Tool-call parsing: lenient about form, strict about meaning, clear feedback."""

from __future__ import annotations

import pytest

from envhub.core import function_tool
from envhub.errors import ActionParseError
from envhub.parsing import (
    ToolCall,
    ToolCallParser,
    format_tool_call,
    message_text,
    parse_tool_calls,
)

TOOLS = (
    function_tool(
        "calculate",
        "Evaluate arithmetic.",
        {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    ),
    function_tool(
        "lookup",
        "Look a key up.",
        {
            "type": "object",
            "properties": {
                "key": {"type": "string"},
                "limit": {"type": "integer"},
                "mode": {"type": "string", "enum": ["a", "b"]},
            },
            "required": ["key"],
        },
    ),
)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "calculate", "arguments": {"expression": "1+2"}}</tool_call>',
        (
            'Let me compute.\n<tool_call>\n```json\n{"name": "calculate", "arguments": '
            '{"expression": "1+2"},}\n```\n</tool_call>'
        ),
        "<TOOL_CALL>{'name': 'calculate', 'arguments': {'expression': '1+2'}}</TOOL_CALL>",
        (
            '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": '
            '\\"1+2\\"}"}</tool_call>'
        ),
        (
            '<tool_call>{"type": "function", "function": {"name": "calculate", "arguments": '
            '{"expression": "1+2"}}}</tool_call>'
        ),
        '<tool_call>{"name": "calculate", "arguments": {"expression": "1+2"}}',
    ],
)
def test_lenient_forms_parse_to_the_same_call(text):
    assert parse_tool_calls(text, TOOLS) == [
        ToolCall("calculate", {"expression": "1+2"}, "call00000")
    ]


def test_several_calls_in_tags_or_one_list_keep_their_order_and_ids():
    two_tags = (
        format_tool_call("calculate", {"expression": "2*3"})
        + " then "
        + format_tool_call("lookup", {"key": "x"})
    )
    one_list = (
        '<tool_call>[{"name": "calculate", "arguments": {"expression": "2*3"}}, {"name": '
        '"lookup", "arguments": {"key": "x"}}]</tool_call>'
    )
    for text in (two_tags, one_list):
        calls = parse_tool_calls(text, TOOLS)
        assert [(c.name, c.id) for c in calls] == [
            ("calculate", "call00000"),
            ("lookup", "call00001"),
        ]


def test_text_without_a_call_gives_no_calls():
    assert parse_tool_calls("The answer is <answer>4</answer>", TOOLS) == []


@pytest.mark.parametrize(
    "text, feedback",
    [
        (
            '<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>',
            "not valid JSON",
        ),
        ("<tool_call></tool_call>", "was empty"),
        (
            '<tool_call>{"name": "calculat", "arguments": {"expression": "1"}}</tool_call>',
            "Did you mean 'calculate'?",
        ),
        ('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', "needs the argument(s) key"),
        (
            '<tool_call>{"name": "lookup", "arguments": {"key": "x", "limit": "3"}}</tool_call>',
            "'limit' of 'lookup' must be of type integer",
        ),
        (
            '<tool_call>{"name": "lookup", "arguments": {"key": "x", "limit": true}}</tool_call>',
            "must be of type integer",
        ),
        (
            '<tool_call>{"name": "lookup", "arguments": {"key": "x", "mode": "c"}}</tool_call>',
            "must be one of ['a', 'b']",
        ),
        (
            '<tool_call>{"name": "lookup", "arguments": {"key": "x", "colour": 1}}</tool_call>',
            "has no argument(s) colour",
        ),
        ('<tool_call>{"arguments": {"key": "x"}}</tool_call>', 'with "name" and "arguments"'),
        ('<tool_call>{"name": "lookup", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ],
)
def test_malformed_calls_explain_the_fix(text, feedback):
    with pytest.raises(ActionParseError) as caught:
        parse_tool_calls(text, TOOLS)
    assert feedback in caught.value.feedback


def test_too_many_calls_are_refused():
    text = format_tool_call("calculate", {"expression": "1"}) * 3
    with pytest.raises(ActionParseError, match="exceed max_calls=2"):
        ToolCallParser(tools=TOOLS, max_calls=2).parse(text)


def test_without_schemas_any_name_passes_and_instructions_show_the_format():
    assert parse_tool_calls('<tool_call>{"name": "anything"}</tool_call>') == [
        ToolCall("anything", {}, "call00000")
    ]
    assert '<tool_call>{"name": "calculate"' in ToolCallParser(tools=TOOLS).instructions


def test_call_ids_are_nine_letters_and_digits_numbered_in_order():
    """Mistral's chat template and API refuse any other id; numbered, not random, so a replayed
    or resumed episode gets the same ids."""
    ids = [ToolCall.numbered_id(i) for i in (0, 1, 9, 10, 35, 36, 36**5 - 1)]
    assert ids == [
        "call00000",
        "call00001",
        "call00009",
        "call0000a",
        "call0000z",
        "call00010",
        "callzzzzz",
    ]
    assert ToolCall("calculate", {}).id == "call00000"
    with pytest.raises(ValueError, match="at most 60466175"):
        ToolCall.numbered_id(36**5)


def test_openai_message_form_round_trips():
    call = ToolCall("lookup", {"key": "x"}, "call_3")
    assert call.as_message() == {
        "id": "call_3",
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"key": "x"}'},
    }


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def structured(arguments) -> dict:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculate", "arguments": arguments},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.mark.parametrize(
    "text, feedback",
    [
        (f"<tool_call>{nested(1_500)}</tool_call>", "nested more than 32 levels deep"),
        (
            '<tool_call>{"name": "calculate", "arguments": {"expression": '
            + nested(500)
            + "}}</tool_call>",
            "nested more than 32 levels deep",
        ),
        (
            '<tool_call>{"name": "calculate", "arguments": {"expression": "\\udcff"}}</tool_call>',
            "arguments.expression contains '\\udcff', a lone surrogate",
        ),
        (
            '<tool_call>{"name": "calculate", "arguments": {"expression": "'
            + "1" * 2_000_001
            + '"}}</tool_call>',
            "too long (2000",
        ),
    ],
    ids=["deep", "deep-argument", "surrogate", "too-long"],
)
def test_hostile_json_is_refused_with_feedback(text, feedback):
    with pytest.raises(ActionParseError) as caught:
        parse_tool_calls(text, TOOLS)
    assert feedback in caught.value.feedback


@pytest.mark.parametrize(
    "arguments, feedback",
    [
        (nested(1_500), "nested more than 32 levels deep"),
        ('{"expression": "\\udcff"}', "expression contains '\\udcff'"),
        ({"expression": "\udcff"}, "expression contains '\\udcff'"),
    ],
    ids=["deep-text", "surrogate-text", "surrogate-data"],
)
def test_hostile_structured_arguments_are_refused_and_still_printable(arguments, feedback):
    message = structured(arguments)
    with pytest.raises(ActionParseError) as caught:
        ToolCallParser(tools=TOOLS).parse_message(message)
    assert feedback in caught.value.feedback
    assert "calculate" in message_text(message)  # the transcript form never raises


def test_message_text_writes_arguments_too_deep_for_json():
    deep: list = []
    for _ in range(5_000):
        deep = [deep]
    text = message_text(structured({"expression": deep}))
    assert text.startswith("<tool_call>") and "cannot be written as JSON" in text


@pytest.mark.parametrize(
    "text, feedback",
    [
        ('<tool_call>{"name": "f", "arguments": {[1]: 2}}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {"a": {[1]}}}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {("a",): 1}}</tool_call>', "keys must be strings"),
        ("<tool_call>{'name': 'f', 'arguments': {1: 2}}</tool_call>", "keys must be strings"),
        ("<tool_call>{'name': 'f', 'arguments': {'a': {1, 2}}}</tool_call>", "write a list"),
        ("<tool_call>{'name': 'f', 'arguments': {'a': b'x'}}</tool_call>", "write a string"),
        ("<tool_call>{'name': 'f', 'arguments': {'a': 1j}}</tool_call>", "write a number"),
        (
            '<tool_call>{"name": "f", "arguments": "{\'a\': {1, 2}}"}</tool_call>',
            "write a list",
        ),
    ],
    ids=["list-key", "list-in-set", "tuple-key", "int-key", "set", "bytes", "complex", "args"],
)
def test_python_literals_json_cannot_write_are_refused_with_feedback(text, feedback):
    """The Python-literal fallback reads only what JSON can hold, so a call never carries a value
    that fails when written back (``as_message``, ``format_tool_call``)."""
    with pytest.raises(ActionParseError) as caught:
        parse_tool_calls(text)
    assert feedback in caught.value.feedback


def test_python_literal_tuples_are_read_as_lists():
    (call,) = parse_tool_calls("<tool_call>{'name': 'f', 'arguments': {'a': (1, 2)}}</tool_call>")
    assert call.arguments == {"a": [1, 2]}


@pytest.mark.parametrize(
    "text",
    [
        (
            '<think>Try <tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>.'
            "</think>The answer is 4."
        ),
        # a template that writes <think> itself: the turn opens inside thinking
        (
            'Maybe <tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>?\n'
            "</think>\nThe answer is 4."
        ),
    ],
    ids=["closed", "prefilled-think"],
)
def test_a_call_only_mentioned_in_thinking_is_not_a_call(text):
    assert parse_tool_calls(text, TOOLS) == []


def test_a_call_after_thinking_is_read():
    text = (
        '<think>Not <tool_call>{"name": "calculate", "arguments": {}}</tool_call>.</think>'
        '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, TOOLS)] == [
        ("lookup", {"key": "x"})
    ]


def test_a_closing_tag_inside_a_json_string_does_not_cut_the_call():
    text = (
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "a </tool_call> b"}}\n</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {"key": "</tool_call>"}}'
    )
    calls = parse_tool_calls(text, TOOLS)
    assert [c.arguments for c in calls] == [{"key": "a </tool_call> b"}, {"key": "</tool_call>"}]
    assert [c.id for c in calls] == ["call00000", "call00001"]


@pytest.mark.parametrize(
    ("text", "thinking"),
    [
        ("a</think>b", ["a</think>"]),  # the generation prompt opened it (DeepSeek-R1)
        ("a</think>b<think>c</think>d", ["a</think>", "<think>c</think>"]),
        ("<think>a</think>b</think>c", ["<think>a</think>"]),  # a later stray close is text
        ("a <think>b", []),  # unclosed: no thinking ends
        ("a", []),
    ],
    ids=["prefilled", "prefilled-then-block", "stray-close", "unclosed", "plain"],
)
def test_thinking_spans_include_reasoning_the_template_opened(text, thinking):
    from envhub.tool_calls import thinking_spans

    assert [text[start:end] for start, end in thinking_spans(text)] == thinking
