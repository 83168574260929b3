"""Tool schemas are checked once (shape, unique names, valid JSON Schema) and call arguments are
checked against them in full (nested objects, items, bounds): a bad call is feedback to the model,
a bad schema a clear error for the env's author, never a crash in the parser."""

from __future__ import annotations

import copy

import pytest

import envhub
from envhub.core import Turn, function_tool
from envhub.errors import ActionParseError, ToolSchemaError
from envhub.parsing import ToolCallParser, parse_tool_calls
from envhub.tool_schemas import arguments_validator, check_tools

MOVE = function_tool(
    "move",
    "Move to a point.",
    {
        "type": "object",
        "properties": {
            "to": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "steps": {"type": "array", "items": {"type": "integer"}},
            "speed": {"type": "number", "minimum": 0, "maximum": 10},
            "mode": {"type": "string", "enum": ["walk", "run"]},
        },
        "required": ["to"],
    },
)


def call(arguments: str) -> str:
    return f'<tool_call>{{"name": "move", "arguments": {arguments}}}</tool_call>'


@pytest.mark.parametrize(
    "arguments, feedback",
    [
        ('{"to": {"x": "left", "y": 1}}', "Argument 'to.x' of 'move' must be of type integer"),
        ('{"to": {"x": 1}}', "Argument 'to' of 'move' needs the field(s) y"),
        ('{"to": {"x": 1, "y": 2, "z": 3}}', "Argument 'to' of 'move' has no field(s) z"),
        ('{"to": {"x": 1, "y": 2}, "steps": [1, "a"]}', "'steps[1]' of 'move' must be of type"),
        ('{"to": {"x": 1, "y": 2}, "speed": -5}', "-5 is less than the minimum of 0"),
        ('{"to": {"x": 1, "y": 2}, "speed": 11}', "11 is greater than the maximum of 10"),
        ('{"to": {"x": 1.5, "y": 2}}', "must be of type integer, got 1.5"),
        ('{"to": {"x": 1, "y": 2}, "mode": "fly"}', "must be one of ['walk', 'run']"),
    ],
    ids=["nested-type", "nested-required", "nested-extra", "items", "min", "max", "float", "enum"],
)
def test_nested_and_bounded_arguments_are_checked_with_feedback(arguments, feedback):
    with pytest.raises(ActionParseError) as caught:
        parse_tool_calls(call(arguments), [MOVE])
    assert feedback in caught.value.feedback, caught.value.feedback
    assert len(caught.value.feedback) < 400  # short enough to help a model, not drown it


def test_valid_nested_arguments_pass_unchanged():
    arguments = {"to": {"x": 1, "y": -2}, "steps": [1, 2], "speed": 2.5, "mode": "run"}
    (parsed,) = parse_tool_calls(call(str(arguments).replace("'", '"')), [MOVE])
    assert parsed.arguments == arguments


@pytest.mark.parametrize(
    "arguments",
    ['{"to": {"x": 1, "y": 2}, "speed": NaN}', '{"to": {"x": 1, "y": 2}, "speed": Infinity}']
    + ['{"to": {"x": 1, "y": 2}, "speed": -Infinity}', '{"to": {"x": 1, "y": 2}, "speed": 1e999}'],
    ids=["nan", "inf", "-inf", "overflow"],
)
def test_nan_and_infinity_are_refused_as_not_json_numbers(arguments):
    with pytest.raises(ActionParseError) as caught:
        parse_tool_calls(call(arguments), [MOVE])
    assert "speed" in caught.value.feedback
    assert "finite number" in caught.value.feedback


def test_nan_in_structured_arguments_is_refused_too():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "move", "arguments": {"to": {"x": float("nan")}}}}],
    }
    with pytest.raises(ActionParseError, match="finite number"):
        ToolCallParser(tools=(MOVE,)).parse_message(message)


def test_explicit_additional_properties_true_accepts_extra_top_level_arguments():
    tool = function_tool(
        "log",
        "Log fields.",
        {"type": "object", "properties": {"msg": {"type": "string"}}, "additionalProperties": True},
    )
    (parsed,) = parse_tool_calls(
        '<tool_call>{"name": "log", "arguments": {"msg": "hi", "level": 3}}</tool_call>', [tool]
    )
    assert parsed.arguments == {"msg": "hi", "level": 3}


