"""An agent that plays envs through any OpenAI-compatible chat-completions endpoint.

``ModelAgent(client, model)`` is what ``envhub eval --model URL`` plays (vLLM's server, a
hosted API, the trainer's own policy served by vLLM). Each turn it sends the conversation so
far (the env's messages and its own earlier turns) to ``client.chat.completions.create``, with
the env's tool schemas as ``tools=`` when the env publishes them, and hands the env the reply:

- a reply with ``tool_calls`` goes to ``env.step`` as the assistant message itself
  (``envhub.evaluate`` steps with ``AgentTurn.message``), so an env that reads tool calls as
  data (``structured_actions``: every ``ToolEnv``) answers with the ids the server gave;
  other envs read it as text, the calls in envhub's ``<tool_call>`` form
  (arguments that are not JSON reach the env as written, and the env answers them with its
  feedback and penalty, as it would the trainer's policy);
- a reply without calls is its text (text envs, and models that write calls as text).

The conversation sent back obeys the chat-completions rules that strict APIs (api.openai.com,
DeepSeek, DashScope, litellm in front of them) enforce with a 400, which vLLM does not check:

1. every call id of an assistant message is answered by one ``role: tool`` message right
   after it (``answer_tool_calls``): a call the env refused (an unknown tool, arguments that
   are not JSON, too many calls) is answered by a tool message saying it was not run, and the
   env's feedback follows as it wrote it, so a bad call is an invalid action the model can
   recover from, not an endpoint failure;
2. a ``role: tool`` message that answers no call of the assistant message before it (text
   calls: ``--tools text``, or ``auto`` once a server refused ``tools=``) is sent as a ``user``
   message holding the result in ``<tool_response>`` tags (``api_messages``);
3. only the keys each role may carry are sent: the ``finish_reason`` and
   ``reasoning_content`` that the record keeps on each assistant message are not (DeepSeek
   refuses ``reasoning_content`` sent back);
4. text is sent as valid UTF-8: a lone surrogate (a JSON reply can carry one; the env sees it
   as the model wrote it, and refuses it) is sent as U+FFFD, else the request could not be
   encoded;
5. every call of a reply has an id of its own (``unique_call_ids``): a server that gives two
   calls one id would leave their answers ambiguous, and a strict API refuses the second
   answer of an id. The env, the record and the next request all see the ids made unique.

``tools="auto"`` (the default) sends tools and, if the server refuses them (vLLM started
without ``--enable-auto-tool-choice``), plays on without them for the rest of the run: tool
envs describe their tools in the prompt, and the model writes calls as text. ``"native"``
keeps refusing servers an error; ``"text"`` never sends tools.

Each request carries a ``seed`` (``sampling_seed``: one per episode seed and try), so a run
at temperature > 0 asks for the same samples again where the server honours it (vLLM and
OpenAI do; others ignore it).

Retries with exponential backoff on 408/409/429/5xx and connection errors, and the per-request
timeout, are the ``openai`` client's own (``OpenAI(max_retries=..., timeout=...)``). What still
fails raises ``AgentError`` with a short ``reason`` that ``envhub.evaluate`` records as the
episode's failure: ``timeout``, ``connection``, ``http_<status>``, ``context_length``,
``bad_response`` (a body that is not a chat completion).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from envhub.errors import EnvhubError
from envhub.parsing import message_text, valid_text
from envhub.tool_calls import ToolCall

__all__ = [
    "ANSWERED_BELOW",
    "KEY_HINT",
    "NOT_RUN",
    "URL_HINT",
    "AgentError",
    "AgentTurn",
    "ModelAgent",
    "ModelEndpointError",
    "ToolsMode",
    "answer_tool_calls",
    "api_messages",
    "call_ids",
    "resolve_model",
    "sampling_seed",
    "unique_call_ids",
]

ToolsMode = Literal["auto", "native", "text"]
_log = logging.getLogger(__name__)
_KEYS = {
    "system": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "tool_calls"),
    "tool": ("role", "content", "tool_call_id"),
}


KEY_HINT = (
    "set a valid key in $OPENAI_API_KEY, or name the variable that holds it with --api-key-env"
)
URL_HINT = "does the URL end in /v1? (e.g. http://127.0.0.1:8000/v1)"


class ModelEndpointError(EnvhubError):
    """The endpoint cannot be used at all (unreachable, no such model): nothing was played."""


class AgentError(Exception):
    """One request failed after the client's retries; ends the episode as failed.

    ``seconds``: how long the failed request took (its retries included), for the latency
    figures, which would otherwise hide a slow or hanging server; None where no request was
    made (a built-in agent's error)."""

    def __init__(self, reason: str, detail: str, seconds: float | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.seconds = reason, detail[:500], seconds


@dataclass(frozen=True)
class AgentTurn:
    """One turn of an agent: the env's action and the assistant message for the transcript."""

    action: str
    """The reply as text, its calls in envhub's ``<tool_call>`` form (``message_text``).
    ``envhub.evaluate`` steps the env with ``message`` instead when it has ``tool_calls``."""
    message: dict[str, Any]
    tokens_in: int = 0
    tokens_out: int = 0
    seconds: float = 0.0
    """Wall time of the request (0 for agents that make none)."""
    fallback: bool = False
    """The agent had no move of its own and played a random action (``expert`` on a state whose
    ``expert_action()`` returned None)."""
    finish_reason: str | None = None
    """Why the model's reply ended, as the server said (``"length"``: cut off at
    ``max_tokens``); None for agents that make no request."""


def api_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The transcript as chat-completions messages: only the keys each role may carry, and a
    ``role: tool`` message that answers no call of the assistant message before it sent as a
    ``user`` message holding ``<tool_response>`` blocks (consecutive ones merged), since strict
    APIs refuse it as a tool message (module docstring, rule 2)."""
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # the ids of the last assistant message's calls
    for message in messages:
        role = str(message.get("role"))
        if role == "tool" and message.get("tool_call_id") not in calls:
            text = valid_text(str(message.get("content") or ""))
            block = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_responses": True})
            continue
        if role == "assistant":
            calls = {str(c.get("id")) for c in message.get("tool_calls") or [] if c.get("id")}
        keys = _KEYS.get(role, ("role", "content"))
        out.append({k: valid_text(message[k]) for k in keys if message.get(k) is not None})
        out[-1].setdefault("content", "")
    for message in out:
        message.pop("tool_responses", None)
    return out


NOT_RUN = "Not run: this call was refused; see the message that follows."
"""The tool message answering a call of a reply the env refused (``answer_tool_calls``)."""

ANSWERED_BELOW = "See the message that follows."
"""The tool message answering a call the env answered in its other messages, not by a tool
message of its own (``answer_tool_calls``)."""


def call_ids(message: Mapping[str, Any]) -> list[str]:
    """The ids of ``message``'s tool calls, in order (none for a message without calls)."""
    calls = message.get("tool_calls") if isinstance(message, Mapping) else None
    return [str(call.get("id")) for call in calls or [] if isinstance(call, Mapping)]


def answer_tool_calls(
    ids: list[str], answers: list[dict[str, Any]], *, refused: bool = True
) -> list[dict[str, Any]]:
    """The env's ``answers`` to a reply whose calls have ``ids`` (in order), as a strict API
    takes them: every call answered by exactly one ``role: tool`` message, the answers first
    and in the order of the calls (a template that renders them without ids, ChatML's
    ``<tool_response>``, pairs them by position), then the env's other messages (its feedback)
    in their order. Without calls, ``answers`` is returned as it is.

    Which call a tool message answers: the call with its id; else the ``k``-th call when its id
    is ``ToolCall.numbered_id(k)`` (an env that read the calls as text numbers them so); else
    the first call not yet answered. A second answer to a call, or one beyond the calls, joins
    the other messages as a ``user`` message (a tool message that answers no call is refused).
    A call left unanswered gets ``NOT_RUN`` when the env flagged the reply invalid
    (``refused``: it was not run), else ``ANSWERED_BELOW`` (the env answered in prose)."""
    if not ids:
        return answers
    numbered = {ToolCall.numbered_id(k): k for k in range(len(ids))}
    own = {call_id: k for k, call_id in enumerate(ids)}
    answered: dict[int, dict[str, Any]] = {}  # call position -> its tool message
    rest = []
    for message in answers:
        if message.get("role") != "tool":
            rest.append(message)
            continue
        said = str(message.get("tool_call_id"))
        position = own.get(said, numbered.get(said))
        if position is None or position in answered:
            position = None if said in own or said in numbered else _first_open(ids, answered)
        if position is None:
            rest.append({"role": "user", "content": message.get("content", "")})
        else:
            answered[position] = {**message, "tool_call_id": ids[position]}
    unanswered = NOT_RUN if refused else ANSWERED_BELOW
    linked = [
        answered.get(k, {"role": "tool", "tool_call_id": call_id, "content": unanswered})
        for k, call_id in enumerate(ids)
    ]
    return linked + rest


def _first_open(ids: list[str], answered: dict[int, Any]) -> int | None:
    return next((k for k in range(len(ids)) if k not in answered), None)


def unique_call_ids(ids: list[str | None]) -> list[str]:
    """One id per call of a reply, each its own (module docstring, rule 5): the server's, where
    no earlier call of the reply has it; else ``ToolCall.numbered_id`` of the call's place, or
    the next number no id of the reply holds."""
    given = {i for i in ids if i}
    unique: list[str] = []
    taken: set[str] = set()
    for index, server_id in enumerate(ids):
        call_id = server_id or ""
        number = index
        while not call_id or call_id in taken:  # (the numbers from the call's place up)
            numbered = ToolCall.numbered_id(number)
            call_id = "" if numbered in given else numbered
            number += 1
        unique.append(call_id)
        taken.add(call_id)
    return unique


def sampling_seed(seed: int, sample: int) -> int:
    """The ``seed`` sent with the requests of try ``sample`` of episode ``seed``: one per
    (seed, try), so each try samples differently and a rerun asks for the same samples; kept
    below 2**31, which every server that takes a seed accepts."""
    return (seed * 1_000_003 + sample) % (2**31 - 1)


def resolve_model(client: Any, model: str | None) -> str:
    """The model name to request: ``model`` if the server serves it, the server's only model if
    ``model`` is None; otherwise ``ModelEndpointError`` naming what the server has, or why it
    cannot be used (unreachable, a refused API key, not an OpenAI API)."""
    import openai

    url = client.base_url
    try:
        ids = [m.id for m in client.models.list()]
    except openai.APIConnectionError as error:
        raise ModelEndpointError(
            f"cannot reach {url} ({error}); is the server running? "
            "(vLLM: python -m vllm.entrypoints.openai.api_server --model DIR)"
        ) from None
    except openai.APIStatusError as error:
        status = error.status_code
        if status in (401, 403):
            raise ModelEndpointError(
                f"{url} refused the API key (HTTP {status}); {KEY_HINT}"
            ) from None
        if status == 404 and (model is None or not str(url).rstrip("/").endswith("/v1")):
            raise ModelEndpointError(f"{url} has no /models (HTTP 404); {URL_HINT}") from None
        if model is not None:  # some hosted APIs do not list models: trust the name
            return model
        raise ModelEndpointError(
            f"{url} did not list its models (HTTP {status}); pass --model-name"
        ) from None
    except Exception as error:  # noqa: BLE001 - an HTML page, a JSON list: anything but the API
        raise ModelEndpointError(
            f"{url} did not answer like an OpenAI /v1 API ({type(error).__name__}: {error}); "
            f"{URL_HINT}"
        ) from None
    served = [i for i in ids if isinstance(i, str) and i]
    if model is None:
        if len(served) == 1:
            return served[0]
        if ids and not served:
            raise ModelEndpointError(
                f"{url} lists {len(ids)} model(s) without an id; name one with --model-name"
            )
        raise ModelEndpointError(
            f"{url} serves {len(served)} models {served[:20]}; pick one with --model-name"
        )
    if served and model not in served:
        raise ModelEndpointError(
            f"{url} does not serve model {model!r}; it serves {served[:20]} (--model-name)"
        )
    return model


def _reason(error: Exception) -> str:
    import openai

    if isinstance(error, openai.APITimeoutError):
        return "timeout"
    if isinstance(error, openai.APIConnectionError):
        return "connection"
    if isinstance(error, openai.APIStatusError):
        text = str(error).lower()
        if error.status_code == 400 and ("context length" in text or "too long" in text):
            return "context_length"
        return f"http_{error.status_code}"
    return "bad_response"


def _since(start: float) -> float:
    return time.perf_counter() - start


def _reasoning(message: Any) -> str:
    """The model's thinking, where the server returns it apart from the content (vLLM's
    reasoning parsers and DeepSeek: ``reasoning_content``; OpenRouter: ``reasoning``)."""
    for name in ("reasoning_content", "reasoning"):
        value = getattr(message, name, None)
        if isinstance(value, str) and value:
            return value
    return ""


def _refuses_tools(error: Exception) -> bool:
    text = str(error).lower()
    return "tool" in text and ("auto" in text or "not support" in text or "parser" in text)


class ModelAgent:
    """Plays with ``client`` (an ``openai.OpenAI``) and ``model``; safe to share across threads
    (the client is, and the agent keeps no per-episode state)."""

    def __init__(
        self,
        client: Any,
        model: str,
        *,
        temperature: float = 0.7,
        top_p: float = 1.0,
        max_tokens: int = 512,
        tools: ToolsMode = "auto",
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        self.client, self.model = client, model
        self.name = model
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_tokens
        self.tools_mode: ToolsMode = tools
        self.extra_body = dict(extra_body or {})
        self._send_tools = tools != "text"
        self._lock = threading.Lock()

    def act(
        self,
        env: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        seed: int | None = None,
    ) -> AgentTurn:
        """The model's next turn after ``messages``; ``AgentError`` if the server fails it.
        ``seed`` is sent as the request's ``seed`` (``sampling_seed``; None: not sent)."""
        import openai

        send_tools = bool(tools) and self._send_tools
        request: dict[str, Any] = {
            "model": self.model,
            "messages": api_messages(messages),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
        }
        if seed is not None:
            request["seed"] = seed
        if send_tools:
            request["tools"] = tools
        if self.extra_body:
            request["extra_body"] = self.extra_body
        start = time.perf_counter()
        try:
            response = self.client.chat.completions.create(**request)
        except openai.BadRequestError as error:
            if send_tools and self.tools_mode == "auto" and _refuses_tools(error):
                self._play_without_tools(error)
                return self.act(env, messages, tools, seed=seed)
            raise AgentError(_reason(error), str(error), _since(start)) from None
        except (openai.OpenAIError, ValueError) as error:  # ValueError: a body that is not JSON
            detail = f"{type(error).__name__}: {error}"
            raise AgentError(_reason(error), detail, _since(start)) from None
        seconds = _since(start)
        try:
            choice = response.choices[0]
            message = choice.message
            server_calls = message.tool_calls or []
            ids = unique_call_ids([call.id for call in server_calls])
            calls = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call.function.arguments or "{}",
                    },
                }
                for call_id, call in zip(ids, server_calls, strict=True)
            ]
            content = message.content or ""
            usage = response.usage
        except (AttributeError, IndexError, TypeError) as error:
            detail = f"not a chat completion: {error}"
            raise AgentError("bad_response", detail, seconds) from None
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = calls
        finish = getattr(choice, "finish_reason", None)
        assistant["finish_reason"] = finish if isinstance(finish, str) else None
        reasoning = _reasoning(message)
        if reasoning:
            assistant["reasoning_content"] = reasoning
        return AgentTurn(
            action=message_text({"content": content, "tool_calls": calls}),
            message=assistant,
            tokens_in=int(getattr(usage, "prompt_tokens", 0) or 0),
            tokens_out=int(getattr(usage, "completion_tokens", 0) or 0),
            seconds=seconds,
            finish_reason=assistant["finish_reason"],
        )

    def _play_without_tools(self, error: Exception) -> None:
        with self._lock:
            if self._send_tools:
                self._send_tools = False
                _log.warning(
                    "%s refuses tools= (%s); playing on without them: the model writes tool "
                    "calls as text (start vLLM with --enable-auto-tool-choice "
                    "--tool-call-parser hermes for native calls)",
                    self.client.base_url,
                    str(error)[:200],
                )
