"""The WebSocket session endpoint (``/v1/session``): one handler per message type.

``session_endpoint`` authenticates, reads ``hello`` (new session or resume), then loops:
receive, validate (``envhub.server.wire``), run the request through ``Session.execute``
(at most once per ``seq``) and send the answer. Pool results arrive as JSON bytes from the
worker and are spliced into the answer without being decoded. Every bad input gets an
``error`` message with a code (``envhub.server.wire`` refuses unencodable values before a
pool sees them, so a refused reset never holds an episode slot); a failure inside the hub
answers ``internal``. Only auth, limits, a bad ``hello`` and oversized frames close the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.datastructures import Address, Headers
from starlette.websockets import WebSocketDisconnect

from envhub.errors import EpisodeOverError, ResetNeededError
from envhub.pool.errors import (
    PoolClosedError,
    PoolFullError,
    UnknownEpisodeError,
    WorkerStartError,
)
from envhub.pool.host import RUNNING_PREFIX
from envhub.server.errors import SessionLimitError
from envhub.server.hub import Hub
from envhub.server.sessions import Session, error_reply
from envhub.server.wire import (
    MAX_SEQ,
    CloseRequest,
    Hello,
    ResetRequest,
    StepRequest,
    Welcome,
    client_message,
)

__all__ = ["SessionSockets", "WsConnection", "close_reason", "oversize", "session_endpoint"]


class SessionSockets:
    """ASGI middleware that serves ``path`` (``/v1/session``) itself, outermost in the app.

    Every step of a session is a receive and a send; through Starlette's ``WebSocket`` and the
    middleware stack each costs a state machine and a wrapper per message. Here the session
    speaks to the server's own ``receive``/``send`` (what ``AsgiSocket`` wraps); auth, limits and
    every answer are the endpoint's, as before. Other requests go on to ``app``."""

    def __init__(self, app: Any, path: str = "/v1/session") -> None:
        self.app, self.path = app, path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket" and scope["path"] == self.path:
            await session_endpoint(AsgiSocket(scope, receive, send))
        else:
            await self.app(scope, receive, send)


class AsgiSocket:
    """The WebSocket operations ``session_endpoint`` uses, straight on ASGI's ``receive`` and
    ``send`` (see ``SessionSockets``). ``app`` is the Starlette app that set ``scope["app"]``."""

    __slots__ = ("_send", "app", "client", "headers", "receive")

    def __init__(self, scope: Any, receive: Any, send: Any) -> None:
        self.receive: Callable[[], Awaitable[Any]] = receive
        """The server's own ``receive`` (the next ASGI message), called without a hop."""
        self._send = send
        self.app = scope["app"]
        self.headers = Headers(scope=scope)
        client = scope.get("client")
        self.client = Address(*client) if client else None

    async def accept(self) -> None:
        message = await self.receive()
        if message["type"] != "websocket.connect":
            raise WebSocketDisconnect(int(message.get("code") or 1006))
        await self._send({"type": "websocket.accept"})

    async def send_text(self, text: str) -> None:
        await self._send({"type": "websocket.send", "text": text})

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self._send({"type": "websocket.close", "code": code, "reason": reason})