BAD_TOOLS = [
    function_tool(
        "add numbers",
        "Add.",
        {"type": "objekt", "properties": {"a": {"type": "int"}}, "required": "a"},
    ),
    {"type": "function", "function": {"description": "no name"}},
    function_tool("add", "duplicate name", ["not", "a", "schema"]),  # type: ignore[arg-type]
    function_tool("add", "twice", {"type": "object"}),
    {"name": "bare", "parameters": {"type": "object"}},
]


def test_every_problem_of_invalid_tools_is_named():
    problems = check_tools(BAD_TOOLS)
    text = "\n".join(problems)
    assert "tools[0] 'add numbers': the name" in text  # a space: no model can call it reliably
    assert "tools[0] 'add numbers'.parameters.type" in text
    assert "tools[0] 'add numbers'.parameters.properties.a.type" in text
    assert "tools[0] 'add numbers'.parameters.required" in text
    assert "tools[1]: function.name is missing" in text
    assert "tools[2] 'add'.parameters: must be a JSON Schema object" in text
    assert "tools[3] 'add': the name 'add' is used by tools[2] too" in text
    assert 'tools[4]: must be {"type": "function", "function": {...}}' in text
    assert check_tools([MOVE]) == []


def test_a_parser_given_invalid_tools_fails_clearly_instead_of_crashing_on_a_call():
    for tools in ([BAD_TOOLS[1]], [BAD_TOOLS[2]], [BAD_TOOLS[0]]):
        with pytest.raises(ToolSchemaError, match=r"tools\[0\]"):
            ToolCallParser(tools=tuple(tools))


class BadToolsEnv(envhub.TextEnv):
    tools = BAD_TOOLS[:2]

    def on_reset(self, options):
        return "Use the tools.", {}

    def on_step(self, action):
        return Turn("ok", terminated=True)


def test_an_env_with_invalid_tools_fails_at_reset_naming_the_class_and_the_fix():
    env = BadToolsEnv()
    with pytest.raises(ToolSchemaError) as caught:
        env.reset(seed=0)
    message = str(caught.value)
    assert message.startswith("BadToolsEnv.tools")
    assert "tools[1]: function.name is missing" in message
    assert "envhub.function_tool" in message


def test_the_checker_reports_invalid_tools():
    report = envhub.check_env(BadToolsEnv(), raise_on_failure=False)
    assert not report.ok
    assert any("BadToolsEnv.tools" in failure.message for failure in report.failures)


def test_compiled_validators_are_shared_by_equal_schemas():
    schema = MOVE["function"]["parameters"]
    assert arguments_validator(schema) is arguments_validator(copy.deepcopy(schema))


FLAT = {
    "type": "object",
    "title": "args",
    "properties": {
        "n": {"type": "integer", "description": "a count"},
        "x": {"type": ["number", "null"]},
        "flag": {"type": "boolean"},
        "mode": {"enum": ["a", 1, None]},
        "any": {},
    },
    "required": [],
}
VALUES = ["s", 0, 1, 1.0, 1.5, True, False, None, [], {}, [1], {"k": 1}]


@pytest.mark.parametrize("key", sorted(FLAT["properties"]))
def test_the_fast_check_of_flat_schemas_agrees_with_jsonschema(key):
    """Flat schemas (types and scalar enums, the common case) skip jsonschema for speed; every
    verdict must be the one jsonschema (with integers as ints) gives."""
    from envhub.tool_schemas import _FlatCheck, _SchemaCheck

    fast, full = _FlatCheck.compile(FLAT), _SchemaCheck(FLAT)
    assert fast is not None and arguments_validator(FLAT).__class__ is _FlatCheck
    for value in VALUES:
        arguments = {key: value}
        fast_verdict = fast.problem("t", arguments) is None
        assert fast_verdict == (full.problem("t", arguments) is None), (key, value)


def test_schemas_beyond_the_flat_form_use_jsonschema():
    from envhub.tool_schemas import _SchemaCheck

    assert isinstance(arguments_validator(MOVE["function"]["parameters"]), _SchemaCheck)
