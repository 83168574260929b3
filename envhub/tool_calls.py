"""Tool calls in a model's text: ``ToolCallParser``, ``ToolCall``, ``format_tool_call``.

Function-calling envs publish OpenAI-format tool schemas (``envhub.function_tool``) and
read calls from the model's text as JSON inside ``<tool_call>...</tool_call>`` tags (the
Hermes/Qwen convention). Models get the JSON slightly wrong all the time, so the parser is
lenient about what does not change the meaning (code fences, trailing commas, Python-style
quotes and literals, ``arguments`` given as a JSON string, a list of calls in one tag) and
strict about what does (unknown tool, arguments that break the tool's JSON Schema at any depth,
NaN or Infinity, which JSON has not), answering with feedback that names the problem and shows
the expected form. The schemas themselves are checked once (``envhub.tool_schemas``).

``envhub.parsing`` re-exports every name here (its action parsing is the other half).
"""

from __future__ import annotations

import difflib
import json as _json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any as _Any

from envhub.errors import ActionParseError
from envhub.safe_ast import literal_eval as _literal_eval
from envhub.tool_schemas import schema_key, validate_tools, validator_for_key

__all__ = [
    "MAX_NESTING",
    "ToolCall",
    "ToolCallParser",
    "blank_thinking",
    "format_tool_call",
    "json_problem",
    "message_text",
    "parse_tool_calls",
    "thinking_spans",
]

_FENCE = re.compile(r"^```[\w-]*\s*\n?(.*?)\n?```$", re.DOTALL)


def _strip(text: str) -> str:
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    return text.strip("`").strip()


_TRAILING_COMMA = re.compile(r",\s*([}\]])")
MAX_NESTING = 32
"""How deep a call's JSON may nest: deeper JSON overflows the stack when parsed or written."""


_ID_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name``, its ``arguments`` and a stable ``id``."""

    name: str
    arguments: dict[str, _Any]
    id: str = "call00000"

    @staticmethod
    def numbered_id(index: int) -> str:
        """The id of the ``index``-th call: ``call`` and ``index`` in base 36, five digits
        (``call00000``, ``call00001``, ..., ``call0000a``). Nine letters and digits, as Mistral's
        chat template and API require (any other id is refused there), and numbered rather than
        random, so a replayed or resumed episode gets the same ids. ``ValueError`` past the
        36**5 - 1 that five digits hold."""
        if not 0 <= index < len(_ID_DIGITS) ** 5:
            raise ValueError(f"tool call index {index} is out of range: at most {36**5 - 1}")
        digits = []
        for _ in range(5):
            index, digit = divmod(index, len(_ID_DIGITS))
            digits.append(_ID_DIGITS[digit])
        return "call" + "".join(reversed(digits))

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
    """JSON, else JSON without trailing commas, else a Python literal (single quotes, True) that
    JSON can hold (``json_problem``; tuples come back as lists). Raises ``ValueError`` for
    anything else, including text nested too deeply to parse."""
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
        value = _literal_eval(cleaned)
    except Exception:  # noqa: BLE001 - model text: TypeError ({[1]: 2}), MemoryError, ...
        raise json_error from None
    problem = json_problem(value)
    if problem is not None:
        raise ValueError(problem)
    try:  # tuples become lists, as JSON reads them
        return _json.loads(_json.dumps(value))
    except (ValueError, RecursionError, MemoryError):
        raise ValueError(_TOO_DEEP) from None


_TOO_DEEP = f"nested more than {MAX_NESTING} levels deep"
_JSON_DECODER = _json.JSONDecoder()
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _skip_space(text: str, position: int) -> int:
    """The index of the first non-whitespace character of ``text`` from ``position`` on."""
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def thinking_spans(text: str, *, leading: bool = True) -> list[tuple[int, int]]:
    """``(start, end)`` of each stretch of thinking in ``text``, in order, closing tag included:

    1. (with ``leading``) the text before a first ``</think>`` that no ``<think>`` comes before:
       a generation prompt that ends with ``<think>`` (DeepSeek-R1, Qwen3-Thinking-2507) makes
       the model write only the rest of its block (vLLM's ``deepseek_r1`` reasoning parser reads
       it so). Without ``leading`` (a reader that cannot know the prompt opened a block: an
       env's answer parser), such a ``</think>`` is text: ``<answer>print('</think>')</answer>``
       stays an answer;
    2. each ``<think>...</think>`` block after that (to the first ``</think>`` after it).

    A ``</think>`` that closes nothing once thinking ended (after a block or the rule-1 span) is
    text; an unclosed ``<think>`` ends the scan (its text is kept); a text without ``</think>``
    has no thinking. ``str.find`` keeps it linear in the text (a lazy regex is quadratic on a
    repeated unclosed tag)."""
    spans: list[tuple[int, int]] = []
    first_open, first_close = text.find(_THINK_OPEN), text.find(_THINK_CLOSE)
    position = 0
    if leading and first_close != -1 and (first_open == -1 or first_close < first_open):
        position = first_close + len(_THINK_CLOSE)
        spans.append((0, position))
    while (start := text.find(_THINK_OPEN, position)) != -1:
        end = text.find(_THINK_CLOSE, start + len(_THINK_OPEN))
        if end == -1:
            break
        position = end + len(_THINK_CLOSE)
        spans.append((start, position))
    return spans


def blank_thinking(text: str, *, leading: bool = True) -> str:
    """``text`` with its thinking (``thinking_spans``, ``leading`` as there) blanked out: same
    length, so indices still point into ``text``."""
    spans = thinking_spans(text, leading=leading)
    if not spans:
        return text
    parts, position = [], 0
    for start, end in spans:
        parts += [text[position:start], " " * (end - start)]
        position = end
    parts.append(text[position:])
    return "".join(parts)


_JSON_SCALARS = (str, int, float, bool, type(None))


def json_problem(value: _Any) -> str | None:
    """Why ``value`` (a decoded Python literal) is not JSON data, saying what to write instead,
    or ``None`` when it is: objects with string keys, lists (tuples count as lists), strings,
    numbers, booleans and null. A set, bytes, a complex number or a non-string key would make
    ``json.dumps`` raise (or, for an int key, silently become a string key) when the call is
    written back. Walks iteratively, so deep values cannot overflow the stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    return f'keys must be strings: write {{"{key!s:.40}": ...}}, not {key!r:.40}'
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, (set, frozenset)):
            return f"{item!r:.40} is a set, which JSON has not: write a list [...] instead"
        elif isinstance(item, (bytes, bytearray)):
            return f'{item!r:.40} is bytes, which JSON has not: write a string "..." instead'
        elif isinstance(item, complex):
            return f"{item!r:.40} is a complex number, which JSON has not: write a number"
        elif not isinstance(item, _JSON_SCALARS):
            return (
                f"{item!r:.40} is not JSON data: write a string, number, true/false/null, "
                "list or object"
            )
    return None


