"""The agent proxy's HTTP surface (``trainer.rollout.proxy``): its routes, the checks a request
passes before anything happens, OpenAI-style error bodies, server-sent events, and the uvicorn
server with the limits that keep one client from holding it.

The routes and what they answer are listed in ``trainer.rollout.proxy``'s docstring; this
module maps them to ``AgentProxy`` methods (``complete``, ``describe``, ``step``). Every body
is read within ``ServerLimits`` and checked (``chat_request``, ``step_action``) before the
proxy sees it, so a malformed field is a 400 that names it and never a half-recorded call.
A ``ProxyError`` is its own status and OpenAI-style body with ``x-should-retry: false`` (the
``openai`` SDK would retry a 409 or 5xx and show the agent the retry's 410; only a late body's
408 may be retried); anything else is one logged 500 that keeps the server up; an unknown route
or method answers 404/405 in the same form. A model call whose client disconnects before its
answer is cancelled (``_unless_disconnected``: nothing is recorded). Plain
Starlette (what FastAPI is built on): no dependency injection or response encoding to pay
for on every call of every episode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from trainer.config_rollout import ServerLimits
from trainer.rollout.tool_parsers import CHAT_ROLES

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from trainer.rollout.proxy import AgentProxy

__all__ = [
    "ChatRequest",
    "ProxyError",
    "ServerLimits",
    "chat_request",
    "listen",
    "proxy_app",
    "step_action",
]

_log = logging.getLogger("trainer.rollout.proxy")
T = TypeVar("T")


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
    """The chat messages; a content given as text parts is their text joined."""
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
    """Characters of text in the messages and tools (bounds the prompt before encoding)."""
    stop: tuple[str, ...] = ()
    """Stop strings: the turn ends at the first (``proxy_reply.cut_at_stop``)."""
    tool_choice: str = "auto"
    """``"auto"`` or ``"none"`` (tools rendered, no call parsed: the text is the content)."""


def chat_request(body: Mapping[str, Any]) -> ChatRequest:
    """``body`` checked field by field (a ``ProxyError`` 400 naming the first bad one), with
    content parts joined into text. Options the proxy cannot honour without changing what the
    policy samples (``tool_choice`` that forces a call, ``response_format`` other than text:
    guided decoding; ``top_logprobs``: the engines do not return them) are refused by name;
    other fields the proxy does not use (``seed``, ``user``, ...) are ignored."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProxyError(400, "messages must be a non-empty list of chat messages", "messages")
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
    chars = sum(len(m.get("content") or "") for m in checked)
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
    content parts are joined and whose tool calls are checked."""
    if "action" not in body:
        raise ProxyError(400, 'the body needs "action": text or a message', "action")
    action = body["action"]
    if isinstance(action, str):
        _unicode(action, "action")
        return action
    if not isinstance(action, dict):
        raise ProxyError(400, "action must be text or an assistant message", "action")
    return _message({**action, "role": "assistant"}, "action")


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
    """A message's content as text: a string, null, or text parts (joined)."""
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
    return "".join(texts)


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise _bad(where, "must be a chat message (an object with a role)", message)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise _bad(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}", role)
    checked = dict(message)
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


# --------------------------------------------------------------------------- the app


