"""Model text -> structured tool calls, per model family (``rollout.tool_parser``).

Instruct models are post-trained to write tool calls in their family's own syntax; the chat
template renders them back from structured ``tool_calls`` messages. A ``ToolParser`` reads one
generated turn and returns a ``ParsedTurn``: the prose ``content`` and the ``ToolCall``\\ s (name,
JSON arguments, an id numbered in the turn as the env numbers it: ``ToolCall.numbered_id``), so
the transcript holds the assistant message the model was trained on and a tool env receives its
calls whatever syntax the model used.

=============  ======================================================================
name           what the model writes
=============  ======================================================================
``hermes``     ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/3,
               Hermes, envhub's own tool envs); tags inside ``<think>...</think>`` are
               thinking, not calls
``llama3_json`` ``<|python_tag|>{"name": ..., "parameters": {...}}`` or a bare JSON object
               (several separated by ``;``; prose after them is content)
``mistral``    ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (prose after the list
               is content)
``pythonic``   ``[get_weather(city="Paris"), add(a=1, b=2)]`` (Llama 3.2/4 pythonic; keyword
               arguments only)
``none``       no tool calls: the whole text is content
``auto``       chosen from the chat template (``detect``), ``none`` when it renders no tools
=============  ======================================================================

Where vLLM is installed, ``make_tool_parser(..., prefer_vllm=True)`` wraps vLLM's own parser of
that name (vLLM ships parsers for ~50 families and keeps them current); the embedded parsers
here are the default without vLLM and for tokenizers that lack the family's special tokens.

A malformed call (bad JSON, no name, arguments JSON cannot hold, nesting too deep to read) is
never an exception, whatever the text: the turn comes back with ``error`` set and no calls, and
the env gets the raw text (its own parser then answers with feedback and the invalid-action
penalty). Calls beyond ``max_calls`` are an error too.
"""

from __future__ import annotations

import ast
import difflib
import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from envhub import safe_ast
from envhub.errors import ActionParseError
from envhub.parsing import ToolCall, ToolCallParser, format_tool_call, json_problem

__all__ = [
    "CHAT_ROLES",
    "TOOL_PARSERS",
    "ParsedTurn",
    "ToolParser",
    "content_text",
    "detect_tool_parser",
    "env_action",
    "make_tool_parser",
    "message_turn",
]


@dataclass(frozen=True)
class ParsedTurn:
    """One generated turn read as an assistant message."""

    content: str
    """The text around the calls (the whole text when there are none or they are malformed)."""
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    """Why the call syntax could not be read (None when it could, or there was none)."""
    raw: str = ""
    """The model's text, unchanged."""

    def message(self) -> dict[str, Any]:
        """The OpenAI-format assistant message (``tool_calls`` only when there are calls)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.as_message() for call in self.tool_calls]
        return out


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles a chat message may have (OpenAI's)."""


def content_text(content: Any) -> str:
    """A message's ``content`` as text: a string as it is, None as "", OpenAI's list of content
    parts (``[{"type": "text", "text": ...}, ...]``) as its text parts joined. Anything else raises
    ``TypeError``, a part that is not text (an image cannot be trained as tokens) ``ValueError``
    naming it (``content[i]``)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise TypeError(
            f"content must be a string or a list of text parts, got {type(content).__name__}"
        )
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(
                f"content[{index}] is a {kind!r} part without text; only text parts can be "
                'trained ({"type": "text", "text": "..."})'
            )
        texts.append(part["text"])
    return "".join(texts)


def message_turn(message: dict[str, Any]) -> ParsedTurn:
    """An OpenAI-format assistant message (``content`` + ``tool_calls``) as a ``ParsedTurn``, so
    ``env_action`` gives the text the policy would write for it (SFT files). A call that is not
    an object with a name and JSON arguments raises ``ValueError`` saying which; content that is
    not text, as ``content_text`` does."""
    content = content_text(message.get("content"))
    calls = tuple(_call(raw, i) for i, raw in enumerate(message.get("tool_calls") or []))
    return ParsedTurn(content=content, tool_calls=calls, raw=content)


def env_action(turn: ParsedTurn) -> str:
    """The action text a tool env reads: the raw text when it holds no readable call, else
    the content followed by each call in envhub's canonical ``<tool_call>`` form."""
    if turn.error is not None or not turn.tool_calls:
        return turn.raw
    calls = "\n".join(format_tool_call(c.name, c.arguments) for c in turn.tool_calls)
    return f"{turn.content}\n{calls}" if turn.content else calls