def _text_problem(value: _Any) -> str | None:
    """Why ``value`` (decoded JSON) cannot be passed on, or ``None``: nested deeper than
    ``MAX_NESTING`` (writing it back would overflow the stack), a string that is not valid
    Unicode text (a lone surrogate such as ``"\\udcff"``: it cannot be encoded as UTF-8, so a
    tool server reading UTF-8 fails), or NaN or an infinity (Python's JSON reader takes ``NaN``,
    ``Infinity`` and ``1e999``; JSON has no such numbers and a strict reader refuses them).
    Walks iteratively, so the walk itself cannot overflow."""
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
        elif isinstance(item, float) and not math.isfinite(item):
            return (
                f"{where or 'the call'} is {item!r}, which is not a JSON number; write a finite "
                "number"
            )
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, depth + 1, f"a key in {where or 'the call'}"))
                stack.append((child, depth + 1, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, depth + 1, f"{where}[{i}]") for i, child in enumerate(item))
    return None


@dataclass(frozen=True)
class ToolCallParser:
    """Read tool calls from model text and check them against the published schemas.

    ``parse(text)`` returns every call in the text (several tags, or a list in one tag);
    an empty list means the text holds no call. A malformed or invalid call raises
    ``ActionParseError`` whose ``feedback`` says what is wrong and how to write it.
    ``tools`` are OpenAI-format schemas, checked when the parser is made (``ToolSchemaError``
    names every problem, see ``envhub.tool_schemas``); when empty, names and arguments are not
    checked. Arguments are checked against a tool's ``parameters`` by a JSON Schema validator,
    compiled once per schema; in addition, when a tool declares ``properties`` and leaves
    ``additionalProperties`` unset, a top-level argument it does not declare is refused (models
    invent arguments; the tool would ignore them silently).
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
    _schemas: dict[str, dict[str, _Any]] = field(init=False, repr=False, compare=False)
    _validator_keys: dict[str, str] = field(init=False, repr=False, compare=False)
    """Each tool's ``schema_key``: its compiled validator is looked up by it (validators are
    shared and not pickled with the parser)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][\w-]*", self.tag):
            raise ValueError(f"tool-call tag {self.tag!r} must be a plain name like 'tool_call'")
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.tools:
            validate_tools(self.tools, "ToolCallParser")
        schemas = {t["function"]["name"]: t["function"] for t in self.tools}
        object.__setattr__(self, "_schemas", schemas)
        keys = {
            name: schema_key(s["parameters"]) for name, s in schemas.items() if "parameters" in s
        }
        object.__setattr__(self, "_validator_keys", keys)

    @property
    def schemas(self) -> dict[str, dict[str, _Any]]:
        """The ``function`` part of each tool, by name."""
        return self._schemas

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
        """Whether ``text`` opens a call tag outside thinking (see ``parse``)."""
        return next(self._tags(text), None) is not None

    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call in ``text`` (possibly none); raises ``ActionParseError`` on a bad one.
        Calls inside thinking are not calls (see ``split``)."""
        return self.split(text)[1]

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """``text`` without its call tags (prose and thinking kept), and every call in it; raises
        ``ActionParseError`` on a bad one.

        A tag that a model only mentions while thinking (inside ``<think>...</think>``, or before
        a lone ``</think>`` when the template opened the thinking) is not a call: the model did
        not decide to make it. A tag's body is the JSON value that starts it when a closing tag
        (or the end of the text) follows that value, so a string argument may contain the
        closing tag; anything else (code fences, Python literals) runs to the next closing tag.
        """
        if not isinstance(text, str):
            raise ActionParseError(f"expected text, got {type(text).__name__}")
        kept: list[str] = []
        calls: list[ToolCall] = []
        position = 0
        for start, end, body in self._tags(text):
            kept.append(text[position:start])
            position = end
            for raw in self._decode(body):
                calls.append(self._validate(raw, index=len(calls)))
        kept.append(text[position:])
        if len(calls) > self.max_calls:
            raise ActionParseError(
                f"{len(calls)} tool calls exceed max_calls={self.max_calls}",
                feedback=(
                    f"You made {len(calls)} tool calls in one reply; make at most {self.max_calls}."
                ),
            )
        return "".join(kept), calls

    def _tags(self, text: str) -> Iterator[tuple[int, int, str]]:
        """(start, end, body) of each call tag in ``text`` outside thinking (see ``split``)."""
        masked = blank_thinking(text)
        tag = re.escape(self.tag)
        opening = re.compile(rf"<{tag}\s*>", re.IGNORECASE)
        closing = re.compile(rf"</\s*{tag}\s*>", re.IGNORECASE)
        position = 0
        while (opened := opening.search(masked, position)) is not None:
            body_start = json_end = opened.end()
            try:
                json_end = _JSON_DECODER.raw_decode(masked, _skip_space(masked, body_start))[1]
            except (ValueError, RecursionError, MemoryError):
                pass  # not plain JSON: the lenient reader gets the text up to the closing tag
            after = _skip_space(masked, json_end)
            closed = closing.match(masked, after)
            if json_end > body_start and (closed is not None or after == len(masked)):
                end = closed.end() if closed is not None else len(masked)
                body_end = json_end
            else:
                closed = closing.search(masked, body_start)
                body_end = closed.start() if closed is not None else len(masked)
                end = closed.end() if closed is not None else len(masked)
            yield opened.start(), end, masked[body_start:body_end]
            position = end

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
        return ToolCall(name=name, arguments=arguments, id=ToolCall.numbered_id(index))

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
        extra = parameters.get("additionalProperties")
        if extra is False or (
            extra is None and properties and "patternProperties" not in parameters
        ):
            unknown = [a for a in arguments if a not in properties]
            if unknown:
                raise ActionParseError(
                    f"{name}: unknown argument(s) {unknown}",
                    feedback=f"Tool {name!r} has no argument(s) {', '.join(unknown)}; "
                    f"it takes {', '.join(properties) or 'none'}.",
                )
        key = self._validator_keys.get(name)
        if key is None:
            return
        problem = validator_for_key(key).problem(name, arguments)
        if problem is not None:
            raise ActionParseError(problem[0], feedback=problem[1])


def parse_tool_calls(
    text: str,
    tools: list[dict[str, _Any]] | tuple[dict[str, _Any], ...] = (),
    tag: str = "tool_call",
) -> list[ToolCall]:
    """Every tool call in ``text``, checked against ``tools`` (see ``ToolCallParser``)."""
    return ToolCallParser(tools=tuple(tools), tag=tag).parse(text)
