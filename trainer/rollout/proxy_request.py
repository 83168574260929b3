"""A ``POST /v1/chat/completions`` or ``/v1/envhub/step`` body, checked before the agent proxy
(``trainer.rollout.proxy``) does anything with it, and ``ProxyError``, the OpenAI-style error
every check and route answers with.

``chat_request`` checks a body field by field: a bad one is a 400 that names it (and the fix),
never a half-recorded call. It normalises what OpenAI clients write in several ways to the one
form the policy's chat template renders, as OpenAI and vLLM read them:

- a ``developer`` message (newer SDKs, o-series clients) is a ``system`` message: OpenAI treats
  them alike, and chat templates know only ``system`` (a policy was never post-trained on a
  ``developer`` turn);
- content given as text parts is their text joined by newlines (vLLM's default content format);
- the legacy ``functions``/``function_call`` fields are refused naming ``tools``/``tool_choice``
  (ignored, the model would never see the functions).

Options the proxy cannot honour without changing what the policy samples are refused by name
(``n`` > 1, a ``tool_choice`` that forces a call, ``response_format`` other than text,
``top_logprobs``); other fields it does not use (``seed``, ``user``, ...) are ignored.
``ChatRequest.chars`` counts the characters a request holds, so a request far larger than the
context is refused before it is rendered (``AgentProxy.complete``), and ``max_messages`` refuses
one with more messages than the context has tokens before any of them is checked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.rollout.tool_parsers import CHAT_ROLES

__all__ = ["ChatRequest", "ProxyError", "chat_request", "step_action"]


class ProxyError(Exception):
    """An OpenAI-style error answer: HTTP ``status``, ``type`` and ``code``."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


# --------------------------------------------------------------------------- request checks


@dataclass(frozen=True)
class ChatRequest:
    """A ``POST /v1/chat/completions`` body, checked and normalised by ``chat_request``."""

    messages: list[dict[str, Any]]
    """The chat messages, normalised: text parts joined by newlines, ``developer`` as
    ``system`` (the module docstring)."""
    tools: list[dict[str, Any]] | None = None
    model: str | None = None
    max_tokens: int | None = None
    """``max_completion_tokens`` or ``max_tokens``: may only lower the run's budget."""
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    sampling: dict[str, float] = field(default_factory=dict)
    """The ``temperature``/``top_p`` asked for (ignored: the run samples; said once)."""
    chars: int = 0
    """Characters of text in the messages (content, tool calls, ``name``, ``tool_call_id``) and
    tools: with the number of messages, what bounds the prompt before it is rendered."""
    stop: tuple[str, ...] = ()
    """Stop strings: the turn ends at the first (``proxy_reply.cut_at_stop``)."""
    tool_choice: str = "auto"
    """``"auto"`` or ``"none"`` (tools rendered, no call parsed: the text is the content)."""


