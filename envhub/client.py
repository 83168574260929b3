"""``RemoteEnv``: a ``gymnasium.Env`` whose episodes run on an envhub hub.

``envhub.make("games/sokoban-v0", hub="ws://host:8000", token=...)`` returns one. It
behaves like the local env: same observations, rewards and info; ``step`` before
``reset`` raises ``ResetNeededError`` and ``step`` after the end ``EpisodeOverError``. It
reads like a ``TextEnv`` too: ``tools`` (from reset info, so ``[]`` until the first reset),
``done``, ``turn`` and ``messages`` (the transcript, kept by the client). ``expert_action``
is not offered: the protocol carries no such request, and a ``None`` would wrongly say the
env has no expert; play the expert on a local env (``envhub.make(id)``).

Env kwargs cannot travel: the hub builds its envs when it starts, so ``make(id, hub=...,
size=8)`` raises ``EnvKwargsError`` naming the fix, ``envhub serve --env ID -k size=8``
(or a variant id registered with those kwargs).

Dropped sockets
---------------
Each request carries a sequence number. When the socket drops (a proxy timeout during a
long generation, a network blip), the client reconnects with its session's resume key and
resends the unanswered request; the hub answers it from its record if it was already
applied, so no step is lost or applied twice. Reconnection is retried with backoff until
``resume_timeout_s`` (default: the hub's grace period; each attempt's handshake and welcome
wait within it), then ``SessionLostError`` with code ``resume_timeout``. A request whose
link drops every time it is sent is given up after a few resumes (``SessionLostError``,
code ``connection_unstable``).

Waiting for an answer
---------------------
``request_timeout_s`` (default 300 s: above what a hub at its defaults takes to answer or
fail any request, ``reset_wait_s`` + ``step_timeout_s`` = 90 s) bounds the wait for each
answer. A hub that stays connected but does not answer in time is reconnected to once and
the request resent; a second silence raises ``RemoteError`` with code ``request_timeout``.
Raise it for a hub served with a longer ``--step-timeout``.

Errors that are not retried
---------------------------
A message over a size limit raises ``RemoteError`` with code ``message_too_large`` and the
limit to raise: an action over the hub's ``max_message_bytes`` (its welcome states it) is
refused before it is sent; an answer over this client's ``max_message_bytes`` (the
constructor's option) is refused when it arrives. A reply that is not the hub's protocol
(a wrong URL, a proxy's error page, another envhub version) raises code ``bad_message``.
Either way the session goes on: the next call may succeed.

Failed episodes
---------------
If the hub's worker crashed or hung, ``step`` returns ``([], 0.0, False, True, info)`` with
``info["episode_failed"] = True`` and ``info["failure"]`` (reason, detail): the episode is
over, as data a trainer can filter; call ``reset`` to go on. A failed ``reset`` raises
``RemoteError`` with code ``episode_failed``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from typing import Any

import gymnasium as gym
import orjson
from pydantic import ValidationError

from envhub.core import ChatSpace, TextSpace, assistant_message
from envhub.errors import EnvKwargsError, EpisodeOverError, ResetNeededError
from envhub.server.config import serve_command
from envhub.server.errors import RemoteError, SessionLostError
from envhub.server.wire import ErrorMessage, Welcome, server_message

__all__ = ["RemoteEnv"]

_FINAL_CLOSE_CODES = {1000, 1008, 1013, 4404, 4408, 4409}
"""Close codes that mean the hub ended the session on purpose: do not resume."""
_MESSAGE_TOO_BIG = 1009
"""The close code of a message over a side's size limit: resending it would fail again."""
_MAX_RESUMES = 5
"""Resumes one request may take: a link cut every time the request is sent is not a blip."""
_REQUIRED = {
    "reset_result": ("result", ("observation", "info")),
    "step_result": ("result", ("observation", "reward", "terminated", "truncated", "info")),
    "episode_failed": ("failure", ("reason", "detail")),
}
"""The keys ``reset``/``step`` read from each answer's free-form object (the wire types
leave them ``dict[str, Any]``)."""
_ANSWERS = {"reset": ("reset_result", "episode_failed"), "step": ("step_result", "episode_failed")}
"""What the hub may answer each request with, besides an ``error``."""