class ToolParser(Protocol):
    """Reads one generated turn (see the module docstring)."""

    @property
    def name(self) -> str:
        """The ``rollout.tool_parser`` name."""
        ...

    def parse(self, text: str) -> ParsedTurn: ...


class _ParseError(ValueError):
    pass


def _call(raw: Any, index: int) -> ToolCall:
    """A ``ToolCall`` from a decoded object ``{"name", "arguments"|"parameters"}`` whose
    arguments JSON can hold (``json_problem``), so writing the call back cannot raise."""
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict):
        raw = raw["function"]
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise _ParseError(f"a tool call must be an object with a name, got {raw!r:.120}")
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            raise _ParseError(f"arguments of {raw['name']!r} are not JSON: {error}") from None
        except (RecursionError, MemoryError):
            raise _ParseError(_TOO_DEEP) from None
    if not isinstance(arguments, dict):
        raise _ParseError(f"arguments of {raw['name']!r} must be an object, got {arguments!r:.80}")
    problem = json_problem(arguments)
    if problem is not None:
        raise _ParseError(f"arguments of {raw['name']!r} cannot be written as JSON: {problem}")
    return ToolCall(name=raw["name"], arguments=arguments, id=ToolCall.numbered_id(index))


_TOO_DEEP = "tool call is nested too deeply to read; write flatter arguments"
_JSON_DECODER = json.JSONDecoder()


def _json_values(text: str, separators: str = "") -> tuple[list[Any], str]:
    """The JSON values ``text`` starts with, one after another (whitespace and ``separators``
    may stand between them; a list is spread into its items), and the prose after the last.
    Decoding value by value (``raw_decode``) leaves a separator inside a string alone. Text
    with no value, or a value that starts (``{``/``[`` after the first) but does not parse,
    raises ``_ParseError``."""
    values: list[Any] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
        if values and (position == len(text) or text[position] not in "{["):
            return values, text[position:]
        try:
            value, position = _JSON_DECODER.raw_decode(text, position)
        except ValueError as error:
            raise _ParseError(f"tool call is not JSON: {error}") from None
        except (RecursionError, MemoryError):
            raise _ParseError(_TOO_DEEP) from None
        values.extend(value if isinstance(value, list) else [value])


def _prose(*parts: str) -> str:
    """The non-empty ``parts``, stripped, one per line (the content around the calls)."""
    return "\n".join(part.strip() for part in parts if part.strip())


@dataclass(frozen=True)
class _Embedded:
    """Shared shape of the embedded parsers: find call bodies, decode each, keep the prose."""

    name: str
    max_calls: int = 16

    def parse(self, text: str) -> ParsedTurn:
        try:
            content, raws = self._split(text)
            calls = tuple(_call(raw, i) for i, raw in enumerate(raws))
        except _ParseError as error:
            return ParsedTurn(content=text, error=str(error), raw=text)
        except (RecursionError, MemoryError):  # e.g. repr or unparse of a deep value
            return ParsedTurn(content=text, error=_TOO_DEEP, raw=text)
        if len(calls) > self.max_calls:
            problem = f"{len(calls)} tool calls in one turn; at most {self.max_calls}"
            return ParsedTurn(content=text, error=problem, raw=text)
        return ParsedTurn(content=content.strip(), tool_calls=calls, raw=text)

    def _split(self, text: str) -> tuple[str, list[Any]]:
        """(content, decoded call objects); raises ``_ParseError`` on a malformed call."""
        raise NotImplementedError