class WsConnection:
    """The socket a session is attached to; ``kick``/``notify`` work from any task."""

    __slots__ = ("_tasks", "kicked", "ws")

    def __init__(self, ws: AsgiSocket) -> None:
        self.ws = ws
        self.kicked = False
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def kick(self, code: int, reply: str) -> None:
        if not self.kicked:
            self.kicked = True
            self._spawn(self._close(code, reply))

    def notify(self, reply: str) -> None:
        self._spawn(self._send(reply))

    async def sent(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _send(self, reply: str) -> None:
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.ws.send_text(reply)

    async def _close(self, code: int, reply: str) -> None:
        await self._send(reply)
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.ws.close(code, close_reason(reply))


def close_reason(reply: str) -> str:
    """``reply``'s message, cut to fit a close frame (123 bytes of UTF-8): a client that fails
    to send before it reads ``reply`` learns the reason from the close itself."""
    try:
        message = orjson.loads(reply).get("message")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    if not isinstance(message, str):
        return ""
    return message.encode("utf-8", "replace")[:123].decode("utf-8", "ignore")


async def _refuse(ws: AsgiSocket, hub: Hub, code: str, message: str, close_code: int) -> None:
    hub.metrics.rejected.labels(code).inc()
    with contextlib.suppress(Exception):  # the client may be gone already
        await ws.send_text(error_reply(code, message))
        await ws.close(close_code)


def _frame(message: Any) -> str | bytes | int:
    """A received ASGI message's data, or the close code (an ``int``) when the client went
    away."""
    if message["type"] == "websocket.disconnect":
        return int(message.get("code") or 1006)
    text = message.get("text")
    return text if text is not None else message.get("bytes") or b""


async def session_endpoint(ws: AsgiSocket) -> None:
    hub: Hub = ws.app.state.hub
    config = hub.config
    header = ws.headers.get("authorization")
    try:
        await ws.accept()
    except (WebSocketDisconnect, OSError):  # gone before the handshake finished: nobody to answer
        return
    if not hub.authorised(header):
        await _refuse(
            ws,
            hub,
            "unauthorized",
            "missing or wrong token: send the header 'Authorization: Bearer <token>'",
            1008,
        )
        return
    client = hub.client_key(header, ws.client.host if ws.client else None)
    waiting = hub.awaiting_hello.get(client, 0)
    # each silent connection holds an fd for hello_timeout_s
    if waiting >= config.max_sessions_per_client:
        await _refuse(
            ws,
            hub,
            "too_many_sessions",
            (
                f"this client has {waiting} connections that have not sent hello yet (the limit is "
                f"{config.max_sessions_per_client}); send hello first"
            ),
            1013,
        )
        return
    hub.awaiting_hello[client] = waiting + 1
    try:
        raw = _frame(await asyncio.wait_for(ws.receive(), config.hello_timeout_s))
    except TimeoutError:
        await _refuse(
            ws,
            hub,
            "hello_timeout",
            f"send a hello message within {config.hello_timeout_s:g} s of connecting",
            1008,
        )
        return
    except Exception:  # noqa: BLE001 - the connection failed before hello: nobody to answer
        return
    finally:
        left = hub.awaiting_hello.pop(client) - 1
        if left:
            hub.awaiting_hello[client] = left
    if isinstance(raw, int):
        return
    conn = WsConnection(ws)
    try:
        session = await _hello(ws, hub, conn, raw, client)
    except Exception as exc:  # noqa: BLE001 - a hub bug: say so with a code, don't drop the socket
        await _refuse(
            ws,
            hub,
            "internal",
            (
                f"the hub failed to open the session ({type(exc).__name__}: {exc}); retry, and "
                "report it if it persists"
            ),
            1011,
        )
        return
    if session is None:
        return
    code = 1006
    try:
        # its own task: each step's two waits (the frame, the worker) then suspend and resume
        # _serve's few frames, not the server's and middleware's beneath it as well
        code = await asyncio.get_running_loop().create_task(_serve(ws, hub, session, conn))
    finally:
        if not session.closed and session.conn is conn:
            if code in (1000, 1001) and not session.busy_seq:
                # a clean close frame: the client left on purpose
                await hub.sessions.close(session, "client")
            else:
                hub.sessions.detach(session, conn)  # a dropped link: keep it for grace_s


async def _hello(
    ws: AsgiSocket, hub: Hub, conn: WsConnection, raw: str | bytes, client: str
) -> Session | None:
    try:
        hello = client_message.validate_json(raw)
    except ValidationError as exc:
        await _refuse(
            ws,
            hub,
            "hello_required",
            f"the first message must be a valid hello: {_first_error(exc)}",
            1008,
        )
        return None
    if not isinstance(hello, Hello):
        await _refuse(
            ws,
            hub,
            "hello_required",
            f"the first message must be a hello, got {hello.type!r}",
            1008,
        )
        return None
    config = hub.config
    if hello.session is not None:
        session = hub.sessions.find(hello.session, hello.resume_key or "")
        if session is None:
            await _refuse(
                ws,
                hub,
                "unknown_session",
                (
                    f"no session {hello.session!r} with that resume key: it expired (its link "
                    f"was down over {config.grace_s:g} s), it was closed, or the hub restarted "
                    "since; open a new session"
                ),
                4404,
            )
            return None
        previous = hub.sessions.attach(session, conn)
        if previous is not None and previous is not conn:
            previous.kick(
                4409,
                error_reply("unknown_session", "this session was resumed on another connection"),
            )
        hub.metrics.resumes.inc()
        resumed = True
    else:
        if hub.draining:  # resumes are still welcome: their episodes may finish
            await _refuse(
                ws, hub, "draining", "the hub is shutting down; connect to another hub", 1013
            )
            return None
        if hello.env_kwargs:
            await _refuse(
                ws,
                hub,
                "env_kwargs_refused",
                (
                    "the hub fixes env kwargs; connect to a variant id the hub serves instead (see "
                    "GET /v1/envs)"
                ),
                1008,
            )
            return None
        env_id = hello.env or ""
        if env_id not in hub.pools:
            await _refuse(
                ws,
                hub,
                "unknown_env",
                f"this hub does not serve {env_id!r}; it serves: {', '.join(hub.pools)}",
                1008,
            )
            return None
        try:
            session = hub.sessions.open(env_id, client, hub.pools[env_id])
        except SessionLimitError as exc:
            await _refuse(ws, hub, "too_many_sessions", str(exc), 1013)
            return None
        hub.sessions.attach(session, conn)
        hub.metrics.sessions_opened.inc()
        resumed = False
    try:
        welcome = Welcome(
            session=session.id,
            resume_key=session.resume_key,
            env=session.env_id,
            last_seq=session.last_seq,
            resumed=resumed,
            grace_s=config.grace_s,
            idle_timeout_s=config.idle_timeout_s,
            max_message_bytes=config.max_message_bytes,
            max_turns=hub.max_turns(session.env_id),
        )
    except Exception:  # never leave a session attached to a connection that is about to be refused
        if resumed:
            hub.sessions.detach(session, conn)
        else:
            await hub.sessions.close(session, "error")
        raise
    try:
        await ws.send_text(welcome.model_dump_json())
    except Exception:  # noqa: BLE001 - any failed send means the socket is gone
        return session  # dropped already; the caller detaches it
    return session


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    if not errors:
        return str(exc)
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    what = first.get("msg", "").removeprefix("Value error, ")
    return f"{where}: {what}" if where else what


async def _serve(ws: AsgiSocket, hub: Hub, session: Session, conn: WsConnection) -> int:
    """Answer requests until the socket closes; return its close code (1006: dropped)."""
    limit = hub.config.max_message_bytes
    errors = hub.metrics.errors
    receive = ws.receive
    while True:
        try:
            raw = _frame(await receive())
        except Exception:  # noqa: BLE001 - any failed receive means the socket dropped
            return 1006
        if isinstance(raw, int):
            return raw
        if session.closed:
            return 1000
        session.last_active = time.monotonic()
        if (size := oversize(raw, limit)) is not None:
            reply = error_reply(
                "message_too_large",
                f"message of {size} bytes is over the {limit} byte limit; send shorter actions",
            )
            errors.labels("message_too_large").inc()
        elif (step := _plain_step(raw)) is not None:  # the hot path: no model, no dispatch
            seq, action = step
            try:
                reply = await session.execute(seq, partial(_step, hub, session, seq, action))
            except Exception as exc:  # noqa: BLE001 - a hub bug: answer, keep the connection
                reply = _error(hub, "internal", f"{type(exc).__name__}: {exc}", seq)
        else:
            try:
                request = client_message.validate_json(raw)
            except ValidationError as exc:
                code = "bad_json" if _is_bad_json(raw) else "bad_message"
                errors.labels(code).inc()
                reply = error_reply(
                    code,
                    (
                        f"{'malformed JSON' if code == 'bad_json' else 'invalid message'}: "
                        f"{_first_error(exc)}"
                    ),
                )
                request = None
            if request is not None:
                try:
                    reply = await _dispatch(hub, session, request)
                except Exception as exc:  # noqa: BLE001 - a hub bug: answer, keep the connection
                    reply = _error(
                        hub,
                        "internal",
                        f"{type(exc).__name__}: {exc}",
                        getattr(request, "seq", None),
                    )
        try:
            await ws.send_text(reply)
        except Exception:  # noqa: BLE001 - any failed send means the socket dropped
            return 1006
        if session.closed:
            with contextlib.suppress(Exception):  # the client may be gone already
                await ws.close(1000)
            return 1000


async def _dispatch(hub: Hub, session: Session, request: Any) -> str:
    """Run one validated request through ``Session.execute`` (at most once per ``seq``)."""
    if isinstance(request, StepRequest):
        return await session.execute(
            request.seq, lambda: _step(hub, session, request.seq, request.env_action())
        )
    if isinstance(request, ResetRequest):
        return await session.execute(request.seq, lambda: _reset(hub, session, request))
    if isinstance(request, CloseRequest):
        return await session.execute(request.seq, lambda: _close(hub, session, request))
    return error_reply("bad_message", "hello is only valid as the first message of a connection")


def oversize(raw: str | bytes, limit: int) -> int | None:
    """The size in bytes of a frame over ``limit`` (a text frame's in UTF-8), or None when it
    fits. A text frame of at most ``limit // 4`` characters fits whatever they are, so the
    commonest frames are not encoded to be measured."""
    if isinstance(raw, bytes) or len(raw) * 4 <= limit:
        size = len(raw)
    else:
        size = len(raw.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


def _plain_step(raw: str | bytes) -> tuple[int, str] | None:
    """``(seq, action)`` of the commonest message, a text step and nothing else
    (``{"type": "step", "seq": N, "action": "..."}``), read without building a model: it is
    most of a closed-loop client's traffic. None for anything else, which the full validation
    reads and explains: what passes here, ``client_message`` accepts as the same request."""
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(message) is not dict or len(message) != 3 or message.get("type") != "step":
        return None
    seq, action = message.get("seq"), message.get("action")
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ or type(action) is not str:
        return None
    return seq, action


def _is_bad_json(raw: str | bytes) -> bool:
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True
    return False


async def _step(hub: Hub, session: Session, seq: int, action: str | dict[str, Any]) -> str:
    if session.episode is None:
        return _error(
            hub,
            "reset_needed",
            "step before reset: send a reset message to start an episode first",
            seq,
        )
    started = time.perf_counter()
    try:
        result = await session.pool.step_json(session.episode, action)
    except (ResetNeededError, UnknownEpisodeError) as exc:
        return _error(hub, "reset_needed", str(exc), seq)
    except EpisodeOverError as exc:
        return _error(hub, "episode_over", str(exc), seq)
    if isinstance(result, bytes):
        hub.metrics.step_done(session.env_id, time.perf_counter() - started)
        if not result.startswith(RUNNING_PREFIX):
            session.running = False
        return b"".join(
            (b'{"type":"step_result","seq":', str(seq).encode(), b',"result":', result, b"}")
        ).decode()
    session.running = False
    return orjson.dumps(
        {"type": "episode_failed", "seq": seq, "failure": result.as_dict()}
    ).decode()


async def _reset(hub: Hub, session: Session, request: ResetRequest) -> str:
    seq = request.seq
    if hub.draining:
        return _error(
            hub,
            "draining",
            "the hub is shutting down and starts no new episodes; reconnect to another hub",
            seq,
        )
    pool, wait_s = session.pool, hub.config.reset_wait_s
    try:
        try:
            result = await pool.reset_json(
                session.episode, seed=request.seed, options=request.options, wait_s=wait_s
            )
        except UnknownEpisodeError:  # the pool dropped it (a failed re-placement): start afresh
            session.episode = None
            result = await pool.reset_json(
                None, seed=request.seed, options=request.options, wait_s=wait_s
            )
    except PoolFullError as exc:
        # raised only while placing: the session's old episode (if any) is gone
        session.episode, session.running = None, False
        return _error(hub, "pool_busy", str(exc), seq)
    except PoolClosedError as exc:
        return _error(hub, "draining", str(exc), seq)
    except WorkerStartError as exc:  # the env no longer builds: the operator's to fix
        session.episode, session.running = None, False
        return _error(hub, "env_unavailable", str(exc), seq)
    if isinstance(result, tuple):
        session.episode, body = result
        session.running = True
        return b"".join(
            (
                b'{"type":"reset_result","seq":',
                str(seq).encode(),
                b',"episode":',
                str(session.episode).encode(),
                b',"result":',
                body,
                b"}",
            )
        ).decode()
    session.episode = result.episode
    session.running = False
    return orjson.dumps(
        {"type": "episode_failed", "seq": request.seq, "failure": result.as_dict()}
    ).decode()


async def _close(hub: Hub, session: Session, request: CloseRequest) -> str:
    await hub.sessions.close(session, "client")
    return orjson.dumps({"type": "closed", "seq": request.seq}).decode()


def _error(hub: Hub, code: str, message: str, seq: int | None) -> str:
    hub.metrics.errors.labels(code).inc()
    return error_reply(code, message, seq)