class RemoteEnv(gym.Env[list[dict[str, Any]], str]):
    """A hub-hosted env behind the Gymnasium API (see the module docstring).

    Options: ``token`` (default ``$ENVHUB_TOKEN``); ``connect_timeout_s``, the time to open
    a connection and be welcomed; ``resume_timeout_s``, how long to try to resume after a
    dropped socket (default: the hub's ``grace_s``); ``request_timeout_s``, how long to wait
    for each answer before reconnecting once and then raising; ``max_message_bytes``, the
    largest answer this client accepts. Any other keyword is taken for an env kwarg and refused
    (see the module docstring).
    """

    metadata = {"render_modes": []}  # noqa: RUF012 - gymnasium declares it an instance attribute

    def __init__(
        self,
        env_id: str,
        hub: str,
        *,
        token: str | None = None,
        connect_timeout_s: float = 30.0,
        resume_timeout_s: float | None = None,
        request_timeout_s: float = 300.0,
        max_message_bytes: int = 16 << 20,
        **env_kwargs: Any,
    ) -> None:
        if env_kwargs:
            raise EnvKwargsError(
                f"{env_id} cannot be given env kwargs through a hub (got "
                f"{', '.join(f'{k}={v!r:.40}' for k, v in env_kwargs.items())}): the hub builds "
                f"its envs itself. Serve it with them: `{serve_command(env_id, env_kwargs)}`, or "
                "register a variant with them (envhub.register(..., variants={NAME: {...}})) and "
                "serve that id. RemoteEnv's own options are token, connect_timeout_s, "
                "resume_timeout_s, request_timeout_s and max_message_bytes"
            )
        super().__init__()
        base = hub.rstrip("/")
        if base.startswith(("http://", "https://")):
            base = "ws" + base[4:]
        if not base.startswith(("ws://", "wss://")):
            raise ValueError(
                f"hub must be a ws:// or wss:// address like 'ws://127.0.0.1:8000', got {hub!r}"
            )
        self.env_id = env_id
        self.url = f"{base}/v1/session"
        self.token = token if token is not None else os.environ.get("ENVHUB_TOKEN")
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_message_bytes = max_message_bytes
        self.hub_max_message_bytes: int | None = None
        """The largest request the hub takes, as its last welcome said."""
        self.observation_space = ChatSpace()
        self.action_space = TextSpace()
        self.session = ""
        self.resume_key = ""
        self.draining = False
        self.reconnects = 0
        self.episode: int | None = None
        self._seq = 0
        self._ws: Any = None
        self._closed = False
        self._turn = 0
        self._done = False
        self._history: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] = []
        welcome = self._open(env_id, hub)
        self.session, self.resume_key = welcome.session, welcome.resume_key
        self.max_turns: int | None = welcome.max_turns
        self.resume_timeout_s = welcome.grace_s if resume_timeout_s is None else resume_timeout_s

    # ------------------------------------------------------------------ the Gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        super().reset(seed=seed)
        reply = self._request({"type": "reset", "seed": seed, "options": options})
        if reply.type == "episode_failed":
            failure = reply.failure
            raise RemoteError(
                "episode_failed",
                (
                    f"reset failed on the hub ({failure['reason']}): {failure['detail']}; call "
                    "reset() again"
                ),
            )
        self.episode = reply.episode
        observation, info = reply.result["observation"], reply.result["info"]
        self._turn, self._done = 0, False
        self._history = list(observation)
        self._tools = list(info.get("tools") or [])
        return observation, info

    def step(
        self, action: str | dict[str, Any]
    ) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        """Step the remote env with the model's text or an assistant message (``TextEnv.step``)."""
        if not isinstance(action, str):
            action = assistant_message(action, "RemoteEnv")
        reply = self._request({"type": "step", "action": action})
        self._history.append(
            {"role": "assistant", "content": action} if isinstance(action, str) else action
        )
        if reply.type == "episode_failed":
            failure = reply.failure
            info = {
                "turn": failure.get("turn", 0),
                "success": False,
                "invalid_action": False,
                "episode_failed": True,
                "failure": failure,
            }
            self._turn, self._done = info["turn"], True
            return [], 0.0, False, True, info
        r = reply.result
        self._turn = r["info"].get("turn", self._turn + 1)
        self._done = bool(r["terminated"] or r["truncated"])
        self._history.extend(r["observation"])
        return r["observation"], r["reward"], r["terminated"], r["truncated"], r["info"]

    # ------------------------------------------------------------------ read-only state
    @property
    def tools(self) -> list[dict[str, Any]]:
        """The env's tool schemas, as the last reset's info carried them (``[]`` before the
        first reset, or when the env publishes none)."""
        return list(self._tools)

    @property
    def turn(self) -> int:
        """Turns taken in the current episode (the hub's count, from each step's info)."""
        return self._turn

    @property
    def done(self) -> bool:
        """Whether the current episode has ended (terminated, truncated, or failed on the hub)."""
        return self._done

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The whole transcript of the current episode, the actions included (kept here, as
        ``TextEnv.messages`` has it)."""
        return list(self._history)

    def close(self) -> None:
        """End the session on the hub (frees its env at once). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        ws = self._ws
        if ws is None:
            return
        try:
            with contextlib.suppress(Exception):  # closing is best effort: the hub may be gone
                self._seq += 1
                ws.send(orjson.dumps({"type": "close", "seq": self._seq}).decode())
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    timeout = max(0.01, deadline - time.monotonic())
                    message = orjson.loads(ws.recv(timeout=timeout))
                    if message.get("type") == "closed" or message.get("type") == "error":
                        break
        finally:
            with contextlib.suppress(Exception):
                ws.close()
            self._ws = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from __del__
            if self._ws is None:
                return
            if sys.is_finalizing():
                # the interpreter is exiting: websockets' reader thread is frozen, so a close
                # handshake would wait forever; drop the socket (the hub ends the session)
                self._ws.socket.close()
            else:
                self._ws.close()

    # ------------------------------------------------------------------ transport
    def _open(self, env_id: str, hub: str) -> Welcome:
        """The first connection: a hub that cannot be reached, or is not a hub, is a
        ``RemoteError("unreachable")`` naming the URL (a resume retries such failures)."""
        from websockets.exceptions import InvalidHandshake, InvalidURI

        try:
            return self._connect({"type": "hello", "env": env_id}, self.connect_timeout_s)
        except (OSError, InvalidHandshake, InvalidURI) as exc:  # (TimeoutError is an OSError)
            raise RemoteError(
                "unreachable",
                (
                    f"could not open a session at {self.url} ({type(exc).__name__}: {exc}); "
                    f"the hub address is what `envhub serve` prints, ws://HOST:PORT with no "
                    f"path (got {hub!r}), and the hub must be running and reachable from here"
                ),
            ) from exc

    def _connect(self, hello: dict[str, Any], timeout_s: float) -> Welcome:
        """Open a socket, send ``hello`` and return the hub's welcome, all within ``timeout_s``;
        on any failure the socket is closed."""
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        ws = connect(
            self.url,
            additional_headers=headers,
            open_timeout=timeout_s,
            max_size=self.max_message_bytes,
            compression=None,
            ping_interval=10,
            ping_timeout=20,
            close_timeout=2,
        ).__enter__()  # newer websockets warn unless entered; older ones return self
        try:
            with contextlib.suppress(ConnectionClosed):
                # the hub may refuse before reading the hello; its reason is queued
                ws.send(orjson.dumps(hello).decode())
            message = self._parse(ws.recv(timeout=max(0.0, deadline - time.monotonic())))
        except ConnectionClosed as exc:
            ws.close()
            code = exc.rcvd.code if exc.rcvd else 1006
            raise RemoteError(
                "closed", f"the hub closed the connection before welcoming it (code {code})"
            ) from exc
        except TimeoutError:
            _abort(ws)  # a silent hub would not answer a close handshake either
            raise
        except BaseException:
            ws.close()
            raise
        if isinstance(message, Welcome):
            self._ws = ws
            self.hub_max_message_bytes = message.max_message_bytes
            return message
        ws.close()
        if isinstance(message, ErrorMessage):
            raise RemoteError(message.code, message.message)
        raise self._off_protocol(f"expected a welcome, got {message.type!r}", message)

    def _resume(self, cause: BaseException) -> None:
        """Reconnect and resume the session, retrying with backoff until ``resume_timeout_s``."""
        self._drop()
        deadline = time.monotonic() + self.resume_timeout_s
        delay = 0.05
        last: BaseException = cause
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._connect(
                    {"type": "hello", "session": self.session, "resume_key": self.resume_key},
                    min(self.connect_timeout_s, left),
                )
                self.reconnects += 1
                return
            except RemoteError as exc:
                if exc.code in ("unknown_session", "unauthorized"):
                    raise SessionLostError(
                        exc.code, f"session {self.session} could not be resumed: {exc.message}"
                    ) from cause
                last = exc
            except Exception as exc:  # noqa: BLE001
                # hub restarting, network down, or any other failure: retry until the deadline
                last = exc
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 2.0)
        raise SessionLostError(
            "resume_timeout",
            (
                f"lost the connection to {self.url} and could not resume session {self.session} "
                f"within resume_timeout_s={self.resume_timeout_s:g} s (last attempt: "
                f"{type(last).__name__}: {last}); the hub is down or unreachable"
            ),
        ) from cause

    def _drop(self) -> None:
        """Forget the socket without a close frame: the hub would take a clean close as
        "session over", a dropped link keeps the session for a resume."""
        if self._ws is not None:
            _abort(self._ws)
            self._ws = None

    def _request(self, payload: dict[str, Any]) -> Any:
        """Send ``payload`` as the next request and return the hub's answer (a wire model),
        resuming the session when the link drops."""
        from websockets.exceptions import ConnectionClosed

        if self._closed:
            raise RemoteError("closed", "this RemoteEnv was closed; make a new one")
        seq = payload["seq"] = self._seq + 1
        frame = orjson.dumps(payload).decode()
        self._check_size(frame, payload["type"])
        self._seq = seq
        resumes = 0
        timed_out = False
        while True:
            try:
                if self._ws is None:
                    raise ConnectionError("not connected")
                self._ws.send(frame)
                message = self._answer(seq)
                break
            except TimeoutError as exc:  # (an OSError: caught first)
                if timed_out:
                    self._drop()
                    raise RemoteError(
                        "request_timeout",
                        (
                            f"the hub at {self.url} did not answer this {payload['type']} within "
                            f"request_timeout_s={self.request_timeout_s:g} s, before and after "
                            "reconnecting: it is overloaded or stuck; if its steps take longer, "
                            "pass a larger request_timeout_s to RemoteEnv (or envhub.make)"
                        ),
                    ) from exc
                timed_out = True
                cause: BaseException = exc
            except ConnectionClosed as exc:
                self._raise_if_final(exc, payload["type"])
                cause = exc
            except (OSError, ConnectionError) as exc:
                cause = exc
            if resumes == _MAX_RESUMES:
                self._drop()
                raise SessionLostError(
                    "connection_unstable",
                    (
                        f"the link to {self.url} dropped {resumes + 1} times while this "
                        f"{payload['type']} waited for its answer (last: {type(cause).__name__}: "
                        f"{cause}); the hub or a proxy between cuts it, e.g. at a message size "
                        "limit"
                    ),
                ) from cause
            resumes += 1
            self._resume(cause)
        if isinstance(message, ErrorMessage):
            if message.code == "reset_needed":
                raise ResetNeededError(f"{self.env_id} (remote): {message.message}")
            if message.code == "episode_over":
                raise EpisodeOverError(f"{self.env_id} (remote): {message.message}")
            raise RemoteError(message.code, message.message)
        if message.type not in _ANSWERS[payload["type"]]:
            raise self._off_protocol(
                f"a {payload['type']} answered with {message.type!r}", message.model_dump_json()
            )
        return message

    def _answer(self, seq: int) -> Any:
        """Read messages until the answer to request ``seq``; ``TimeoutError`` after
        ``request_timeout_s``."""
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            message = self._parse(self._ws.recv(timeout=max(0.0, deadline - time.monotonic())))
            if message.type == "draining":
                self.draining = True
            elif getattr(message, "seq", None) == seq:
                return message
            elif isinstance(message, ErrorMessage) and message.seq is None:
                self._seq = seq - 1  # refused unread (e.g. too large): the hub used no seq
                raise RemoteError(message.code, message.message)

    def _check_size(self, frame: str, kind: str) -> None:
        """Refuse a request the hub would refuse as too large, before sending it."""
        limit = self.hub_max_message_bytes
        if limit is None:
            return
        # the hub measures a frame in UTF-8 bytes (envhub.server.ws.oversize); a frame of at
        # most limit / 4 characters fits whatever they are, and is not encoded to be measured
        size = (
            len(frame) if len(frame) * 4 <= limit else len(frame.encode("utf-8", "surrogatepass"))
        )
        if size > limit:
            raise RemoteError(
                "message_too_large",
                (
                    f"this {kind} is {size} bytes as JSON, over the hub's "
                    f"max_message_bytes={limit} (stated in its welcome); send a shorter action, "
                    "or serve the hub with a larger --max-message-bytes"
                ),
            )

    def _raise_if_final(self, exc: Any, kind: str) -> None:
        """Raise for a close that a resume would not mend (``exc``: ``ConnectionClosed``)."""
        rcvd, sent = exc.rcvd, exc.sent
        by_hub = rcvd is not None and (sent is None or exc.rcvd_then_sent)
        first = rcvd if by_hub else sent
        if first is not None and first.code == _MESSAGE_TOO_BIG:
            self._drop()
            if by_hub:
                self._seq -= 1  # the hub closed before reading it: the seq is unused
                raise RemoteError(
                    "message_too_large",
                    (
                        f"the hub at {self.url} closed the connection: this {kind} is over its "
                        "frame size limit, which its max_message_bytes sets (its welcome said "
                        f"{self.hub_max_message_bytes}; {first.reason}); send a shorter action, or "
                        "serve the hub with a larger --max-message-bytes"
                    ),
                ) from exc
            raise RemoteError(
                "message_too_large",
                (
                    f"the hub's answer to this {kind} is over this client's "
                    f"max_message_bytes={self.max_message_bytes} ({first.reason}); pass a larger "
                    "max_message_bytes to RemoteEnv(...) or envhub.make(...), or make the env's "
                    "observations smaller"
                ),
            ) from exc
        if rcvd is not None and rcvd.code in _FINAL_CLOSE_CODES:
            raise RemoteError(
                "closed",
                f"the hub closed the session (code {rcvd.code}: {rcvd.reason or 'no reason'})",
            ) from exc
        if rcvd is not None and rcvd.code == 1001:
            raise SessionLostError("draining", "the hub shut down; connect to another hub") from exc

    def _parse(self, raw: str | bytes) -> Any:
        """The hub's message ``raw`` as its wire type, or ``bad_message`` saying what is off."""
        try:
            message = server_message.validate_json(raw)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            where = ".".join(str(part) for part in error["loc"])
            raise self._off_protocol(f"{where}: {error['msg']}" if where else error["msg"], raw)
        field, keys = _REQUIRED.get(message.type, ("", ()))
        missing = [key for key in keys if key not in getattr(message, field)]
        if missing:
            raise self._off_protocol(f"{field} lacks {', '.join(missing)}", raw)
        return message

    def _off_protocol(self, what: str, message: Any) -> RemoteError:
        return RemoteError(
            "bad_message",
            (
                f"the hub at {self.url} sent a message that is not envhub's protocol ({what}): "
                f"{message!r:.200}; check that the address is an `envhub serve` hub, and that "
                "the hub and this client run the same envhub version"
            ),
        )

    def __repr__(self) -> str:
        return f"RemoteEnv({self.env_id!r}, hub={self.url!r}, session={self.session!r})"


def _abort(ws: Any) -> None:
    """Close ``ws`` without a close handshake (the peer may be gone or silent)."""
    with contextlib.suppress(OSError):
        ws.socket.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        ws.close()
