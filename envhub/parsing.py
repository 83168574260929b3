"""Pull the action out of a model's chatty text.

Models think aloud, repeat the format instructions, wrap answers in code fences and change
case. ``ActionParser`` finds the action robustly and, when it cannot, raises
``ActionParseError`` whose ``feedback`` tells the model exactly what format to use.

Formats
-------
``"tag"`` (default)
    The content of the *last* ``<answer>...</answer>`` block (tag name configurable,
    case-insensitive, whitespace and code fences stripped). With ``lenient=True`` (default)
    text with no tag at all falls back to ``"last_line"`` so plain answers still count;
    an unclosed ``<answer>`` takes the rest of the text.
``"last_line"``
    The last non-empty line.
``"raw"``
    The whole text, stripped.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from envhub.errors import ActionParseError

__all__ = ["ActionFormat", "ActionParser", "extract_answer"]

ActionFormat = Literal["tag", "last_line", "raw"]
_FENCE = re.compile(r"^```[\w-]*\s*\n?(.*?)\n?```$", re.DOTALL)


def _strip(text: str) -> str:
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    return text.strip("`").strip()


@dataclass(frozen=True)
class ActionParser:
    """Extract an action from model text (see the module docstring for the formats)."""

    format: ActionFormat = "tag"
    tag: str = "answer"
    lenient: bool = True
    max_length: int = 1_000

    def __post_init__(self) -> None:
        if self.format not in ("tag", "last_line", "raw"):
            raise ValueError(
                f"unknown action format {self.format!r}; use 'tag', 'last_line' or 'raw'"
            )
        if not re.fullmatch(r"[A-Za-z_][\w-]*", self.tag):
            raise ValueError(f"action tag {self.tag!r} must be a plain name like 'answer'")

    @property
    def instructions(self) -> str:
        """One sentence telling the model how to format its action."""
        if self.format == "tag":
            return f"Put your action inside <{self.tag}>...</{self.tag}>."
        if self.format == "last_line":
            return "Write your action alone on the last line."
        return "Reply with the action only."

    def wrap(self, action: str) -> str:
        """Format an action the way this parser expects it (for experts and examples)."""
        return f"<{self.tag}>{action}</{self.tag}>" if self.format == "tag" else action

    def parse(self, text: str) -> str:
        """Return the action in ``text`` or raise ``ActionParseError`` with model feedback."""
        if not isinstance(text, str):
            raise ActionParseError(f"expected text, got {type(text).__name__}")
        if self.format == "tag":
            action = self._parse_tag(text)
        elif self.format == "last_line":
            action = self._parse_last_line(text)
        else:
            action = _strip(text)
        if not action:
            raise ActionParseError(
                "empty action", feedback=f"Your reply contained no action. {self.instructions}"
            )
        if len(action) > self.max_length:
            raise ActionParseError(
                f"action of {len(action)} characters exceeds max_length={self.max_length}",
                feedback=f"Your action is too long ({len(action)} characters). "
                f"Give just the action. {self.instructions}",
            )
        return action

    def _parse_tag(self, text: str) -> str:
        tag = re.escape(self.tag)
        closed = re.findall(rf"<{tag}\s*>(.*?)</\s*{tag}\s*>", text, re.IGNORECASE | re.DOTALL)
        if closed:
            return _strip(closed[-1])
        opened = list(re.finditer(rf"<{tag}\s*>", text, re.IGNORECASE))
        if opened:
            return _strip(text[opened[-1].end() :])
        if self.lenient:
            return self._parse_last_line(text)
        raise ActionParseError(
            f"no <{self.tag}> tag in the text",
            feedback=f"I could not find your action. {self.instructions}",
        )

    def _parse_last_line(self, text: str) -> str:
        lines = [line for line in _strip(text).splitlines() if line.strip()]
        if not lines:
            raise ActionParseError(
                "empty text", feedback=f"Your reply was empty. {self.instructions}"
            )
        return _strip(lines[-1])


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """The content of the last ``<tag>...</tag>`` block, or ``None`` if there is none."""
    try:
        return ActionParser(format="tag", tag=tag, lenient=False).parse(text)
    except ActionParseError:
        return None


# ============================================================================ tool calls
# Function-calling envs publish OpenAI-format tool schemas (``envhub.function_tool``) and
# read calls from the model's text as JSON inside ``<tool_call>...</tool_call>`` tags (the
# Hermes/Qwen convention). Models get the JSON slightly wrong all the time, so the parser is
# lenient about what does not change the meaning (code fences, trailing commas, Python-style
# quotes and literals, ``arguments`` given as a JSON string, a list of calls in one tag) and
# strict about what does (unknown tool, missing or mistyped arguments), answering with
# feedback that names the problem and shows the expected form.

import ast as _ast
import json as _json
from typing import Any as _Any

__all__ += [
    "MAX_NESTING",
    "ToolCall",
    "ToolCallParser",
    "format_tool_call",
    "message_text",
    "parse_tool_calls",
]

_TRAILING_COMMA = re.compile(r",\s*([}\]])")
MAX_NESTING = 32
"""How deep a call's JSON may nest: deeper JSON overflows the stack when parsed or written."""
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name``, its ``arguments`` and a stable ``id``."""

    name: str
    arguments: dict[str, _Any]
    id: str = "call_0"

    def as_message(self) -> dict[str, _Any]:
        """The call as an OpenAI ``tool_calls`` entry (arguments JSON-encoded)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": _json.dumps(self.arguments, sort_keys=True),
            },
        }