def chat_request(body: Mapping[str, Any], max_messages: int | None = None) -> ChatRequest:
    """``body`` checked field by field (a ``ProxyError`` 400 naming the first bad one) and
    normalised (the module docstring). Options the proxy cannot honour without changing what the
    policy samples (``tool_choice`` that forces a call, ``response_format`` other than text:
    guided decoding; ``top_logprobs``: the engines do not return them) are refused by name;
    other fields the proxy does not use (``seed``, ``user``, ...) are ignored. More than
    ``max_messages`` messages (the context's tokens: each message renders to one at least) are
    refused first (code ``context_length_exceeded``), before each is checked: a body of a
    million empty messages would otherwise hold the caller for seconds."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProxyError(400, "messages must be a non-empty list of chat messages", "messages")
    if max_messages is not None and len(messages) > max_messages:
        raise ProxyError(
            400,
            f"the request has {len(messages)} messages and each takes a token at least; this "
            f"model's context length is {max_messages} tokens (rollout context)",
            "context_length_exceeded",
        )
    _legacy_functions(body)
    checked = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = _tools(body.get("tools"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "must be a string (AgentEpisode.model)", model)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise _bad("n", "must be an integer (and 1)", n)
    if n not in (None, 1):
        raise ProxyError(
            400,
            "n > 1 is not supported by the training proxy: each call is one sample of the "
            "episode; make n calls",
            "unsupported_n",
        )
    limit = _positive(body, "max_completion_tokens")
    limit = limit if limit is not None else _positive(body, "max_tokens")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", 'must be an object ({"include_usage": true})', options)
    sampling = {k: _number(body, k) for k in ("temperature", "top_p") if body.get(k) is not None}
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise _bad("top_logprobs", "must be a non-negative integer", top)
    if top:
        raise _unsupported(
            "top_logprobs",
            "the engines return the sampled token's log-prob only; ask for "
            "logprobs without top_logprobs",
        )
    _response_format(body.get("response_format"))
    chars = sum(
        len(m.get("content") or "") + len(m.get("name") or "") + len(m.get("tool_call_id") or "")
        for m in checked
    )
    chars += sum(len(json.dumps(m.get("tool_calls"))) for m in checked if m.get("tool_calls"))
    return ChatRequest(
        checked,
        tools,
        model,
        limit,
        _flag(body, "logprobs"),
        _flag(body, "stream"),
        _flag(options or {}, "include_usage", "stream_options.include_usage"),
        sampling,
        chars + (len(json.dumps(tools)) if tools else 0),
        _stop(body.get("stop")),
        _tool_choice(body.get("tool_choice")),
    )


def _unsupported(where: str, why: str) -> ProxyError:
    return ProxyError(
        400, f"{where} is not supported by the training proxy: {why}", f"unsupported_{where}"
    )


def _legacy_functions(body: Mapping[str, Any]) -> None:
    """OpenAI's deprecated ``functions``/``function_call``, refused naming what replaced them
    (accepted and ignored, the model would never see the functions)."""
    for legacy, modern, form in (
        ("functions", "tools", '[{"type": "function", "function": {"name": ..., ...}}]'),
        ("function_call", "tool_choice", '"auto" or "none"'),
    ):
        if body.get(legacy) is not None:
            raise _unsupported(
                legacy,
                f"it is the deprecated form of {modern}; send {modern}={form} instead (the "
                "model would never see the functions)",
            )


def _stop(stop: Any) -> tuple[str, ...]:
    """``stop``: a string or a list of up to 4 (OpenAI's limit) non-empty strings."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise _bad("stop", "must be a non-empty string or a list of up to 4 of them", stop)
    for i, text in enumerate(stops):
        _unicode(text, f"stop[{i}]")
    return tuple(stops)


def _tool_choice(choice: Any) -> str:
    """``"auto"`` (or absent) and ``"none"``; a forced call would need guided decoding."""
    if choice in (None, "auto", "none"):
        return choice or "auto"
    if choice == "required" or isinstance(choice, dict):
        raise _unsupported(
            "tool_choice",
            f"{_show(choice)} forces a tool call, which needs guided decoding (it changes what "
            'the policy samples and its log-probs); use "auto" and check the reply, or "none"',
        )
    raise _bad("tool_choice", 'must be "auto", "none", "required" or a function', choice)


def _response_format(response_format: Any) -> None:
    """Only ``{"type": "text"}`` (or absent): a JSON mode would need guided decoding."""
    if response_format is None or response_format == {"type": "text"}:
        return
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    raise _unsupported(
        "response_format",
        f"{_show(kind)} needs guided decoding (it changes what the policy samples and its "
        "log-probs); ask for JSON in the prompt and parse the text",
    )


def step_action(body: Mapping[str, Any]) -> str | dict[str, Any]:
    """The ``action`` of a ``POST /v1/envhub/step`` body: text, or an assistant message whose
    content parts are joined and whose tool calls are checked, no two sharing an id."""
    if "action" not in body:
        raise ProxyError(400, 'the body needs "action": text or a message', "action")
    action = body["action"]
    if isinstance(action, str):
        _unicode(action, "action")
        return action
    if not isinstance(action, dict):
        raise ProxyError(400, "action must be text or an assistant message", "action")
    message = _message({**action, "role": "assistant"}, "action")
    _unique_ids(message.get("tool_calls") or [], "action.tool_calls")
    return message


def _unique_ids(calls: list[dict[str, Any]], where: str) -> None:
    """No two of ``calls`` share an id: the env's answers could not say which call each
    answers (a call without an id gets one of its own)."""
    first: dict[str, int] = {}
    for j, call in enumerate(calls):
        if call.get("id"):
            i = first.setdefault(call["id"], j)
            if i != j:
                raise ProxyError(
                    400,
                    f"{where}[{j}].id {call['id']!r} is also {where}[{i}]'s; give each call its "
                    "own id (the model's reply has them) or none (the proxy numbers it)",
                    "duplicate_tool_call_id",
                )


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _bad(where: str, what: str, value: Any) -> ProxyError:
    return ProxyError(400, f"{where} {what} (got {_show(value)})", "invalid_request")


def _unicode(value: Any, where: str) -> None:
    """Every string in ``value`` encodes as UTF-8 (JSON lets a lone surrogate through)."""
    try:
        (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)).encode()
    except UnicodeEncodeError as error:
        raise ProxyError(
            400,
            f"{where} is not valid Unicode (a lone surrogate at character {error.start}); send "
            "UTF-8 text",
            "invalid_unicode",
        ) from None


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, "must be a string", value)
    _unicode(value, where)
    return value


