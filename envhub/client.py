"""``RemoteEnv``: a ``gymnasium.Env`` whose episodes run on an envhub hub.

``envhub.make("games/sokoban-v0", hub="ws://host:8000", token=...)`` returns one. It
behaves like the local env: same observations, rewards and info; ``step`` before
``reset`` raises ``ResetNeededError`` and ``step`` after the end ``EpisodeOverError``.

Dropped sockets
---------------
Each request carries a sequence number. When the socket drops (a proxy timeout during a
long generation, a network blip), the client reconnects with its session's resume key and
resends the unanswered request; the hub answers it from its record if it was already
applied, so no step is lost or applied twice. Reconnection is retried with backoff until
``resume_timeout_s`` (default: the hub's grace period), then ``SessionLostError``.

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

from envhub.core import ChatSpace, TextSpace, assistant_message
from envhub.errors import EpisodeOverError, ResetNeededError
from envhub.server.errors import RemoteError, SessionLostError

__all__ = ["RemoteEnv"]

_FINAL_CLOSE_CODES = {1000, 1008, 1013, 4404, 4408, 4409}
"""Close codes that mean the hub ended the session on purpose: do not resume."""


class RemoteEnv(gym.Env[list[dict[str, Any]], str]):
    """A hub-hosted env behind the Gymnasium API (see the module docstring)."""

    metadata = {"render_modes": []}  # noqa: RUF012 - gymnasium declares it an instance attribute

    def __init__(
        self,
        env_id: str,
        hub: str,
        *,
        token: str | None = None,
        connect_timeout_s: float = 30.0,
        resume_timeout_s: float | None = None,
        max_message_bytes: int = 16 << 20,
    ) -> None:
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
        self.max_message_bytes = max_message_bytes
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
        welcome = self._connect({"type": "hello", "env": env_id})
        self.session, self.resume_key = welcome["session"], welcome["resume_key"]
        self.max_turns: int | None = welcome.get("max_turns")
        self.resume_timeout_s = welcome["grace_s"] if resume_timeout_s is None else resume_timeout_s

    # ------------------------------------------------------------------ the Gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        super().reset(seed=seed)
        reply = self._request({"type": "reset", "seed": seed, "options": options})
        if reply["type"] == "episode_failed":
            failure = reply["failure"]
            raise RemoteError(
                "episode_failed",
                (
                    f"reset failed on the hub ({failure['reason']}): {failure['detail']}; call "
                    "reset() again"
                ),
            )
        self.episode = reply["episode"]
        result = reply["result"]
        return result["observation"], result["info"]

    def step(
        self, action: str | dict[str, Any]
    ) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        """Step the remote env with the model's text or an assistant message (``TextEnv.step``)."""
        if not isinstance(action, str):
            action = assistant_message(action, "RemoteEnv")
        reply = self._request({"type": "step", "action": action})
        if reply["type"] == "episode_failed":
            failure = reply["failure"]
            info = {
                "turn": failure.get("turn", 0),
                "success": False,
                "invalid_action": False,
                "episode_failed": True,
                "failure": failure,
            }
            return [], 0.0, False, True, info
        r = reply["result"]
        return r["observation"], r["reward"], r["terminated"], r["truncated"], r["info"]

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
    def _connect(self, hello: dict[str, Any]) -> dict[str, Any]:
        from websockets.sync.client import connect

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        ws = connect(
            self.url,
            additional_headers=headers,
            open_timeout=self.connect_timeout_s,
            max_size=self.max_message_bytes,
            compression=None,
            ping_interval=10,
            ping_timeout=20,
            close_timeout=2,
        ).__enter__()  # newer websockets warn unless entered; older ones return self
        from websockets.exceptions import ConnectionClosed

        try:
            try:
                ws.send(orjson.dumps(hello).decode())
            except ConnectionClosed:
                pass  # the hub may refuse before reading the hello; its reason is queued
            message = orjson.loads(ws.recv(timeout=self.connect_timeout_s))
        except ConnectionClosed as exc:
            ws.close()
            code = exc.rcvd.code if exc.rcvd else 1006
            raise RemoteError(
                "closed", f"the hub closed the connection before welcoming it (code {code})"
            ) from exc
        except Exception:
            ws.close()
            raise
        if message.get("type") == "error":
            ws.close()
            raise RemoteError(message["code"], message["message"])
        if message.get("type") != "welcome":
            ws.close()
            raise RemoteError(
                "bad_message", f"expected a welcome from the hub, got {message!r:.200}"
            )
        self._ws = ws
        return message

    def _resume(self, cause: BaseException) -> None:
        """Reconnect and resume the session, retrying with backoff until the deadline."""
        from websockets.exceptions import InvalidStatus

        if self._ws is not None:
            # Abort, never a close frame: the hub would take a clean close as "session over".
            try:
                self._ws.socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            with contextlib.suppress(Exception):
                self._ws.close()
            self._ws = None
        deadline = time.monotonic() + self.resume_timeout_s
        delay = 0.05
        last: BaseException = cause
        while time.monotonic() < deadline:
            try:
                self._connect(
                    {"type": "hello", "session": self.session, "resume_key": self.resume_key}
                )
                self.reconnects += 1
                return
            except RemoteError as exc:
                if exc.code in ("unknown_session", "unauthorized"):
                    raise SessionLostError(
                        exc.code, f"session {self.session} could not be resumed: {exc.message}"
                    ) from cause
                last = exc
            except (OSError, TimeoutError, InvalidStatus, Exception) as exc:  # noqa: BLE001
                # hub restarting, network down, or any other failure: retry until the deadline
                last = exc
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 2.0)
        raise SessionLostError(
            "unknown_session",
            (
                f"lost the connection to {self.url} and could not resume session {self.session} "
                f"within {self.resume_timeout_s:g} s ({type(last).__name__}: {last})"
            ),
        ) from cause

    def _request(self, payload: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        if self._closed:
            raise RemoteError("closed", "this RemoteEnv was closed; make a new one")
        self._seq += 1
        seq = payload["seq"] = self._seq
        frame = orjson.dumps(payload).decode()
        while True:
            try:
                if self._ws is None:
                    raise ConnectionError("not connected")
                self._ws.send(frame)
                while True:
                    message = orjson.loads(self._ws.recv())
                    kind = message.get("type")
                    if kind == "draining":
                        self.draining = True
                        continue
                    if message.get("seq") == seq:
                        break
                    if kind == "error" and message.get("seq") is None:
                        raise RemoteError(message["code"], message["message"])
                break
            except ConnectionClosed as exc:
                rcvd = exc.rcvd
                if rcvd is not None and rcvd.code in _FINAL_CLOSE_CODES:
                    raise RemoteError(
                        "closed",
                        (
                            f"the hub closed the session (code {rcvd.code}: "
                            f"{rcvd.reason or 'no reason'})"
                        ),
                    ) from exc
                if rcvd is not None and rcvd.code == 1001:
                    raise SessionLostError(
                        "draining", "the hub shut down; connect to another hub"
                    ) from exc
                self._resume(exc)
            except (OSError, ConnectionError) as exc:
                self._resume(exc)
        if message["type"] == "error":
            code, text = message["code"], message["message"]
            if code == "reset_needed":
                raise ResetNeededError(f"{self.env_id} (remote): {text}")
            if code == "episode_over":
                raise EpisodeOverError(f"{self.env_id} (remote): {text}")
            raise RemoteError(code, text)
        return message

    def __repr__(self) -> str:
        return f"RemoteEnv({self.env_id!r}, hub={self.url!r}, session={self.session!r})"
