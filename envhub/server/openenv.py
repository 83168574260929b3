"""The OpenEnv protocol on the hub: OpenEnv's own client plays any env the hub serves.

Every hub answers OpenEnv's routes for each env it serves under ``/openenv/<env id>``
(``GenericEnvClient(base_url="http://host:port/openenv/games/sokoban-v0")``); ``envhub serve
--protocol openenv`` also answers them at the root for its one env, so the base URL is just
``http://host:port``, as for an OpenEnv server. Routes: ``WS .../ws`` (the session; messages in
``envhub.server.openenv_wire``), ``GET .../schema`` and ``GET .../metadata``; the hub's
``/health`` and ``/metrics`` serve both protocols.

A session is a hub session like a ``/v1/session`` one: the same token (OpenEnv's client sends
no headers of its own, so the token rides in the URL, ``http://envhub:TOKEN@host:port``, which
its WebSocket library sends as HTTP Basic auth), the same global and per-client session limits,
idle reaping, drain, pools and metrics. What OpenEnv's protocol lacks, it lacks here too: a
dropped socket ends the session (no resume), and requests carry no sequence number.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.websockets import WebSocket

from envhub import __version__
from envhub.errors import EpisodeOverError, ResetNeededError
from envhub.pool.errors import (
    PoolClosedError,
    PoolFullError,
    UnknownEpisodeError,
    WorkerStartError,
)
from envhub.server.errors import SessionLimitError
from envhub.server.hub import Hub
from envhub.server.openenv_wire import (
    CloseMessage,
    Metadata,
    ResetData,
    ResetMessage,
    Schemas,
    StateMessage,
    StepAction,
    client_message,
    error,
    observation,
)
from envhub.server.sessions import Session
from envhub.server.wire import ErrorMessage
from envhub.server.ws import oversize

__all__ = ["add_openenv_routes"]

PREFIX = "/openenv"


class OpenEnvConnection:
    """The socket of an OpenEnv session, as the session manager sees it.

    OpenEnv's client reads exactly one answer per request, so nothing unsolicited is sent:
    ``notify`` (the drain notice) is dropped, and ``kick`` closes the socket with the reason
    as the close frame's text.
    """

    __slots__ = ("_tasks", "ws")

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self._tasks: set[Any] = set()

    def kick(self, code: int, reply: str) -> None:
        try:
            reason = str(orjson.loads(reply).get("message", ""))[:120]
        except orjson.JSONDecodeError:
            reason = ""
        task = asyncio.get_running_loop().create_task(self._close(code, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def notify(self, reply: str) -> None:
        pass

    async def sent(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.ws.close(code, reason)


def add_openenv_routes(app: FastAPI, hub: Hub, auth: Any, *, at_root: bool) -> None:
    """OpenEnv's routes for every served env under ``/openenv/<id>``, and at the root for the
    one env when ``at_root`` (``--protocol openenv``). ``auth`` is the hub's token dependency."""
    errors: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorMessage, "description": "Missing or wrong token."},
        404: {"model": ErrorMessage, "description": "Env not served."},
    }
    roots = [PREFIX + "/{env_id:path}", *([""] if at_root else [])]
    for root in roots:
        app.add_api_websocket_route(root + "/ws", _session)
        app.add_api_route(
            root + "/schema",
            _schema,
            methods=["GET"],
            response_model=Schemas,
            dependencies=[Depends(auth)],
            responses=errors,
            summary="OpenEnv: JSON Schemas of the action, observation and state",
        )
        app.add_api_route(
            root + "/metadata",
            _metadata,
            methods=["GET"],
            response_model=Metadata,
            dependencies=[Depends(auth)],
            responses=errors,
            summary="OpenEnv: what the env is",
        )


def _env_id(hub: Hub, path_params: dict[str, Any]) -> str:
    env_id = str(path_params.get("env_id") or hub.config.envs[0])
    if env_id not in hub.pools:
        raise StarletteHTTPException(
            404, f"this hub does not serve {env_id!r}; it serves: {', '.join(hub.pools)}"
        )
    return env_id


