"""An agent that plays envs through any OpenAI-compatible chat-completions endpoint.

``ModelAgent(client, model)`` is what ``envhub eval --model URL`` plays (vLLM's server, a
hosted API, the trainer's own policy served by vLLM). Each turn it sends the conversation so
far (the env's messages and its own earlier turns) to ``client.chat.completions.create``, with
the env's tool schemas as ``tools=`` when the env publishes them, and hands the env the reply:

- a reply with ``tool_calls`` becomes those calls in envhub's ``<tool_call>`` form, the text
  every tool env parses (arguments that are not JSON reach the env as written, and the env
  answers them with its feedback and penalty, as it would the trainer's policy);
- the env's ``role: tool`` answers are linked back to the call ids the server gave, so the
  next request is a well-formed tool conversation;
- a reply without calls is its text (text envs, and models that write calls as text).

``tools="auto"`` (the default) sends tools and, if the server refuses them (vLLM started
without ``--enable-auto-tool-choice``), plays on without them for the rest of the run: tool
envs describe their tools in the prompt, and the model writes calls as text. ``"native"``
keeps refusing servers an error; ``"text"`` never sends tools.

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
from dataclasses import dataclass
from typing import Any, Literal

from envhub.errors import EnvhubError
from envhub.parsing import message_text
from envhub.tool_calls import ToolCall

__all__ = [
    "KEY_HINT",
    "URL_HINT",
    "AgentError",
    "AgentTurn",
    "ModelAgent",
    "ModelEndpointError",
    "ToolsMode",
    "api_messages",
    "link_tool_answers",
    "resolve_model",
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
    """One request failed after the client's retries; ends the episode as failed."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail[:500]


@dataclass(frozen=True)
class AgentTurn:
    """One turn of an agent: the env's action and the assistant message for the transcript."""

    action: str
    message: dict[str, Any]
    tokens_in: int = 0
    tokens_out: int = 0
    seconds: float = 0.0
    """Wall time of the request (0 for agents that make none)."""
    fallback: bool = False
    """The agent had no move of its own and played a random action (``expert`` on a state whose
    ``expert_action()`` returned None)."""


def api_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The transcript as chat-completions messages: only the keys each role may carry."""
    out = []
    for message in messages:
        keys = _KEYS.get(str(message.get("role")), ("role", "content"))
        out.append({k: message[k] for k in keys if message.get(k) is not None})
        out[-1].setdefault("content", "")
    return out


def link_tool_answers(
    assistant: dict[str, Any], answers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The env's reply with its ``role: tool`` messages carrying the ids of the assistant's
    calls, in order (the env numbers calls its own way; the server needs its own ids back)."""
    ids = [call["id"] for call in assistant.get("tool_calls") or []]
    linked, position = [], 0
    for message in answers:
        if message.get("role") == "tool" and position < len(ids):
            message = {**message, "tool_call_id": ids[position]}
            position += 1
        linked.append(message)
    return linked


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
        self, env: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> AgentTurn:
        """The model's next turn after ``messages``; ``AgentError`` if the server fails it."""
        import openai

        send_tools = bool(tools) and self._send_tools
        request: dict[str, Any] = {
            "model": self.model,
            "messages": api_messages(messages),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
        }
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
                return self.act(env, messages, tools)
            raise AgentError(_reason(error), str(error)) from None
        except (openai.OpenAIError, ValueError) as error:  # ValueError: a body that is not JSON
            raise AgentError(_reason(error), f"{type(error).__name__}: {error}") from None
        seconds = time.perf_counter() - start
        try:
            message = response.choices[0].message
            calls = [
                {
                    "id": call.id or ToolCall.numbered_id(i),
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call.function.arguments or "{}",
                    },
                }
                for i, call in enumerate(message.tool_calls or [])
            ]
            content = message.content or ""
            usage = response.usage
        except (AttributeError, IndexError, TypeError) as error:
            raise AgentError("bad_response", f"not a chat completion: {error}") from None
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = calls
        return AgentTurn(
            action=message_text({"content": content, "tool_calls": calls}),
            message=assistant,
            tokens_in=int(getattr(usage, "prompt_tokens", 0) or 0),
            tokens_out=int(getattr(usage, "completion_tokens", 0) or 0),
            seconds=seconds,
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
