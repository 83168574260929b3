"""Bound what a connection may hold before it has shown the hub's token (slowloris, fd floods).

uvicorn waits for a request as long as its client takes: a socket that sends nothing, half
a request head, or a body shorter than its ``Content-Length`` keeps its file descriptor
forever, and httptools buffers a request head of any size. With a few hundred such sockets
a hub under a 1,024-fd limit stops accepting anyone, no token needed. ``ConnectionGuard``
runs inside uvicorn's httptools protocol (``guarded_protocol``) and guarantees:

1. **Every request is read within ``read_timeout_s``**: head and body, counted from the
   connection's start for its first request and from the first byte for later ones; a
   WebSocket upgrade's head likewise. Past that the connection is closed.
2. **A request head over ``max_head_bytes`` is answered 431** and the connection closed.
3. **At most ``max_unauthenticated`` connections without the token stay open.** A
   connection becomes trusted when a request head carries the hub's token; past the cap
   the *oldest* untrusted connection is closed, so a flood of silent sockets pushes out its
   own members, while real clients (who send their token within a round trip) get in. A
   connection is only closed this way once it has had ``settle_s`` to send its request: a
   burst of real clients connecting together (a trainer opening its sessions at once) is
   accepted faster than it is read, and must not be cut off unread. Younger connections
   count against ``burst_limit`` instead (set from the free file descriptors at start), past
   which the oldest goes at once whatever its age.

What it does not cover: trusted connections are bounded elsewhere (session limits, the
idle timeout, the WebSocket ping, uvicorn's keep-alive timeout; ``ws_protocol``
drops a WebSocket client that stops reading what it is sent); a flood larger than the
kernel's listen backlog is refused by the kernel. ``raise_fd_limit`` lifts the soft
open-file limit to the hard one at start, since every session is a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

from envhub.server.wire import ErrorMessage

__all__ = [
    "MAX_HEAD_BYTES",
    "ConnectionGuard",
    "Inbox",
    "guarded_protocol",
    "raise_fd_limit",
    "ws_protocol",
]

MAX_HEAD_BYTES = 64 * 1024
"""Largest request head (request line + headers) accepted; real clients send well under 2 KiB."""


class ConnectionGuard:
    """The shared state of the guarantees above: timers, untrusted connections, counters.

    ``authorised`` is ``Hub.authorised`` (takes the ``Authorization`` header or ``None``);
    ``on_drop(reason)`` counts a closed connection (``request_timeout``, ``head_too_large``,
    ``unauthenticated_cap``). Everything runs on the server's event loop.
    """

    def __init__(
        self,
        *,
        read_timeout_s: float,
        max_unauthenticated: int,
        authorised: Callable[[str | None], bool],
        max_head_bytes: int = MAX_HEAD_BYTES,
        on_drop: Callable[[str], None] | None = None,
        burst_limit: int = 1024,
    ) -> None:
        self.read_timeout_s = read_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self.burst_limit = burst_limit
        """Untrusted connections held while the youngest of them settle (see 3. above)."""
        self.settle_s = min(2.0, read_timeout_s / 4)
        """How long a new connection has to send its request before the cap may close it."""
        self._recheck: asyncio.TimerHandle | None = None
        self.max_head_bytes = max_head_bytes
        self.authorised = authorised
        self.on_drop = on_drop
        self.untrusted: dict[Any, None] = {}
        """Open connections with no token yet, oldest first (a dict keeps insertion order)."""

    # ------------------------------------------------------------------ protocol events
    def opened(self, conn: Any) -> None:
        """A new connection: untrusted, and its first request must arrive in time."""
        conn.guard_opened = asyncio.get_running_loop().time()
        self.untrusted[conn] = None
        self.arm(conn)
        self._cap()

    def _cap(self) -> None:
        """Close the oldest untrusted connections past ``max_unauthenticated``: those that had
        ``settle_s`` to send their request, and any past ``burst_limit``. If the oldest is still
        settling, look again when it has settled (one timer)."""
        loop = asyncio.get_running_loop()
        while len(self.untrusted) > self.max_unauthenticated:
            oldest = next(iter(self.untrusted))
            settles = oldest.guard_opened + self.settle_s - loop.time()
            if settles > 0 and len(self.untrusted) <= self.burst_limit:
                if self._recheck is None:
                    self._recheck = loop.call_later(settles, self._settled)
                return
            self.drop(oldest, "unauthenticated_cap")

    def _settled(self) -> None:
        self._recheck = None
        self._cap()

    def arm(self, conn: Any) -> None:
        """Start the read deadline of ``conn``'s current request, unless one runs."""
        if conn.guard_timer is None:
            conn.guard_timer = asyncio.get_running_loop().call_later(
                self.read_timeout_s, self.drop, conn, "request_timeout"
            )

    def head_read(self, conn: Any, headers: list[tuple[bytes, bytes]]) -> None:
        """A request head arrived: a valid token makes the connection trusted."""
        if conn not in self.untrusted:
            return
        header = next(
            (value.decode("latin-1") for name, value in headers if name == b"authorization"), None
        )
        if self.authorised(header):
            del self.untrusted[conn]

    def request_read(self, conn: Any) -> None:
        """A request's body is complete: the app has it, the deadline is over."""
        self.disarm(conn)

    def upgraded(self, conn: Any) -> None:
        """The connection became a WebSocket: trusted ones are now the session code's to bound.

        An untrusted one keeps its deadline as a lifetime (the app refuses it at once, but
        its close handshake may wait for a client that never answers), and stays counted.
        """
        if conn in self.untrusted:
            self.arm(conn)
        else:
            self.disarm(conn)

    def closed(self, conn: Any) -> None:
        self.disarm(conn)
        self.untrusted.pop(conn, None)

    # ------------------------------------------------------------------ actions
    def disarm(self, conn: Any) -> None:
        if conn.guard_timer is not None:
            conn.guard_timer.cancel()
            conn.guard_timer = None

    def drop(self, conn: Any, reason: str) -> None:
        """Close ``conn`` now (nothing it sent is answered) and forget it."""
        self.closed(conn)
        conn.transport.abort()
        if self.on_drop is not None:
            self.on_drop(reason)

    def refuse_head(self, conn: Any) -> None:
        """Answer 431 to a request head over the limit and close the connection."""
        body = (
            ErrorMessage(
                code="message_too_large",
                message=(
                    f"the request head is over the {self.max_head_bytes} byte limit; send shorter "
                    "headers and URL"
                ),
            )
            .model_dump_json()
            .encode()
        )
        conn.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        conn.transport.close()
        self.closed(conn)
        if self.on_drop is not None:
            self.on_drop("head_too_large")


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``guard``'s checks, for ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        """``HttpToolsProtocol`` reporting its request phases to the guard (see the module
        docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.guard_timer: asyncio.TimerHandle | None = None
            self.guard_opened = 0.0
            self.head_bytes = 0
            self.reading_head = True

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            guard.opened(self)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.reading_head:  # bytes since the last complete request: the head being read
                self.head_bytes += len(data)
            super().data_received(data)
            if (
                self.reading_head
                and self.head_bytes > guard.max_head_bytes
                and not self.transport.is_closing()
            ):
                guard.refuse_head(self)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            guard.arm(self)

        def on_headers_complete(self) -> None:
            self.reading_head = False
            guard.head_read(self, self.headers)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.reading_head, self.head_bytes = True, 0
            guard.request_read(self)

        def handle_websocket_upgrade(self) -> None:
            guard.upgraded(self)
            super().handle_websocket_upgrade()

    return GuardedHttpToolsProtocol