def _content(content: Any, where: str) -> str | None:
    """A message's content as text: a string, null, or text parts (joined by newlines)."""
    if content is None or isinstance(content, str):
        _unicode(content or "", where)
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be text, a list of text parts or null", content)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, dict) and kind != "text":
            raise ProxyError(
                400,
                f"{where}[{j}] is a {kind!r} part; the training proxy takes text parts only "
                '({"type": "text", "text": ...}): the policy reads text',
                "unsupported_content",
            )
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]", 'must be a text part {"type": "text", "text": ...}', part)
        texts.append(_string(part["text"], f"{where}[{j}].text"))
    return "\n".join(texts)  # as vLLM joins them (its default "string" content format)


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise _bad(where, "must be a chat message (an object with a role)", message)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise _bad(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}", role)
    checked = dict(message)
    if role == "developer":  # OpenAI's newer name for it; chat templates know only "system"
        checked["role"] = "system"
    if "content" in message:
        checked["content"] = _content(message["content"], f"{where}.content")
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            _string(message[key], f"{where}.{key}")
    if message.get("tool_calls") is not None:
        checked["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    _unicode({k: v for k, v in message.items() if k not in ("content", "tool_calls")}, where)
    return checked


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(where, "must be a list of tool calls", calls)
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _bad(f"{at}.function", 'must be an object {"name": ..., "arguments": ...}', call)
        _string(function.get("name"), f"{at}.function.name")
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str | dict):
            raise _bad(f"{at}.function.arguments", "must be a JSON string or an object", arguments)
        if call.get("id") is not None:
            _string(call["id"], f"{at}.id")
        _unicode(call, at)
    return calls


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    shape = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
    if not isinstance(tools, list):
        raise _bad("tools", f"must be a list of function tools {shape}", tools)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise _bad(f"tools[{i}]", f"must be a function tool {shape}", tool)
        _string(function.get("name"), f"tools[{i}].function.name")
        for key, kind in (("description", str), ("parameters", dict)):
            value = function.get(key)
            if value is not None and not isinstance(value, kind):
                raise _bad(f"tools[{i}].function.{key}", f"must be a {kind.__name__}", value)
    _unicode(tools, "tools")
    return tools


def _positive(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise _bad(key, "must be a positive integer", value)
    return value


def _number(body: Mapping[str, Any], key: str) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(key, "must be a number", value)
    return float(value)


def _flag(body: Mapping[str, Any], key: str, where: str | None = None) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise _bad(where or key, "must be true or false", value)
    return bool(value)
