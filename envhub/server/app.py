"""The hub's FastAPI app: HTTP routes, the WebSocket route, limits, lifespan.

``create_app(HubConfig(...))`` builds an app whose lifespan starts the env pools and
stops them (closing every session) on shutdown. HTTP: ``GET /health`` (no token; 503 while
draining; ``degraded`` with ``problems`` while a pool or the session table is full),
``GET /metrics`` (Prometheus text), ``GET /v1/envs``, ``GET /v1/protocol`` (JSON Schemas
of the WebSocket messages) and ``POST /v1/rollout`` (a one-shot episode).
WebSocket: ``/v1/session`` (see ``envhub.server.wire`` for the protocol). OpenEnv's protocol
(``envhub.server.openenv``): ``/openenv/<env id>/{ws,schema,metadata}``, and at the root with
``protocol="openenv"``. Every route but
``/health`` needs ``Authorization: Bearer <token>`` unless auth is off (loopback only).
Every failure, the framework's own included, answers an ``ErrorMessage`` with a code.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from envhub import __version__
from envhub.errors import EpisodeOverError, ResetNeededError
from envhub.pool.base import EpisodeFailure
from envhub.pool.errors import PoolClosedError, PoolFullError, WorkerStartError
from envhub.server.config import HubConfig
from envhub.server.errors import SessionLimitError
from envhub.server.hub import Hub
from envhub.server.openenv import add_openenv_routes
from envhub.server.wire import (
    MAX_SEED,
    MAX_SEQ,
    EnvInfo,
    EnvList,
    ErrorMessage,
    Health,
    ProtocolSchema,
    RolloutRequest,
    RolloutResponse,
    client_message,
    server_message,
)
from envhub.server.ws import SessionSockets

__all__ = ["create_app"]

_bearer = HTTPBearer(auto_error=False, description="The hub's token (envhub serve --token).")


class HTTPError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        self.status, self.code, self.message = status, code, message


class BodyLimit:
    """Refuse HTTP bodies over ``limit`` bytes with 413, before the app reads them."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await self._too_large(send)
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._too_large(send)

    async def _too_large(self, send: Any) -> None:
        body = (
            ErrorMessage(
                code="message_too_large",
                message=f"request body is over the {self.limit} byte limit",
            )
            .model_dump_json()
            .encode()
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorMessage, "description": "Missing or wrong token."},
    413: {"model": ErrorMessage, "description": "Request body too large."},
}
_BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorMessage, "description": "The body is not JSON."},
    422: {
        "model": ErrorMessage,
        "description": "The body does not match the schema (the field and the fix are named).",
    },
}
_STATUS_CODES = {400: "bad_json", 401: "unauthorized", 404: "not_found", 413: "message_too_large"}
"""Error codes for the framework's own HTTP errors (anything else is ``bad_message``)."""