def raise_fd_limit() -> int:
    """Lift the soft open-file limit to the hard one (each session is a socket); return the soft
    limit in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


class Inbox:
    """A connection's received ASGI messages, for uvicorn's WebSocket protocol (its ``queue``).

    ``asyncio.Queue`` does work per message that this path never needs (unfinished-task
    counting, a ``finished`` event, bounded-size bookkeeping); this is a deque and the readers
    waiting on it, with what uvicorn uses of a queue: ``put_nowait``, ``get`` and ``empty``.
    A reader cancelled after a message woke it passes the wake-up on, so nothing is lost."""

    __slots__ = ("_items", "_waiters")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        self._wake_one()

    async def get(self) -> Any:
        while not self._items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # woken, then cancelled: pass it on
                    self._wake_one()
                raise
        return self._items.popleft()

    def _wake_one(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def ws_protocol(stall_s: float) -> type[asyncio.Protocol]:
    """uvicorn's sans-io WebSocket protocol, for ``uvicorn.Config(ws=...)``, as a hub facing
    hostile clients needs it:

    - it drops (aborts) a connection whose client has stopped reading: what the hub has to send
      it stayed unsent for ``stall_s``, or its keepalive ping went unanswered. uvicorn closes
      such a connection gracefully, and a graceful close waits for the client to read what is
      queued: forever, for a client that never does, holding the socket and megabytes of send
      buffer (its session is reaped meanwhile, so no session limit bounds them);
    - a text message that is not UTF-8 closes the connection with 1007 and one log line, where
      uvicorn logs a traceback for each (a client could fill the hub's log with them).

    And each message costs less, as every step is a receive and a send: received messages go
    through an ``Inbox`` rather than an ``asyncio.Queue``, a text message is decoded once (the
    UTF-8 check was a second decode), and an answer on a writable connection is framed and
    written without awaiting the ``writable`` event (what that saves per step:
    benchmarks/README.md, ``hub_throughput``)."""
    from uvicorn.protocols.utils import ClientDisconnected
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    from websockets.exceptions import InvalidState

    class HubWebSocketProtocol(WebSocketsSansIOProtocol):
        stall_timer: asyncio.TimerHandle | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.queue = Inbox()  # type: ignore[assignment]

        def send_receive_event_to_app(self) -> None:
            if self.curr_msg_data_type != "text" or self.close_sent:
                super().send_receive_event_to_app()
                return
            frames, self.frames = self.frames, []
            try:
                text = (frames[0] if len(frames) == 1 else b"".join(frames)).decode()
            except UnicodeDecodeError:
                self.logger.warning("closed a WebSocket that sent text not in UTF-8 (1007)")
                self.conn.send_close(1007)
                self.handle_parser_exception()
                return
            self.queue.put_nowait({"type": "websocket.receive", "text": text})

        async def send(self, message: Any) -> None:
            text = message.get("text")
            if (  # the hot path, an answer on an open, writable connection: no Event to await
                text is None
                or message["type"] != "websocket.send"
                or message.get("bytes") is not None
                or not self.handshake_complete
                or self.close_sent
                or self.initial_response is not None
                or self.disconnected
                or not self.writable.is_set()
            ):
                await super().send(message)
                return
            try:
                self.conn.send_text(text.encode())
            except InvalidState:
                raise ClientDisconnected() from None
            self.transport.write(b"".join(self.conn.data_to_send()))

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.stall_timer is None:
                self.stall_timer = self.loop.call_later(stall_s, self.drop)

        def resume_writing(self) -> None:
            self._cancel_stall()
            super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_stall()
            super().connection_lost(exc)

        def keepalive_timeout(self) -> None:
            super().keepalive_timeout()  # sends a close frame that may never be read
            self.drop()

        def drop(self) -> None:
            """Reset the connection: a plain close would leave the kernel an orphan socket
            that keeps trying to send the unread megabytes to a client that takes none."""
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

        def _cancel_stall(self) -> None:
            if self.stall_timer is not None:
                self.stall_timer.cancel()
                self.stall_timer = None

    return HubWebSocketProtocol
