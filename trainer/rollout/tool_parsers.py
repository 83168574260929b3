"""Model text -> structured tool calls, per model family (``rollout.tool_parser``).

Instruct models are post-trained to write tool calls in their family's own syntax; the chat
template renders them back from structured ``tool_calls`` messages. A ``ToolParser`` reads one
generated turn and returns a ``ParsedTurn``: the prose ``content`` and the ``ToolCall``\\ s (name,
JSON arguments, an id), so the transcript holds the assistant message the model was trained on
and a tool env receives its calls whatever syntax the model used.

=============  ======================================================================
name           what the model writes
=============  ======================================================================
``hermes``     ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/3,
               Hermes, envhub's own tool envs)
``llama3_json`` ``<|python_tag|>{"name": ..., "parameters": {...}}`` or a bare JSON object
               (several separated by ``;``)
``mistral``    ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
``pythonic``   ``[get_weather(city="Paris"), add(a=1, b=2)]`` (Llama 3.2/4 pythonic)
``none``       no tool calls: the whole text is content
``auto``       chosen from the chat template (``detect``), ``none`` when it renders no tools
=============  ======================================================================

Where vLLM is installed, ``make_tool_parser(..., prefer_vllm=True)`` wraps vLLM's own parser of
that name (vLLM ships parsers for ~50 families and keeps them current); the embedded parsers
here are the default without vLLM and for tokenizers that lack the family's special tokens.

A malformed call (bad JSON, no name) is never an exception: the turn comes back with
``error`` set and no calls, and the env gets the raw text (its own parser then answers with
feedback and the invalid-action penalty). Calls beyond ``max_calls`` are an error too.
"""

from __future__ import annotations

import ast
import difflib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Protocol

from envhub.errors import ActionParseError
from envhub.parsing import ToolCall, ToolCallParser, format_tool_call

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
    """A ``ToolCall`` from a decoded JSON object ``{"name", "arguments"|"parameters"}``."""
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
    if not isinstance(arguments, dict):
        raise _ParseError(f"arguments of {raw['name']!r} must be an object, got {arguments!r:.80}")
    return ToolCall(name=raw["name"], arguments=arguments, id=f"call_{index}")


def _json_objects(text: str) -> list[Any]:
    """Every JSON value in ``text`` (a list is spread into its items)."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise _ParseError(f"tool call is not JSON: {error}") from None
    return list(value) if isinstance(value, list) else [value]


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
        if len(calls) > self.max_calls:
            problem = f"{len(calls)} tool calls in one turn; at most {self.max_calls}"
            return ParsedTurn(content=text, error=problem, raw=text)
        return ParsedTurn(content=content.strip(), tool_calls=calls, raw=text)

    def _split(self, text: str) -> tuple[str, list[Any]]:
        """(content, decoded call objects); raises ``_ParseError`` on a malformed call."""
        raise NotImplementedError


_HERMES_TAG = re.compile(r"<tool_call\s*>.*?(?:</\s*tool_call\s*>|$)", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class _Hermes:
    """envhub's own reader (``envhub.parsing.ToolCallParser``, the one every tool env uses), so
    the trainer and the env agree on what a hermes call is."""

    name: str = "hermes"
    max_calls: int = 16

    def parse(self, text: str) -> ParsedTurn:
        try:
            calls = ToolCallParser(max_calls=self.max_calls).parse(text)
        except ActionParseError as error:
            return ParsedTurn(content=text, error=error.feedback or str(error), raw=text)
        content = _HERMES_TAG.sub("", text).strip() if calls else text.strip()
        return ParsedTurn(content=content, tool_calls=tuple(calls), raw=text)


@dataclass(frozen=True)
class _Llama3Json(_Embedded):
    name: str = "llama3_json"

    def _split(self, text: str) -> tuple[str, list[Any]]:
        head, tag, body = text.partition("<|python_tag|>")
        if not tag:
            stripped = text.strip()
            if not (stripped.startswith("{") and '"name"' in stripped):
                return text, []
            head, body = "", stripped
        raws = [raw for part in body.split(";") if part.strip() for raw in _json_objects(part)]
        return head, raws


@dataclass(frozen=True)
class _Mistral(_Embedded):
    name: str = "mistral"

    def _split(self, text: str) -> tuple[str, list[Any]]:
        head, tag, body = text.partition("[TOOL_CALLS]")
        return (head, _json_objects(body.strip())) if tag else (text, [])


@dataclass(frozen=True)
class _Pythonic(_Embedded):
    name: str = "pythonic"

    def _split(self, text: str) -> tuple[str, list[Any]]:
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]") and "(" in stripped):
            return text, []
        try:
            tree = ast.parse(stripped, mode="eval").body
        except SyntaxError as error:
            raise _ParseError(f"tool call list is not Python: {error.msg}") from None
        if not isinstance(tree, ast.List):
            return text, []
        raws = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                raise _ParseError(f"not a call: {ast.unparse(node)[:80]}")
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                raise _ParseError(f"arguments of {node.func.id} must be literals") from None
            raws.append({"name": node.func.id, "arguments": arguments})
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
    logs and swallows that case), so the turn carries the same ``error`` either way."""

    def __init__(self, name: str, parser: Any, max_calls: int) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.name, self._parser, self.max_calls = name, parser, max_calls
        self._request = ChatCompletionRequest.model_validate({"messages": [], "model": "envhub"})
        self._logger = logging.getLogger(type(parser).__module__)
        embedded = TOOL_PARSERS.get(name)
        self._embedded: ToolParser | None = embedded(max_calls=max_calls) if embedded else None

    def parse(self, text: str) -> ParsedTurn:
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
            return self._embedded.parse(text)
        if len(calls) > self.max_calls:
            problem = f"{len(calls)} tool calls in one turn; at most {self.max_calls}"
            return ParsedTurn(content=text, error=problem, raw=text)
        return ParsedTurn(content=(info.content or "").strip(), tool_calls=calls, raw=text)


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
