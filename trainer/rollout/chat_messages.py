"""Chat-message helpers shared by the chat renderer, the env manager and the agent proxy.

``dict_arguments`` gives a chat template tool calls the way it expects them (``arguments`` as a
dict, as vLLM and ``transformers`` pass them); ``same_message`` says whether two messages say the
same (the proxy's test for a call that extends the last one); ``answer_calls`` makes an env's
reply answer every tool call of the action (as ``envhub eval`` sends it to strict APIs), so the
policy reads the same context in training, behind the proxy and in evaluation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from envhub.model_agent import NOT_RUN
from envhub.tool_calls import ToolCall

__all__ = ["answer_calls", "call_ids", "dict_arguments", "same_message"]


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


def answer_calls(ids: list[str], answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The env's ``answers`` to a step whose action made calls with ``ids`` (in order), each id
    answered by one tool message; ``answers`` as they are without calls.

    The answers come first, in the order of the calls (a template that renders them without
    ids, ChatML's ``<tool_response>``, pairs them by position), then the env's other messages
    (its feedback) as it wrote them. An env numbers a turn's calls itself
    (``ToolCall.numbered_id`` of a call's position; the rollouts' parsers number them so too):
    a tool message numbered ``k`` answers the ``k``-th call, one with another id the first call
    not yet answered. A call left unanswered (the env refused the reply: an unknown tool,
    arguments off the schema, too many calls) is answered ``NOT_RUN``, as ``envhub eval``
    answers it. A tool message beyond the calls is kept as the env wrote it."""
    if not ids:
        return answers
    numbered = {ToolCall.numbered_id(k): k for k in range(len(ids))}
    answered: dict[int, dict[str, Any]] = {}  # call position -> its tool message
    extra, rest = [], []
    for message in answers:
        if message.get("role") != "tool":
            rest.append(message)
            continue
        position = numbered.get(str(message.get("tool_call_id")))
        if position is None or position in answered:
            position = next((k for k in range(len(ids)) if k not in answered), None)
        if position is None:
            extra.append(message)
        else:
            answered[position] = {**message, "tool_call_id": ids[position]}
    not_run = {"role": "tool", "content": NOT_RUN}
    linked = [answered.get(k, {**not_run, "tool_call_id": i}) for k, i in enumerate(ids)]
    return linked + extra + rest


def call_ids(message: Mapping[str, Any]) -> list[str]:
    """The ids of ``message``'s tool calls, in order (none for a message without calls)."""
    calls = message.get("tool_calls") if isinstance(message, Mapping) else None
    return [str(call.get("id")) for call in calls or [] if isinstance(call, Mapping)]