def message_text(message: Mapping[str, _Any], tag: str = "tool_call") -> str:
    """An assistant message as the text an env reads: its content, then each of its
    ``tool_calls`` in envhub's ``<tool_call>`` form (``format_tool_call``). Arguments that are
    not a JSON object are written as given, so the env's parser reports what is wrong."""
    content = str(message.get("content") or "")
    parts = [content] if content else []
    for raw in message.get("tool_calls") or []:
        function = raw.get("function", raw) if isinstance(raw, dict) else {}
        function = function if isinstance(function, dict) else {}
        name, arguments = function.get("name"), function.get("arguments")
        if isinstance(arguments, str) or arguments is None:
            try:
                arguments = _json.loads(arguments or "{}")
            except (ValueError, RecursionError, MemoryError):
                pass  # left as text: the parser says what is wrong with it
        if isinstance(name, str) and isinstance(arguments, dict):
            try:
                parts.append(format_tool_call(name, arguments, tag))
                continue
            except (ValueError, TypeError, RecursionError):
                pass  # nested too deeply to write back: the parser refuses it
        written = arguments if isinstance(arguments, str) else _dumps_or_note(arguments)
        parts.append(f'<{tag}>{{"name": {_dumps_or_note(name)}, "arguments": {written}}}</{tag}>')
    return "\n".join(parts)


def _dumps_or_note(value: _Any) -> str:
    """``value`` as JSON, or a JSON string saying why it cannot be (too deep, not JSON data)."""
    try:
        return _json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        return _json.dumps(f"<{type(value).__name__} that cannot be written as JSON>")


def format_tool_call(
    name: str, arguments: dict[str, _Any] | None = None, tag: str = "tool_call"
) -> str:
    """A call written the way ``ToolCallParser`` reads it (for experts, docs and prompts)."""
    body = _json.dumps({"name": name, "arguments": arguments or {}}, sort_keys=True)
    return f"<{tag}>{body}</{tag}>"


def _loads_lenient(text: str) -> _Any:
    """JSON, else JSON without trailing commas, else a Python literal (single quotes, True).
    Raises ``ValueError`` for anything else, including text nested too deeply to parse."""
    text = _strip(text)
    try:
        return _json.loads(text)
    except ValueError:
        pass
    except (RecursionError, MemoryError):
        raise ValueError(_TOO_DEEP) from None
    cleaned = _TRAILING_COMMA.sub(r"\1", text)
    try:
        return _json.loads(cleaned)
    except ValueError as exc:
        json_error = exc
    except (RecursionError, MemoryError):
        raise ValueError(_TOO_DEEP) from None
    try:
        return _ast.literal_eval(cleaned)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise json_error from None


_TOO_DEEP = f"nested more than {MAX_NESTING} levels deep"


def _text_problem(value: _Any) -> str | None:
    """Why ``value`` (decoded JSON) cannot be passed on, or ``None``: nested deeper than
    ``MAX_NESTING`` (writing it back would overflow the stack), or a string that is not valid
    Unicode text (a lone surrogate such as ``"\\udcff"``: it cannot be encoded as UTF-8, so a
    tool server reading UTF-8 fails). Walks iteratively, so the walk itself cannot overflow."""
    stack: list[tuple[_Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, where = stack.pop()
        if depth > MAX_NESTING:
            return _TOO_DEEP
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = item[exc.start]
                return (
                    f"{where or 'the call'} contains {bad!r}, a lone surrogate that is not valid "
                    "Unicode text; write the character itself or leave it out"
                )
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, depth + 1, f"a key in {where or 'the call'}"))
                stack.append((child, depth + 1, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, depth + 1, f"{where}[{i}]") for i, child in enumerate(item))
    return None


