"""The agent proxy's HTTP surface (``trainer.rollout.proxy``): its routes, reading bodies,
OpenAI-style error bodies, server-sent events, and the uvicorn server with the limits that keep
one client from holding it.

The routes and what they answer are listed in ``trainer.rollout.proxy``'s docstring; this
module maps them to ``AgentProxy`` methods (``request``, ``complete``, ``describe``, ``step``).
Every body is read within ``ServerLimits`` and checked (``trainer.rollout.proxy_request``)
before the proxy acts on it, so a malformed field is a 400 that names it and never a
half-recorded call. A ``ProxyError`` is its own status and OpenAI-style body with
``x-should-retry: false`` (the ``openai`` SDK would retry a 409 or 5xx and show the agent the
retry's 410; only a late body's 408 may be retried); anything else is one logged 500 that keeps
the server up; an unknown route or method answers 404/405 in the same form. A model call whose
client disconnects before its answer is cancelled (``_unless_disconnected``: nothing is
recorded). A streamed answer is the finished completion as chunks (``_sse``), its log-probs and
``token_ids`` on the content chunk. Plain Starlette (what FastAPI is built on): no dependency
injection or response encoding to pay for on every call of every episode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from trainer.config_rollout import ServerLimits
from trainer.rollout.proxy_request import ProxyError, step_action

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from trainer.rollout.proxy import AgentProxy

__all__ = ["ServerLimits", "listen", "proxy_app"]

_log = logging.getLogger("trainer.rollout.proxy")
T = TypeVar("T")


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
        body = proxy.request(episode, await read_json(request, limits))
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
    """A finished completion as chat.completion.chunk events: role and content (with the
    choice's ``logprobs`` and ``token_ids``, as vLLM streams them), tool calls, finish, usage.
    Every chunk carries the ``policy_version``."""
    choice = completion["choices"][0]
    message = choice["message"]
    base = {k: completion[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    base["policy_version"] = completion["policy_version"]

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        chunk = {
            **base,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}],
        }
        return f"data: {json.dumps(chunk)}\n\n".encode()

    content = {"role": "assistant", "content": message.get("content") or ""}
    yield event(content, logprobs=choice["logprobs"], token_ids=choice["token_ids"])
    calls: Sequence[dict[str, Any]] = message.get("tool_calls") or []
    if calls:
        yield event({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
    yield event({}, choice["finish_reason"])
    if usage:
        chunk = {**base, "choices": [], "usage": completion["usage"]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"
