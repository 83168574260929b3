"""Sessions: one env episode stream per client, surviving dropped sockets.

A ``Session`` outlives its WebSocket. When the socket drops it is *detached* and waits
``grace_s`` for the client to come back with its ``resume_key``; then it is closed and its
episode freed. Requests are numbered (``seq``) and the session keeps the last answer, so
a request resent after a resume is answered again without being applied again, and a
request still running when the socket dropped is awaited, not repeated.

``SessionManager`` enforces the global and per-client limits and reaps sessions that are
idle (connected, running no request, silent for ``idle_timeout_s`` since its last answer) or
abandoned (detached past ``grace_s``). A reaped (or drained, or shut down) session is gone at
once, its slot and per-client count freed; its env is closed in the background
(``discard``), because a worker answers in order and the close would wait behind every step
queued on that worker, stalling the reaper for every session on the hub.
A session holds at most one episode, and a one-shot HTTP rollout counts as a session of
its client while it runs (``hold``/``release``), so one client's episodes, over both
surfaces, stay within ``max_sessions_per_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import orjson

from envhub.server.errors import SessionLimitError

__all__ = ["Connection", "Session", "SessionManager", "error_reply"]


def error_reply(code: str, message: str, seq: int | None = None) -> str:
    """An ``error`` message (see ``envhub.server.wire.ErrorMessage``) as a text frame."""
    return orjson.dumps({"type": "error", "code": code, "message": message, "seq": seq}).decode()


class Connection(Protocol):
    """What the manager needs from the socket a session is attached to."""

    def kick(self, code: int, reply: str) -> None:
        """Send ``reply`` and close the socket with ``code`` (from any task); the close frame's
        reason is ``reply``'s message, so a client that never reads ``reply`` still learns
        why."""
        ...

    def notify(self, reply: str) -> None:
        """Send ``reply`` without closing (from any task)."""
        ...

    async def sent(self) -> None:
        """Return once what ``kick`` and ``notify`` queued has been sent (or failed to be)."""
        ...


class Session:
    """One client's env session (see the module docstring)."""

    __slots__ = (
        "busy_seq",
        "client",
        "closed",
        "conn",
        "detached_at",
        "env_id",
        "episode",
        "id",
        "last_active",
        "last_reply",
        "last_seq",
        "pool",
        "resume_key",
        "running",
        "waiters",
    )

    def __init__(self, env_id: str, client: str, pool: Any) -> None:
        self.id = secrets.token_urlsafe(12)
        self.resume_key = secrets.token_urlsafe(24)
        self.env_id = env_id
        self.client = client
        self.pool = pool
        self.episode: int | None = None
        self.running = False
        """An episode is in progress (reset answered, not yet terminated/truncated/failed)."""
        self.last_seq = 0
        self.last_reply: str | None = None
        self.busy_seq = 0
        self.waiters: list[asyncio.Future[str]] | None = None
        self.conn: Connection | None = None
        self.last_active = time.monotonic()
        self.detached_at: float | None = None
        self.closed = False

    @contextlib.contextmanager
    def busy(self, seq: int) -> Iterator[None]:
        """Mark request ``seq`` running (OpenEnv's requests, which carry none, pass -1): the
        reaper spares a busy session however long the request runs, and its idle time counts
        from when the request ended."""
        self.busy_seq = seq
        try:
            yield
        finally:
            self.busy_seq = 0
            self.last_active = time.monotonic()

    async def execute(self, seq: int, work: Callable[[], Awaitable[str]]) -> str:
        """Run request ``seq`` at most once; a repeat of the last one gets the same answer."""
        if seq == self.last_seq and self.last_reply is not None:
            return self.last_reply
        if seq == self.busy_seq:  # resent after a resume while the first copy still runs
            future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            if self.waiters is None:
                self.waiters = []
            self.waiters.append(future)
            return await future
        if self.busy_seq:
            return error_reply(
                "busy", f"request {self.busy_seq} is still running; send one request at a time", seq
            )
        if seq != self.last_seq + 1:
            return error_reply(
                "bad_seq",
                (
                    f"expected seq {self.last_seq + 1} (or {self.last_seq} to repeat the last "
                    f"request), got {seq}"
                ),
                seq,
            )
        self.busy_seq = seq  # as ``busy`` does, inline: this is every step's path
        try:
            reply = await work()
        except Exception as exc:  # noqa: BLE001 - a bug in the hub: answer, keep the session usable
            reply = error_reply("internal", f"{type(exc).__name__}: {exc}", seq)
        finally:
            self.busy_seq = 0
            self.last_active = time.monotonic()
        self.last_seq = seq
        self.last_reply = reply
        if self.waiters:
            for waiter in self.waiters:
                if not waiter.done():
                    waiter.set_result(reply)
            self.waiters = None
        return reply