async def _schema(request: Request) -> Schemas:
    """OpenEnv's ``GET /schema``: the action, observation and state JSON Schemas."""
    _env_id(request.app.state.hub, request.path_params)
    return Schemas(
        action=StepAction.model_json_schema(),
        observation={
            "type": "object",
            "properties": {
                "messages": {"type": "array", "items": {"type": "object"}},
                "info": {"type": "object"},
                "terminated": {"type": "boolean"},
                "truncated": {"type": "boolean"},
            },
        },
        state={
            "type": "object",
            "properties": {
                "episode_id": {"type": ["string", "null"]},
                "step_count": {"type": "integer"},
                "env_id": {"type": "string"},
            },
        },
    )


async def _metadata(request: Request) -> Metadata:
    """OpenEnv's ``GET /metadata``."""
    hub: Hub = request.app.state.hub
    env_id = _env_id(hub, request.path_params)
    return Metadata(name=env_id, description=hub.specs[env_id].description, version=__version__)


async def _refuse(ws: WebSocket, hub: Hub, code: str, message: str, close_code: int) -> None:
    """Answer the client's first request with the error, then close.

    OpenEnv's client connects, then sends a request and reads one answer; an error sent before
    its request would race with it (the send can fail on the closed socket instead of the
    client reading why). The wait is bounded by ``hello_timeout_s``.
    """
    hub.metrics.rejected.labels(code.lower()).inc()
    with contextlib.suppress(Exception):  # the client may be gone already
        await asyncio.wait_for(ws.receive(), hub.config.hello_timeout_s)
    with contextlib.suppress(Exception):
        await ws.send_text(error(code, message))
        await ws.close(close_code)