def proxy_app(proxy: AgentProxy) -> Starlette:
    """The ASGI app: the proxy's routes, OpenAI-style error bodies."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    limits = proxy.limits

    async def models(_: Request) -> Response:
        model = {"id": proxy.model_name, "object": "model", "owned_by": "envhub"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat(request: Request) -> Response:
        episode = proxy.episode(request.headers.get("authorization"))
        body = chat_request(await read_json(request, limits))
        retry = request.headers.get("x-stainless-retry-count", "0").strip() not in ("", "0")
        completion = await _unless_disconnected(request, proxy.complete(episode, body, retry))
        if not body.stream:
            return JSONResponse(completion)
        events = _sse(completion, body.include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    async def describe(request: Request) -> Response:
        return JSONResponse(proxy.describe(proxy.episode(request.headers.get("authorization"))))

    async def step(request: Request) -> Response:
        episode = proxy.episode(request.headers.get("authorization"))
        action = step_action(await read_json(request, limits))
        return JSONResponse(await proxy.step(episode, action))

    async def not_a_route(request: Request, error: Exception) -> Response:
        known = cast(HTTPException, error)  # registered for HTTPException only
        message = (
            f"{request.method} {request.url.path}: {known.detail}; the agent proxy serves GET "
            "/v1/models, POST /v1/chat/completions, GET /v1/envhub/episode and POST "
            "/v1/envhub/step"
        )
        code = "method_not_allowed" if known.status_code == 405 else "not_found"
        body = ProxyError(known.status_code, message, code).body()
        return JSONResponse(body, status_code=known.status_code, headers=known.headers)

    return Starlette(
        routes=[
            Route("/v1/models", _answering(models), methods=["GET"]),
            Route("/v1/chat/completions", _answering(chat), methods=["POST"]),
            Route("/v1/envhub/episode", _answering(describe), methods=["GET"]),
            Route("/v1/envhub/step", _answering(step), methods=["POST"]),
        ],
        exception_handlers={HTTPException: not_a_route},
    )


def _answering(
    route: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """``route`` with its errors as answers: a ``ProxyError`` its own, anything else one logged
    500 (raised past Starlette, it would be logged twice and the connection dropped)."""
    from starlette.responses import JSONResponse

    async def answer(request: Request) -> Response:
        try:
            return await route(request)
        except ProxyError as error:
            # a 408 (the body was late) may succeed if sent again; no other answer would: the
            # SDK must not retry it (it retries 409 and 5xx by default) and hide the reason
            late = error.status == 408
            headers = {"Connection": "close"} if late else {"x-should-retry": "false"}
            return JSONResponse(error.body(), status_code=error.status, headers=headers)
        except Exception as error:  # noqa: BLE001 - the server stays up; the log has it
            _log.exception("agent proxy error on %s %s", request.method, request.url.path)
            known = ProxyError(500, f"{type(error).__name__}: {error}", "internal", "server_error")
            return JSONResponse(known.body(), status_code=500)

    return answer


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or, if the client disconnects first (its timeout, a cancelled
    task), ``work`` cancelled and a 499 nobody reads: a model call whose client is gone is
    not recorded (``AgentProxy.complete``). Called once the body has been read, so the next
    ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client went away, or this route was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ProxyError(499, "the client went away; the call was not recorded", "client_gone")
    return task.result()


async def read_json(request: Request, limits: ServerLimits) -> dict[str, Any]:
    """The request's JSON object body, read within ``limits`` and parsed (400). A body over
    ``max_body_bytes`` is read to its end and dropped as it arrives, then answered 413 (a
    connection closed on unread data would reset, and the client would not see the answer);
    one that does not end within ``body_timeout_s`` is answered 408 and its connection closed."""
    cap = limits.max_body_bytes
    length = request.headers.get("content-length")
    chunks: list[bytes] = []
    size = int(length) if length is not None and length.isdigit() else 0

    async def read() -> None:
        nonlocal size
        if size <= cap:
            size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= cap:
                chunks.append(chunk)
            elif chunks:
                chunks.clear()  # over the limit: nothing more is kept

    try:
        await asyncio.wait_for(read(), limits.body_timeout_s)
    except TimeoutError:
        raise ProxyError(
            408,
            f"the request body did not arrive within {limits.body_timeout_s} s of its headers",
            "body_timeout",
        ) from None
    if size > cap:
        raise ProxyError(
            413,
            f"the request body is larger than {cap} bytes (the agent proxy's limit); send "
            "shorter conversations (the context holds far less)",
            "body_too_large",
        )
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise ProxyError(400, f"the body is not JSON: {error}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "the body must be a JSON object", "invalid_json")
    return body


# --------------------------------------------------------------------------- the server


def listen(
    app: Any, host: str, port: int, limits: ServerLimits | None = None
) -> tuple[Any, asyncio.Task[None], int]:
    """Bind ``host:port`` (0: any free port), listen, and serve ``app`` with uvicorn on the
    running loop, within ``limits``; returns the server, its task and the bound port.
    Connections queue from the moment this returns, before uvicorn accepts them."""
    import uvicorn

    limits = limits or ServerLimits()
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it every kept-alive call waits ~40 ms for a delayed ACK (Nagle)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(
            f"the agent proxy cannot listen on {host}:{port} ({error}); set "
            "rollout.agent.port to a free port, or 0 for any"
        ) from None
    sock.listen(2048)
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        access_log=False,
        loop="none",
        http=_with_header_timeout(limits.header_timeout_s),
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=limits.shutdown_timeout_s,  # type: ignore[arg-type]
        limit_concurrency=limits.max_connections,
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    return server, task, sock.getsockname()[1]


def _with_header_timeout(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing a connection whose request headers are late: no
    request within ``timeout_s`` of opening, or of the first byte after a response.
    (uvicorn's keep-alive timer stops at the first byte, so a client sending half a request
    line would hold its connection forever.)"""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class HeaderTimeout(base):
        _deadline: asyncio.TimerHandle | None = None
        _between = False  # a response went out; the next request has not begun

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between:
                self._between = False
                self._arm()
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._between = True

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout_s, self._late, self.cycle)

        def _late(self, cycle: Any) -> None:
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()  # no request's headers arrived since the timer started

    return HeaderTimeout


async def _sse(completion: dict[str, Any], usage: bool) -> AsyncIterator[bytes]:
    """A finished completion as chat.completion.chunk events (role+content, calls, finish)."""
    choice = completion["choices"][0]
    message = choice["message"]
    base = {k: completion[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps({**chunk, **extra})}\n\n".encode()

    yield event({"role": "assistant", "content": message.get("content") or ""})
    calls: Sequence[dict[str, Any]] = message.get("tool_calls") or []
    if calls:
        yield event({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
    yield event({}, choice["finish_reason"])
    if usage:
        chunk = {**base, "choices": [], "usage": completion["usage"]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"
