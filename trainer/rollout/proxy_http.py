"""The agent proxy's HTTP surface (``trainer.rollout.proxy``): its routes, OpenAI-style error
bodies, server-sent events, and the uvicorn server it runs on.

The routes and what they answer are listed in ``trainer.rollout.proxy``'s docstring; this
module only maps them to ``AgentProxy`` methods (``complete``, ``describe``, ``step``) and
errors to status codes: a ``ProxyError`` is its own status and OpenAI-style body, anything else
is a logged 500 that keeps the server up. Plain Starlette (what FastAPI is built on): no
dependency injection or response encoding to pay for on every call of every episode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from trainer.rollout.proxy import AgentProxy, ProxyEpisode

__all__ = ["ProxyError", "listen", "proxy_app"]

_log = logging.getLogger("trainer.rollout.proxy")


class ProxyError(Exception):
    """An OpenAI-style error answer: HTTP ``status``, ``type`` and ``code``."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


def proxy_app(proxy: AgentProxy) -> Starlette:
    """The ASGI app: the proxy's routes, OpenAI-style error bodies."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def proxy_error(_: Request, error: Exception) -> Response:
        known = cast(ProxyError, error)  # registered for ProxyError only
        return JSONResponse(known.body(), status_code=known.status)

    async def server_error(_: Request, error: Exception) -> Response:
        _log.exception("agent proxy error", exc_info=error)
        body = ProxyError(500, f"{type(error).__name__}: {error}", "internal", "server_error")
        return JSONResponse(body.body(), status_code=500)

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            raise ProxyError(400, f"the body is not JSON: {error}", "invalid_json") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the body must be a JSON object", "invalid_json")
        return body

    def episode_of(request: Request) -> ProxyEpisode:
        return proxy.episode(request.headers.get("authorization"))

    async def models(_: Request) -> Response:
        model = {"id": proxy.model_name, "object": "model", "owned_by": "envhub"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat(request: Request) -> Response:
        episode = episode_of(request)
        body = await json_body(request)
        completion = await proxy.complete(episode, body)
        if not body.get("stream"):
            return JSONResponse(completion)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_sse(completion, usage), media_type="text/event-stream")

    async def describe(request: Request) -> Response:
        return JSONResponse(proxy.describe(episode_of(request)))

    async def step(request: Request) -> Response:
        episode = episode_of(request)
        body = await json_body(request)
        if "action" not in body:
            raise ProxyError(400, 'the body needs "action": text or a message', "action")
        return JSONResponse(await proxy.step(episode, body["action"]))

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/envhub/episode", describe, methods=["GET"]),
            Route("/v1/envhub/step", step, methods=["POST"]),
        ],
        exception_handlers={ProxyError: proxy_error, Exception: server_error},
    )


def listen(app: Any, host: str, port: int) -> tuple[Any, asyncio.Task[None], int]:
    """Bind ``host:port`` (0: any free port), listen, and serve ``app`` with uvicorn on the
    running loop; returns the server, its task and the bound port. Connections queue from
    the moment this returns, before uvicorn accepts them."""
    import uvicorn

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
        timeout_keep_alive=120,  # an agent may think (or run tools) between its calls
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    return server, task, sock.getsockname()[1]


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