async def _session(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    header = ws.headers.get("authorization")
    await ws.accept()
    if not hub.authorised(header):
        await _refuse(
            ws,
            hub,
            "UNAUTHORIZED",
            "missing or wrong token: put it in the URL, http://envhub:TOKEN@host:port",
            1008,
        )
        return
    env_id = str(ws.path_params.get("env_id") or hub.config.envs[0])
    if env_id not in hub.pools:
        await _refuse(
            ws,
            hub,
            "FACTORY_ERROR",
            f"this hub does not serve {env_id!r}; it serves: {', '.join(hub.pools)}",
            1008,
        )
        return
    if hub.draining:
        await _refuse(ws, hub, "SESSION_ERROR", "the hub is shutting down", 1013)
        return
    client = hub.client_key(header, ws.client.host if ws.client else None)
    try:
        session = hub.sessions.open(env_id, client, hub.pools[env_id])
    except SessionLimitError as exc:
        await _refuse(ws, hub, "CAPACITY_REACHED", str(exc), 1013)
        return
    hub.sessions.attach(session, OpenEnvConnection(ws))
    hub.metrics.sessions_opened.inc()
    state = _State()
    try:
        await _serve(ws, hub, session, state)
    finally:
        await hub.sessions.close(session, "client")


class _State:
    """OpenEnv's view of the session: its episode id and step count."""

    __slots__ = ("episode_id", "step_count")

    def __init__(self) -> None:
        self.episode_id: str | None = None
        self.step_count = 0


async def _serve(ws: WebSocket, hub: Hub, session: Session, state: _State) -> None:
    limit = hub.config.max_message_bytes
    while True:
        try:
            message = await ws.receive()
        except Exception:  # noqa: BLE001 - a failed receive means the socket dropped
            return
        if message["type"] == "websocket.disconnect" or session.closed:
            return
        raw = message.get("text") or message.get("bytes") or b""
        session.last_active = time.monotonic()
        reply: str | None
        if (size := oversize(raw, limit)) is not None:
            reply = _error(hub, "VALIDATION_ERROR", f"message of {size} bytes is over {limit}")
        else:
            with session.busy(-1):  # spared by the idle reaper while it runs
                reply = await _answer(hub, session, state, raw)
        if reply is None:  # close
            with contextlib.suppress(Exception):
                await ws.close(1000)
            return
        try:
            await ws.send_text(reply)
        except Exception:  # noqa: BLE001 - a failed send means the socket dropped
            return


async def _answer(hub: Hub, session: Session, state: _State, raw: str | bytes) -> str | None:
    try:
        request = client_message.validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            return _error(hub, "INVALID_JSON", f"the message is not JSON: {first['msg']}")
        if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            return _error(
                hub,
                "UNKNOWN_TYPE",
                "unknown message type; send reset, step, state or close (envhub serves no MCP)",
            )
        where = ".".join(str(p) for p in first["loc"][1:])
        return _error(
            hub,
            "VALIDATION_ERROR",
            f"invalid message: {where}: {first['msg']}",
            errors=[{"loc": list(map(str, e["loc"])), "msg": e["msg"]} for e in exc.errors()],
        )
    if isinstance(request, CloseMessage):
        return None
    if isinstance(request, StateMessage):
        return orjson.dumps(
            {
                "type": "state",
                "data": {
                    "episode_id": state.episode_id,
                    "step_count": state.step_count,
                    "env_id": session.env_id,
                },
            }
        ).decode()
    try:
        if isinstance(request, ResetMessage):
            return await _reset(hub, session, state, request.data)
        return await _step(hub, session, state, request.data.message)
    except Exception as exc:  # noqa: BLE001 - a hub bug: answer, keep the connection
        return _error(hub, "EXECUTION_ERROR", f"the hub failed ({type(exc).__name__}: {exc})")


async def _reset(hub: Hub, session: Session, state: _State, data: ResetData) -> str:
    if hub.draining:
        return _error(hub, "SESSION_ERROR", "the hub is shutting down and starts no episodes")
    pool, wait_s = session.pool, hub.config.reset_wait_s
    try:
        try:
            result = await pool.reset_json(
                session.episode, seed=data.seed, options=data.options, wait_s=wait_s
            )
        except UnknownEpisodeError:
            session.episode = None
            result = await pool.reset_json(
                None, seed=data.seed, options=data.options, wait_s=wait_s
            )
    except PoolFullError as exc:
        session.episode, session.running = None, False
        return _error(hub, "CAPACITY_REACHED", str(exc))
    except PoolClosedError as exc:
        return _error(hub, "SESSION_ERROR", str(exc))
    except WorkerStartError as exc:  # the env no longer builds
        session.episode, session.running = None, False
        return _error(hub, "EXECUTION_ERROR", str(exc))
    except TypeError as exc:  # options the worker cannot encode
        return _error(hub, "VALIDATION_ERROR", str(exc))
    if not isinstance(result, tuple):
        session.episode, session.running = result.episode, False
        return _failed(hub, result)
    session.episode, body = result
    session.running = True
    state.episode_id, state.step_count = data.episode_id, 0
    reset = orjson.loads(body)
    return observation(reset["observation"], reset["info"], None, False, False)


async def _step(hub: Hub, session: Session, state: _State, action: str) -> str:
    if session.episode is None:
        return _error(hub, "EXECUTION_ERROR", "step before reset: send a reset message first")
    started = time.perf_counter()
    try:
        result = await session.pool.step_json(session.episode, action)
    except (ResetNeededError, UnknownEpisodeError, EpisodeOverError) as exc:
        return _error(hub, "EXECUTION_ERROR", f"{exc}")
    if not isinstance(result, bytes):
        session.running = False
        return _failed(hub, result)
    hub.metrics.step_done(session.env_id, time.perf_counter() - started)
    state.step_count += 1
    step = orjson.loads(result)
    if step["terminated"] or step["truncated"]:
        session.running = False
    return observation(
        step["observation"], step["info"], step["reward"], step["terminated"], step["truncated"]
    )


def _failed(hub: Hub, failure: Any) -> str:
    return _error(
        hub,
        "EXECUTION_ERROR",
        f"the episode failed ({failure.reason}: {failure.detail}); reset to start another",
        failure=failure.as_dict(),
    )


def _error(hub: Hub, code: str, message: str, **details: Any) -> str:
    hub.metrics.errors.labels(code.lower()).inc()
    return error(code, message, **details)