class SessionManager:
    """Every open session, the limits on them, and the reaper (see the module docstring)."""

    def __init__(
        self,
        *,
        max_sessions: int,
        max_sessions_per_client: int,
        idle_timeout_s: float,
        grace_s: float,
        on_close: Callable[[Session, str], None] | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.max_sessions_per_client = max_sessions_per_client
        self.idle_timeout_s = idle_timeout_s
        self.grace_s = grace_s
        self.sessions: dict[str, Session] = {}
        self.per_client: dict[str, int] = {}
        self.on_close = on_close
        self._closing: set[asyncio.Task[None]] = set()
        """Env closes running in the background (``discard``)."""

    def open(self, env_id: str, client: str, pool: Any) -> Session:
        """A new session; ``SessionLimitError`` when a limit is reached."""
        if len(self.sessions) >= self.max_sessions:
            raise SessionLimitError(
                (
                    f"the hub holds its maximum of {self.max_sessions} sessions; retry later or "
                    "connect to another hub"
                ),
                "global",
            )
        self.hold(client)
        session = Session(env_id, client, pool)
        self.sessions[session.id] = session
        return session

    def hold(self, client: str) -> None:
        """Count one more session (or running rollout) for ``client``; ``SessionLimitError`` past
        its limit."""
        held = self.per_client.get(client, 0)
        if held >= self.max_sessions_per_client:
            raise SessionLimitError(
                (
                    f"this client already holds {held} sessions and rollouts (the limit per client "
                    f"is {self.max_sessions_per_client}); close finished sessions (env.close()) or "
                    "wait for running rollouts before starting more"
                ),
                "client",
            )
        self.per_client[client] = held + 1

    def release(self, client: str) -> None:
        """Undo one ``hold`` (a session closed, a rollout ended)."""
        left = self.per_client.get(client, 1) - 1
        if left > 0:
            self.per_client[client] = left
        else:
            self.per_client.pop(client, None)

    def find(self, session_id: str, resume_key: str) -> Session | None:
        """The session to resume, if the id exists and the key matches (compared as bytes: any text
        is safe)."""
        session = self.sessions.get(session_id)
        given = resume_key.encode("utf-8", "surrogatepass")
        if session is None or not hmac.compare_digest(session.resume_key.encode(), given):
            return None
        return session

    def attach(self, session: Session, conn: Connection) -> Connection | None:
        """Bind ``conn`` to the session; return the connection it replaces, if any."""
        previous = session.conn
        session.conn = conn
        session.detached_at = None
        session.last_active = time.monotonic()
        return previous

    def detach(self, session: Session, conn: Connection) -> None:
        """The socket ``conn`` dropped; keep the session for ``grace_s`` (or close it now)."""
        if session.conn is not conn or session.closed:
            return  # a newer connection took over
        session.conn = None
        session.detached_at = time.monotonic()

    async def close(self, session: Session, reason: str) -> None:
        """Close the session and free its episode, waiting for its worker to close the env (a
        client's own close: only that client waits). Idempotent."""
        if self._forget(session, reason) and session.episode is not None:
            await _close_episode(session)

    def discard(self, session: Session, reason: str) -> None:
        """Close the session now and close its env in the background (see the module
        docstring): for the reaper, the drain and shutdown, which must not wait on a busy
        worker. Idempotent."""
        if self._forget(session, reason) and session.episode is not None:
            task = asyncio.get_running_loop().create_task(_close_episode(session))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def wait_closed(self, timeout_s: float | None = None) -> None:
        """Wait for the background closes (at most ``timeout_s``), then cancel any left."""
        if self._closing:
            _, left = await asyncio.wait(set(self._closing), timeout=timeout_s)
            for task in left:
                task.cancel()
            if left:
                await asyncio.gather(*left, return_exceptions=True)

    def _forget(self, session: Session, reason: str) -> bool:
        """Drop the session from the books; False if it was closed already."""
        if session.closed:
            return False
        session.closed = True
        self.sessions.pop(session.id, None)
        self.release(session.client)
        if self.on_close is not None:
            self.on_close(session, reason)
        return True

    async def reap(self) -> int:
        """Close idle and abandoned sessions once (their envs in the background: ``discard``);
        return how many were closed."""
        now = time.monotonic()
        doomed: list[tuple[Session, str]] = []
        for session in self.sessions.values():
            if session.busy_seq:
                continue  # a running request is not idleness
            if session.conn is None:
                if session.detached_at is not None and now - session.detached_at >= self.grace_s:
                    doomed.append((session, "abandoned"))
            elif now - session.last_active >= self.idle_timeout_s:
                doomed.append((session, "idle"))
        for session, reason in doomed:
            conn = session.conn
            if conn is not None:
                conn.kick(
                    4408,
                    error_reply(
                        "idle_timeout",
                        (
                            f"no request for idle_timeout_s={self.idle_timeout_s:g} s (the hub's "
                            "--idle-timeout); the session was closed"
                        ),
                    ),
                )
            self.discard(session, reason)
        return len(doomed)

    def counts(self) -> tuple[int, int]:
        """``(attached, detached)`` sessions."""
        attached = sum(1 for s in self.sessions.values() if s.conn is not None)
        return attached, len(self.sessions) - attached


async def _close_episode(session: Session) -> None:
    """Free the session's episode on its pool (its worker closes the env)."""
    with contextlib.suppress(Exception):  # the episode may be gone with its worker
        await session.pool.close_episode(session.episode)