def _type_ok(value: _Any, schema: dict[str, _Any]) -> bool:
    expected = schema.get("type")
    if expected is None:
        return True
    names = expected if isinstance(expected, list) else [expected]
    for name in names:
        kinds = _JSON_TYPES.get(name, (object,))
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, kinds):
            return True
    return False


@dataclass(frozen=True)
class ToolCallParser:
    """Read tool calls from model text and check them against the published schemas.

    ``parse(text)`` returns every call in the text (several tags, or a list in one tag);
    an empty list means the text holds no call. A malformed or invalid call raises
    ``ActionParseError`` whose ``feedback`` says what is wrong and how to write it.
    ``tools`` are OpenAI-format schemas; when empty, names and arguments are not checked.
    Whatever the text, parsing ends in calls or ``ActionParseError``: JSON longer than
    ``max_call_chars``, nested deeper than ``MAX_NESTING`` or holding strings that are not
    valid Unicode (lone surrogates) is refused with feedback, never passed on or raised.
    """

    tools: tuple[dict[str, _Any], ...] = ()
    tag: str = "tool_call"
    max_calls: int = 8
    max_call_chars: int = 2_000_000
    """The longest JSON one call (a tag's body, or a structured call's arguments) may be; tool
    envs pass a tighter one (``ToolEnv(max_call_chars=...)``)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][\w-]*", self.tag):
            raise ValueError(f"tool-call tag {self.tag!r} must be a plain name like 'tool_call'")
        object.__setattr__(self, "tools", tuple(self.tools))

    @property
    def schemas(self) -> dict[str, dict[str, _Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def instructions(self) -> str:
        """How to call a tool, in one sentence with an example."""
        example = next(iter(self.schemas), "tool_name")
        return (
            f'Call a tool by writing <{self.tag}>{{"name": "{example}", "arguments": {{...}}}}'
            f"</{self.tag}> (JSON; one call per tag)."
        )

    def parse_message(self, message: Mapping[str, _Any]) -> list[ToolCall]:
        """The calls of an assistant message (``TextEnv.step`` with a structured action): its
        ``tool_calls`` when it has them (their ids kept), checked like text calls, else those in
        its ``content``. Raises ``ActionParseError`` on a bad one."""
        raw_calls = message.get("tool_calls") or []
        if not raw_calls:
            return self.parse(str(message.get("content") or ""))
        if not isinstance(raw_calls, list):
            raise ActionParseError(
                f"tool_calls is not a list: {raw_calls!r:.80}",
                feedback="tool_calls must be a list of calls.",
            )
        if len(raw_calls) > self.max_calls:
            raise ActionParseError(
                f"{len(raw_calls)} tool calls exceed max_calls={self.max_calls}",
                feedback=(
                    f"You made {len(raw_calls)} tool calls in one reply; make at most "
                    f"{self.max_calls}."
                ),
            )
        calls = []
        for index, raw in enumerate(raw_calls):
            call = self._validate(raw, index=index)
            given = raw.get("id") if isinstance(raw, dict) else None
            if isinstance(given, str) and given:
                call = ToolCall(call.name, call.arguments, given[:128])
            calls.append(call)
        return calls

    def has_call(self, text: str) -> bool:
        return re.search(rf"<{re.escape(self.tag)}\s*>", text, re.IGNORECASE) is not None

    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call in ``text`` (possibly none); raises ``ActionParseError`` on a bad one."""
        if not isinstance(text, str):
            raise ActionParseError(f"expected text, got {type(text).__name__}")
        tag = re.escape(self.tag)
        bodies = re.findall(
            rf"<{tag}\s*>(.*?)(?:</\s*{tag}\s*>|$)", text, re.IGNORECASE | re.DOTALL
        )
        calls: list[ToolCall] = []
        for body in bodies:
            for raw in self._decode(body):
                calls.append(self._validate(raw, index=len(calls)))
        if len(calls) > self.max_calls:
            raise ActionParseError(
                f"{len(calls)} tool calls exceed max_calls={self.max_calls}",
                feedback=(
                    f"You made {len(calls)} tool calls in one reply; make at most {self.max_calls}."
                ),
            )
        return calls

    def _check_length(self, text: str, what: str) -> None:
        if len(text) > self.max_call_chars:
            raise ActionParseError(
                f"{what} of {len(text)} characters exceeds max_call_chars={self.max_call_chars}",
                feedback=(
                    f"{what.capitalize()} is too long ({len(text)} characters; at most "
                    f"{self.max_call_chars}). Pass shorter arguments. {self.instructions}"
                ),
            )

    def _check_text(self, value: _Any, what: str) -> None:
        problem = _text_problem(value)
        if problem is not None:
            raise ActionParseError(
                f"{what}: {problem}",
                feedback=f"{what.capitalize()} cannot be used: {problem}. {self.instructions}",
            )

    def _decode(self, body: str) -> list[_Any]:
        if not _strip(body):
            raise ActionParseError(
                "empty tool call", feedback=f"Your <{self.tag}> tag was empty. {self.instructions}"
            )
        self._check_length(body, "your tool call")
        try:
            value = _loads_lenient(body)
        except ValueError as exc:
            raise ActionParseError(
                f"tool call is not JSON: {exc}",
                feedback=(
                    f"Your tool call is not valid JSON ({exc}): {_strip(body)[:200]!r}. "
                    f"{self.instructions}"
                ),
            ) from None
        self._check_text(value, "your tool call")
        return list(value) if isinstance(value, list) else [value]

    def _validate(self, raw: _Any, *, index: int) -> ToolCall:
        self._check_text(raw, "your tool call")
        if isinstance(raw, dict) and isinstance(raw.get("function"), dict):
            raw = raw["function"]  # the OpenAI message form {"type": "function", "function": {...}}
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ActionParseError(
                f"tool call without a name: {raw!r:.120}",
                feedback=(
                    'A tool call must be a JSON object with "name" and "arguments". '
                    f"{self.instructions}"
                ),
            )
        name = raw["name"].strip()
        arguments = raw.get("arguments", raw.get("parameters", {}))
        if isinstance(arguments, str):  # OpenAI encodes arguments as a JSON string
            self._check_length(arguments, f"the arguments of {name!r}")
            try:
                arguments = _loads_lenient(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise ActionParseError(
                    f"arguments of {name!r} are not JSON: {exc}",
                    feedback=(
                        f"The arguments of {name!r} are not valid JSON ({exc}): "
                        f'{arguments[:200]!r}. Write them as a JSON object like {{"x": 1}}.'
                    ),
                ) from None
        if arguments is None:
            arguments = {}
        self._check_text(arguments, f"the arguments of {name!r}")
        if not isinstance(arguments, dict):
            raise ActionParseError(
                f"arguments of {name!r} are not an object: {arguments!r:.120}",
                feedback=(
                    f'The arguments of {name!r} must be a JSON object like {{"x": 1}}, got '
                    f"{arguments!r:.120}."
                ),
            )
        schemas = self.schemas
        if schemas:
            self._check_against_schema(name, arguments, schemas)
        return ToolCall(name=name, arguments=arguments, id=f"call_{index}")

    def _check_against_schema(
        self, name: str, arguments: dict[str, _Any], schemas: dict[str, dict[str, _Any]]
    ) -> None:
        schema = schemas.get(name)
        if schema is None:
            close = difflib.get_close_matches(name, list(schemas), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ActionParseError(
                f"unknown tool {name!r}",
                feedback=(
                    f"There is no tool named {name!r}.{hint} Available tools: {', '.join(schemas)}."
                ),
            )
        parameters = schema.get("parameters") or {}
        properties: dict[str, _Any] = parameters.get("properties") or {}
        missing = [p for p in parameters.get("required", []) if p not in arguments]
        if missing:
            raise ActionParseError(
                f"{name}: missing required argument(s) {missing}",
                feedback=f"Tool {name!r} needs the argument(s) {', '.join(missing)}; "
                f"its parameters are {_json.dumps(properties)}.",
            )
        if parameters.get("additionalProperties") is False or properties:
            unknown = [a for a in arguments if a not in properties]
            if unknown:
                raise ActionParseError(
                    f"{name}: unknown argument(s) {unknown}",
                    feedback=f"Tool {name!r} has no argument(s) {', '.join(unknown)}; "
                    f"it takes {', '.join(properties) or 'none'}.",
                )
        for key, value in arguments.items():
            spec = properties.get(key, {})
            if not _type_ok(value, spec):
                raise ActionParseError(
                    f"{name}: argument {key}={value!r:.60} is not {spec.get('type')}",
                    feedback=(
                        f"Argument {key!r} of {name!r} must be of type {spec.get('type')}, got "
                        f"{value!r:.60}."
                    ),
                )
            if "enum" in spec and value not in spec["enum"]:
                raise ActionParseError(
                    f"{name}: argument {key}={value!r:.60} not in {spec['enum']}",
                    feedback=(
                        f"Argument {key!r} of {name!r} must be one of {spec['enum']}, got "
                        f"{value!r:.60}."
                    ),
                )


def parse_tool_calls(
    text: str,
    tools: list[dict[str, _Any]] | tuple[dict[str, _Any], ...] = (),
    tag: str = "tool_call",
) -> list[ToolCall]:
    """Every tool call in ``text``, checked against ``tools`` (see ``ToolCallParser``)."""
    return ToolCallParser(tools=tuple(tools), tag=tag).parse(text)