@dataclass(frozen=True)
class _Hermes:
    """envhub's own reader (``envhub.parsing.ToolCallParser``, the one every tool env uses), so
    the trainer and the env agree on what a hermes call is (calls inside thinking are not)."""

    name: str = "hermes"
    max_calls: int = 16

    def parse(self, text: str) -> ParsedTurn:
        try:
            content, calls = ToolCallParser(max_calls=self.max_calls).split(text)
        except ActionParseError as error:
            return ParsedTurn(content=text, error=error.feedback or str(error), raw=text)
        return ParsedTurn(content=content.strip(), tool_calls=tuple(calls), raw=text)


@dataclass(frozen=True)
class _Llama3Json(_Embedded):
    """Calls after ``<|python_tag|>``, or a turn that starts with a bare JSON call; prose
    after the calls is content."""

    name: str = "llama3_json"

    def _split(self, text: str) -> tuple[str, list[Any]]:
        head, tag, body = text.partition("<|python_tag|>")
        if not tag:
            stripped = text.strip()
            if not (stripped.startswith("{") and '"name"' in stripped):
                return text, []
            head, body = "", stripped
        raws, tail = _json_values(body, separators=";")
        return _prose(head, tail), raws


@dataclass(frozen=True)
class _Mistral(_Embedded):
    """The JSON list after ``[TOOL_CALLS]``; prose after it is content."""

    name: str = "mistral"

    def _split(self, text: str) -> tuple[str, list[Any]]:
        head, tag, body = text.partition("[TOOL_CALLS]")
        if not tag:
            return text, []
        raws, tail = _json_values(body)
        return _prose(head, tail), raws