def _error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = ErrorMessage(code=code, message=message).model_dump()  # type: ignore[arg-type]
    return JSONResponse(body, status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI, hub: Hub) -> None:
    """Every failure answers an ``ErrorMessage`` with a code, never FastAPI's bare ``detail`` or a
    text 500."""

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        hub.metrics.errors.labels(exc.code).inc()
        return _error_response(
            exc.status,
            exc.code,
            exc.message,
            {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            hub.metrics.errors.labels("bad_json").inc()
            return _error_response(
                400,
                "bad_json",
                f"the body is not valid JSON: {errors[0].get('msg', '')}; send one JSON object",
            )
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        what = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        hub.metrics.errors.labels("bad_message").inc()
        return _error_response(
            422, "bad_message", f"{where}: {what} (see GET /openapi.json for the schema)"
        )

    @app.exception_handler(StarletteHTTPException)
    async def _framework(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "bad_message")
        hub.metrics.errors.labels(code).inc()
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += "; the routes are listed at GET /openapi.json"
        return _error_response(exc.status_code, code, message, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:  # a bug in the hub
        hub.metrics.errors.labels("internal").inc()
        return _error_response(
            500,
            "internal",
            (
                f"the hub failed on {request.method} {request.url.path} ({type(exc).__name__}: "
                f"{exc}); report it"
            ),
        )


def _exact_bounds(app: FastAPI) -> None:
    """Publish the wire's 64-bit bounds exactly in ``/openapi.json``.

    FastAPI's OpenAPI model keeps ``maximum``/``minimum`` as floats, so 2**64 - 1 would be
    published as 2**64 and clients (and schemathesis) would send a value the hub refuses.
    """
    render = app.openapi
    exact = {float(bound): bound for bound in (MAX_SEED, MAX_SEQ, -(2**63))}

    def fix(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("maximum", "minimum") and isinstance(value, float) and value in exact:
                    node[key] = exact[value]
                else:
                    fix(value)
        elif isinstance(node, list):
            for item in node:
                fix(item)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            fix(render())
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(config: HubConfig) -> FastAPI:
    """The hub's ASGI app for ``config`` (pools start in the lifespan)."""
    hub = Hub(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await hub.start()
        try:
            yield
        finally:
            await hub.stop()

    app = FastAPI(
        title="envhub hub",
        version=__version__,
        description=(
            "Serve envhub environments over WebSocket sessions (/v1/session) and HTTP one-shot "
            "calls."
        ),
        lifespan=lifespan,
    )
    app.state.hub = hub

    def auth(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        # the raw header: Bearer, or Basic with the token as password (OpenEnv's clients)
        if not hub.authorised(request.headers.get("authorization")):
            hub.metrics.rejected.labels("unauthorized").inc()
            raise HTTPError(
                401,
                "unauthorized",
                "missing or wrong token: send the header 'Authorization: Bearer <token>'",
            )

    _add_error_handlers(app, hub)

    @app.get(
        "/health",
        response_model=Health,
        responses={503: {"model": Health, "description": "Draining."}},
    )
    async def health() -> Any:
        """Liveness: 200 while serving (``degraded`` lists what clients would hit), 503 while
        draining (no token needed)."""
        stats = [pool.stats() for pool in hub.pools.values()]
        problems = hub.problems()
        body = Health(
            status="draining" if hub.draining else "degraded" if problems else "ok",
            sessions=len(hub.sessions.sessions),
            workers_alive=sum(s.workers_alive for s in stats),
            workers=sum(s.workers for s in stats),
            problems=problems,
        )
        return JSONResponse(body.model_dump(), status_code=503 if hub.draining else 200)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        dependencies=[Depends(auth)],
        responses=_ERRORS,
    )
    async def metrics() -> PlainTextResponse:
        """Prometheus metrics: sessions, steps, step latency, worker restarts, errors."""
        return PlainTextResponse(hub.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/envs", response_model=EnvList, dependencies=[Depends(auth)], responses=_ERRORS)
    async def envs() -> EnvList:
        """The envs this hub serves."""
        infos = []
        for env_id, pool in hub.pools.items():
            spec, stats = hub.specs[env_id], pool.stats()
            infos.append(
                EnvInfo(
                    id=env_id,
                    description=spec.description,
                    max_turns=hub.max_turns(env_id),
                    workers=stats.workers,
                    workers_alive=stats.workers_alive,
                    episodes=stats.episodes,
                )
            )
        return EnvList(envs=infos)

    @app.get(
        "/v1/protocol",
        response_model=ProtocolSchema,
        dependencies=[Depends(auth)],
        responses=_ERRORS,
    )
    async def protocol() -> ProtocolSchema:
        """JSON Schemas of the WebSocket messages (client -> server and server -> client)."""
        return ProtocolSchema(
            client=client_message.json_schema(), server=server_message.json_schema()
        )

    @app.post(
        "/v1/rollout",
        response_model=RolloutResponse,
        dependencies=[Depends(auth)],
        responses={
            **_ERRORS,
            **_BODY_ERRORS,
            404: {"model": ErrorMessage, "description": "Env not served."},
            429: {
                "model": ErrorMessage,
                "description": "This client holds its limit of sessions and rollouts.",
            },
            503: {"model": ErrorMessage, "description": "Pool full or draining."},
        },
    )
    async def rollout(request: RolloutRequest, http: Request) -> RolloutResponse:
        """A one-shot episode: reset, apply ``actions`` in order until the episode ends.

        While it runs it counts as one of its client's sessions (``max_sessions_per_client``).
        """
        pool = hub.pools.get(request.env)
        if pool is None:
            raise HTTPError(
                404,
                "unknown_env",
                f"this hub does not serve {request.env!r}; it serves: {', '.join(hub.pools)}",
            )
        if hub.draining:
            raise HTTPError(503, "draining", "the hub is shutting down; retry on another hub")
        client = hub.client_key(
            http.headers.get("authorization"), http.client.host if http.client else None
        )
        try:
            hub.sessions.hold(client)
        except SessionLimitError as exc:
            hub.metrics.rejected.labels("too_many_sessions").inc()
            raise HTTPError(429, "too_many_sessions", str(exc)) from exc
        try:
            return await _rollout(request, pool)
        finally:
            hub.sessions.release(client)

    async def _rollout(request: RolloutRequest, pool: Any) -> RolloutResponse:
        try:
            started = await pool.reset_json(
                seed=request.seed, options=request.options, wait_s=hub.config.reset_wait_s
            )
        except PoolFullError as exc:
            raise HTTPError(503, "pool_busy", str(exc)) from exc
        except PoolClosedError as exc:
            raise HTTPError(503, "draining", str(exc)) from exc
        except WorkerStartError as exc:
            raise HTTPError(503, "env_unavailable", str(exc)) from exc
        if isinstance(started, EpisodeFailure):
            await pool.close_episode(started.episode)
            return RolloutResponse(env=request.env, reset=None, steps=[], failure=started.as_dict())
        episode, body = started
        steps: list[dict[str, Any]] = []
        failure = error = None
        try:
            for action in request.actions:
                began = time.perf_counter()
                try:
                    result = await pool.step_json(episode, action)
                except (ResetNeededError, EpisodeOverError) as exc:
                    error = ErrorMessage(
                        code="episode_over", message=f"action {len(steps)} was not applied: {exc}"
                    )
                    break
                if isinstance(result, EpisodeFailure):
                    failure = result.as_dict()
                    break
                steps.append(orjson.loads(result))
                hub.metrics.step_done(request.env, time.perf_counter() - began)
        finally:
            await pool.close_episode(episode)
        return RolloutResponse(
            env=request.env, reset=orjson.loads(body), steps=steps, failure=failure, error=error
        )

    _exact_bounds(app)
    add_openenv_routes(app, hub, auth, at_root=config.protocol == "openenv")
    app.add_middleware(BodyLimit, limit=config.max_message_bytes)
    app.add_middleware(SessionSockets)  # added last: outermost, /v1/session skips the rest
    return app
