"""Chat-message helpers shared by the chat renderer and the agent proxy.

``dict_arguments`` gives a chat template tool calls the way it expects them (``arguments`` as a
dict, as vLLM and ``transformers`` pass them); ``same_message`` says whether two messages say the
same (the proxy's test for a call that extends the last one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["dict_arguments", "same_message"]


def dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its tool calls' ``function.arguments`` as a dict where they are a JSON
    string (``ToolCall.as_message`` and OpenAI clients write strings): templates write
    ``arguments | tojson`` (Qwen2.5, Llama 3.1), which would show a string double-encoded, so
    vLLM and HF give them dicts too. Shallow copies; a string that is no JSON object stays."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls or not isinstance(calls, list):
        return message
    copied, changed = [], False
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str) and isinstance(loaded := _loaded(arguments), dict):
            call = {**call, "function": {**function, "arguments": loaded}}  # type: ignore[dict-item]
            changed = True
        copied.append(call)
    return {**message, "tool_calls": copied} if changed else message


def _loaded(arguments: Any) -> Any:
    """Tool-call ``arguments`` as their JSON value when they are a JSON string, else as given."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def _calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        function = (call.get("function") or {}) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments")
        out.append((str(function.get("name")), _loaded(arguments)))
    return out


def same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two chat messages say the same: role, text and tool calls (name + arguments).
    Keys an SDK adds (``refusal: null``, call ids, ``type``) do not count."""
    return (
        a.get("role") == b.get("role")
        and _text(a.get("content")) == _text(b.get("content"))
        and _calls(a) == _calls(b)
    )