@dataclass(frozen=True)
class _Pythonic(_Embedded):
    """A turn that is a Python list of calls with literal keyword arguments. Anything else in
    such a list (positional arguments, ``**`` splats, non-literals, values JSON cannot hold) is
    an error that says how to write it, never a call with arguments dropped or changed."""

    name: str = "pythonic"

    def _split(self, text: str) -> tuple[str, list[Any]]:
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]") and "(" in stripped):
            return text, []
        try:
            tree = safe_ast.parse(stripped, mode="eval").body
        except SyntaxError as error:
            raise _ParseError(f"tool call list is not Python: {error.msg}") from None
        except (ValueError, RecursionError, MemoryError):  # NUL bytes, nesting too deep
            raise _ParseError("tool call list is not Python that can be read") from None
        if not isinstance(tree, ast.List):
            return text, []
        raws = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                raise _ParseError(f"not a call: {ast.unparse(node)[:80]}")
            name = node.func.id
            if node.args:
                raise _ParseError(
                    f"{name} has positional arguments; use keyword arguments: {name}(x=1)"
                )
            arguments = {}
            for keyword in node.keywords:
                if keyword.arg is None:
                    raise _ParseError(
                        f"{name}(**...) cannot be read; write each argument as name=value"
                    )
                try:
                    arguments[keyword.arg] = ast.literal_eval(keyword.value)
                except Exception:  # noqa: BLE001 - model text: ValueError, TypeError ({[1]: 2})
                    raise _ParseError(
                        f"argument {keyword.arg} of {name} must be one of the literals JSON "
                        "holds (strings, numbers, True/False/None, lists, dicts with string "
                        "keys)"
                    ) from None
            if json_problem(arguments) is None:  # else _call names the problem
                arguments = json.loads(json.dumps(arguments))  # tuples as lists, as JSON reads
            raws.append({"name": name, "arguments": arguments})
        return "", raws


@dataclass(frozen=True)
class _NoTools:
    name: str = "none"

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(content=text, raw=text)


TOOL_PARSERS: dict[str, type[Any]] = {
    "hermes": _Hermes,
    "llama3_json": _Llama3Json,
    "mistral": _Mistral,
    "pythonic": _Pythonic,
    "none": _NoTools,
}
"""The embedded parsers by ``rollout.tool_parser`` name (plus ``auto``)."""


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser a chat template's tool syntax implies (``none`` if it renders no tools)."""
    template = chat_template or ""
    if "tools" not in template and "tool_calls" not in template:
        return "none"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


class _VLLMParser:
    """vLLM's parser of the same name (non-streaming ``extract_tool_calls``). When vLLM finds no
    call, the embedded parser of that name says whether the text held a malformed one (vLLM
    logs and swallows that case), so the turn carries the same ``error`` either way. A hermes
    turn that thinks (``</think>``) is read by the embedded parser alone: it is the env's own
    reader, which skips calls only mentioned while thinking, where vLLM's runs them."""

    def __init__(self, name: str, parser: Any, max_calls: int) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.name, self._parser, self.max_calls = name, parser, max_calls
        self._request = ChatCompletionRequest.model_validate({"messages": [], "model": "envhub"})
        self._logger = logging.getLogger(type(parser).__module__)
        embedded = TOOL_PARSERS.get(name)
        self._embedded: ToolParser | None = embedded(max_calls=max_calls) if embedded else None

    def parse(self, text: str) -> ParsedTurn:
        if self.name == "hermes" and "</think>" in text:
            return self._embedded_parse(text)
        level = self._logger.level
        self._logger.setLevel(logging.CRITICAL)  # a model's bad JSON is data, not a log traceback
        try:
            info = self._parser.extract_tool_calls(text, self._request)
            found = info.tool_calls if info.tools_called else []
            calls = tuple(
                _call({"name": c.function.name, "arguments": c.function.arguments}, i)
                for i, c in enumerate(found)
            )
        except Exception as error:  # noqa: BLE001 - a model's text must never crash a rollout
            return ParsedTurn(content=text, error=f"{type(error).__name__}: {error}", raw=text)
        finally:
            self._logger.setLevel(level)
        if not calls and self._embedded is not None:
            return self._embedded_parse(text)
        if len(calls) > self.max_calls:
            problem = f"{len(calls)} tool calls in one turn; at most {self.max_calls}"
            return ParsedTurn(content=text, error=problem, raw=text)
        return ParsedTurn(content=(info.content or "").strip(), tool_calls=calls, raw=text)

    def _embedded_parse(self, text: str) -> ParsedTurn:
        """The embedded parser's reading (none: the whole text is content); like vLLM's part, it
        can never raise out of a rollout."""
        if self._embedded is None:
            return ParsedTurn(content=text, raw=text)
        try:
            return self._embedded.parse(text)
        except Exception as error:  # noqa: BLE001 - a model's text must never crash a rollout
            return ParsedTurn(content=text, error=f"{type(error).__name__}: {error}", raw=text)


def _vllm_parser(name: str, tokenizer: Any, max_calls: int) -> ToolParser | None:
    """vLLM's parser ``name`` for ``tokenizer``, or None (no vLLM, or the tokenizer lacks the
    family's special tokens, which vLLM's parsers look up in the vocabulary)."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        return None
    if name not in ToolParserManager.list_registered():
        return None
    try:
        parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    except (RuntimeError, KeyError, ValueError, AttributeError):
        return None
    return _VLLMParser(name, parser, max_calls)


def make_tool_parser(
    name: str, tokenizer: Any = None, *, prefer_vllm: bool = True, max_calls: int = 16
) -> ToolParser:
    """The parser called ``name`` (``auto``: from ``tokenizer.chat_template``), vLLM's where it
    is installed and fits the tokenizer, else the embedded one. Unknown names raise
    ``ValueError`` naming the choices (and the closest one)."""
    if name == "auto":
        name = detect_tool_parser(getattr(tokenizer, "chat_template", None))
    if name not in TOOL_PARSERS:
        close = difflib.get_close_matches(name, list(TOOL_PARSERS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        choices = ", ".join(["auto", *TOOL_PARSERS])
        raise ValueError(f"unknown rollout.tool_parser {name!r}{hint} (choices: {choices})")
    if name == "none":
        return _NoTools()
    if prefer_vllm and tokenizer is not None:
        wrapped = _vllm_parser(name, tokenizer, max_calls)
        if wrapped is not None:
            return wrapped
    parser: ToolParser = TOOL_PARSERS[name](max_calls=max_calls)
    return parser
