"""What the agent proxy tells the agent (``trainer.rollout.proxy``): of a generation, the turn
cut at a ``stop`` string and the OpenAI ``chat.completion`` body; of an env step, its answers
to the action's tool calls (``chat_messages.answer_calls``, which the env manager uses too).

1. **Stop strings** (``cut_at_stop``): the turn ends with the first token whose text completes
   a stop string; the tokens after it are dropped from the result (never trained, never
   returned), and the returned content ends before the stop string, as OpenAI's does, with
   ``finish_reason`` ``"stop"``. The kept tokens were sampled exactly as they would have been
   had the engine stopped there (each token depends only on those before it), so their
   log-probs stay the policy's. The engines take stop *token ids* only, so they generate past
   the string until the end of the turn or the budget; that costs time, not fidelity.
2. **Log-probs** list the tokens of the returned text, one entry per token in order: its
   text (``token_texts``: what it adds to the text before it, so the entries' texts, and their
   UTF-8 ``bytes``, join to the text even where a character spans several tokens) and its
   log-prob. Not listed, though trained: the end-of-turn token that closes the turn, and with
   ``stop`` the tokens from the one where the stop string begins (OpenAI's content ends before
   it; a token holding the content's end and the stop string's start goes with the stop
   string). ``top_logprobs`` are empty (refused when asked for: ``proxy_request``).
3. ``token_ids`` (vLLM's extension) and ``usage`` count the tokens trained for the call: the
   stop string's tokens included (the policy ended its turn with them, and the conversation
   the next call extends holds them), as vLLM's ``token_ids`` do.
4. **Every tool call of a step is answered once** (``answered``), as strict
   chat APIs (api.openai.com) and the agent frameworks that check for them require: a ``tool``
   message for each call id, in the order of the calls, right after the action, then the env's
   other messages (its feedback), by ``envhub.model_agent.answer_tool_calls`` as ``envhub
   eval`` and the env manager answer them (a call the env refused: ``NOT_RUN``). The env read
   the action as text, so its tool messages carry its own numbering of the calls
   (``ToolCall.numbered_id`` of a call's position), never the agent's ids: the calls are
   answered under those numbers, then renamed to the agent's ids. The agent sends the answers back
   with its next call, which renders them into the policy's prompt: they are trained as
   context exactly as rendered, like any message of a call.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from envhub.model_agent import answer_tool_calls
from envhub.tool_calls import ToolCall

if TYPE_CHECKING:
    from trainer.rollout.trajectory import ChatRenderer
    from trainer.strategies.base import GenerationResult

__all__ = ["answered", "completion_body", "cut_at_stop", "cut_content", "token_texts"]


def cut_at_stop(
    renderer: ChatRenderer, result: GenerationResult, stops: tuple[str, ...]
) -> GenerationResult:
    """``result`` ending with the token that completes the first of ``stops`` in its text
    (guarantee 1), or ``result`` itself when its text holds none."""
    ids = list(result.token_ids)
    if not stops or not ids:
        return result

    def holds(count: int) -> bool:
        text = renderer.decode(ids[:count], skip_special_tokens=False)
        return any(stop in text for stop in stops)

    if not holds(len(ids)):
        return result
    low, high = 1, len(ids)  # the shortest prefix that holds a stop string: monotone in length
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    extra = dict(result.extra)
    resumed = extra.get("token_versions")
    if resumed:  # the versions of the generation's last len(resumed) tokens
        extra["token_versions"] = list(resumed)[: max(0, len(resumed) - (len(ids) - low))]
    return replace(
        result,
        token_ids=ids[:low],
        logprobs=list(result.logprobs)[:low],
        finish_reason="stop",
        extra=extra,
    )


def cut_content(reply: dict[str, Any], stops: tuple[str, ...]) -> dict[str, Any]:
    """``reply`` whose content ends before the first stop string in it (OpenAI's semantics)."""
    content = reply.get("content")
    if not stops or not isinstance(content, str):
        return reply
    found = [content.find(stop) for stop in stops if stop in content]
    return {**reply, "content": content[: min(found)]} if found else reply


def completion_body(
    renderer: ChatRenderer,
    *,
    completion_id: str,
    model: str,
    reply: dict[str, Any],
    result: GenerationResult,
    prompt_tokens: int,
    logprobs: bool,
    stops: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` answer, plus vLLM's ``token_ids`` extension and the
    ``policy_version`` that sampled it; ``stops``: the request's stop strings (guarantee 2)."""
    finish = "tool_calls" if reply.get("tool_calls") else result.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or None}
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    ids = list(result.token_ids)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": {"content": _logprobs(renderer, result, stops)} if logprobs else None,
                "token_ids": ids,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids),
            "total_tokens": prompt_tokens + len(ids),
        },
        "policy_version": result.policy_version,
    }


def _logprobs(
    renderer: ChatRenderer, result: GenerationResult, stops: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Guarantee 2: the returned text's tokens, as text and bytes, with their log-probs."""
    ids = list(result.token_ids)
    end = len(ids)
    while end and ids[end - 1] in renderer.turn_end_ids:
        end -= 1
    texts = token_texts(renderer, ids[:end])
    listed = _before_stop(texts, stops)
    return [
        {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
        for text, logprob in zip(texts[:listed], result.logprobs[:listed], strict=True)
    ]


def _before_stop(texts: list[str], stops: tuple[str, ...]) -> int:
    """How many of the tokens (``texts``) end before the first stop string in their text
    begins (all of them when it holds none)."""
    joined = "".join(texts)
    found = [joined.find(stop) for stop in stops if stop in joined]
    if not found:
        return len(texts)
    stop_at, position = min(found), 0
    for index, text in enumerate(texts):
        position += len(text)
        if position > stop_at or (not text and position == stop_at):
            return index
    return len(texts)


_PENDING = "\ufffd"
"""What a decoder shows for a character whose bytes have not all come yet."""


def token_texts(renderer: ChatRenderer, ids: list[int]) -> list[str]:
    """The text each of ``ids`` adds to the text of the tokens before it, so the parts join to
    the text of ``ids`` whatever the tokenizer: a character whose bytes span several tokens
    (byte-level BPE: Qwen, Llama 3, GPT-2) goes with the token that completes it, the ones
    before it add ""; a sentencepiece token keeps the leading space that decoding it alone
    drops. As vLLM's incremental detokenizer, each token decodes a window of a few tokens, so
    this is linear in the text."""
    texts: list[str] = []
    prefix = read = 0  # ids[prefix:read]: tokens already given out, kept as context
    before = ""
    for end in range(1, len(ids) + 1):
        after = renderer.decode(ids[prefix:end], skip_special_tokens=False)
        # a character is 4 bytes at most: pending after 4 tokens, the text holds a real U+FFFD
        if len(after) > len(before) and (not after.endswith(_PENDING) or end - read >= 4):
            texts.append(after[len(before) :])
            prefix, read = read, end
            before = renderer.decode(ids[prefix:read], skip_special_tokens=False)
        else:
            texts.append("")
    if read < len(ids):  # the text ends inside a character: the last token gives what is left
        texts[-1] = renderer.decode(ids[prefix:], skip_special_tokens=False)[len(before) :]
    return texts


def answered(
    calls: list[dict[str, Any]], answers: list[dict[str, Any]], *, refused: bool
) -> list[dict[str, Any]]:
    """The env's ``answers`` to a step whose action made ``calls`` (each with its id), every
    call answered once (guarantee 4; ``refused``: the env flagged the action invalid)."""
    numbers = [ToolCall.numbered_id(k) for k in range(len(calls))]
    agents = dict(zip(numbers, (str(call["id"]) for call in calls), strict=True))
    return [
        {**m, "tool_call_id": agents[m["tool_call_id"]]} if m.get("role") == "tool" and calls else m
        for m in answer_tool_calls(numbers, answers, refused=refused)
    ]
