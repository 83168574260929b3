"""``HubSession``: the client's side of one session on an envhub hub (``RemoteEnv`` uses it).

It opens the session (``hello``/``welcome``), numbers each request (``seq``), resumes the
session after a dropped socket and resends the unanswered request, settles a request it gave
up on before sending the next, and opens a new session for a ``reset`` when the hub no longer
has this one. What it accepts from the hub is checked here too: the wire types
(``envhub.server.wire``) leave a result ``dict[str, Any]`` (the hub splices the worker's JSON
into its answer undecoded), and a ``RemoteEnv`` returns that result to code written for a local
``TextEnv``, which guarantees its types. So a result is checked by the rules the hub's workers
apply to an env's output (``envhub.pool.host``: chat messages, a finite reward, bool flags, a
dict of info), with plain type tests cheap enough for every step; one of other types (a hub of
another version, a proxy) is ``RemoteError("bad_message")`` naming the field. Requests go out
as JSON; numpy numbers and arrays go as JSON numbers and lists, and a value JSON cannot carry is
a ``TypeError`` naming where it is.

The behaviour a user sees (timeouts, resumes, sessions that are gone) is described in
``envhub.client``.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from typing import Any

import orjson
from pydantic import ValidationError

from envhub.errors import EpisodeOverError, ResetNeededError
from envhub.pool.host import observation_problem, step_output_problem
from envhub.server.errors import RemoteError, SessionLostError
from envhub.server.wire import ErrorMessage, Welcome, server_message

__all__ = ["HubSession", "answer_problem", "dump_request"]

_FINAL_CLOSE_CODES = {1000, 1008, 1013, 4404, 4409}
"""Close codes that mean the hub ended the session on purpose: do not resume."""
_IDLE_CLOSE = 4408
"""The close code of a session the hub reaped as idle."""
_MESSAGE_TOO_BIG = 1009
"""The close code of a message over a side's size limit: resending it would fail again."""
_MAX_RESUMES = 5
"""Resumes one request may take: a link cut every time the request is sent is not a blip."""
_GONE = {"unknown_session", "idle_timeout", "draining"}
"""``SessionLostError`` codes after which a ``reset`` opens a new session."""
_ANSWERS = {"reset": ("reset_result", "episode_failed"), "step": ("step_result", "episode_failed")}
"""What the hub may answer each request with, besides an ``error``."""
_JSON_TYPES = "JSON values (dicts with str keys, lists, str, int, float, bool, None, numpy numbers)"


class HubSession:
    """One session on the hub at ``url`` (a ``ws://HOST:PORT/v1/session`` address), opened
    at construction (see the module docstring). ``hub`` is the address as the user gave it,
    for messages."""

    def __init__(
        self,
        env_id: str,
        url: str,
        hub: str,
        *,
        token: str | None,
        connect_timeout_s: float,
        resume_timeout_s: float | None,
        request_timeout_s: float,
        max_message_bytes: int,
    ) -> None:
        self.env_id, self.url, self.hub, self.token = env_id, url, hub, token
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_message_bytes = max_message_bytes
        self.hub_max_message_bytes: int | None = None
        """The largest request the hub takes, as its last welcome said."""
        self.idle_timeout_s: float | None = None
        """How long the hub keeps a silent session, as its last welcome said."""
        self.draining = False
        self.reconnects = 0
        self.closed = False
        self.ws: Any = None
        self.seq = 0
        self.unanswered: tuple[int, str, str] | None = None
        """``(seq, frame, kind)`` of a request given up on (``request_timeout``), which the hub
        may still be running: the next ``reset`` awaits its answer first."""
        self.session = self.resume_key = ""
        self.max_turns: int | None = None
        self.resume_timeout_s = 0.0
        self._resume_timeout_option = resume_timeout_s
        self._welcomed(self._open())

    def _welcomed(self, welcome: Welcome) -> None:
        """Take up the session a ``welcome`` to a ``hello`` for a new session names."""
        self.session, self.resume_key = welcome.session, welcome.resume_key
        self.max_turns = welcome.max_turns
        option = self._resume_timeout_option
        self.resume_timeout_s = welcome.grace_s if option is None else option

    # ------------------------------------------------------------------ requests
    def request(self, payload: dict[str, Any]) -> Any:
        """Send ``payload`` as the next request and return the hub's answer (a wire model),
        resuming the session when the link drops; a ``reset`` first settles a request given up
        on, and opens a new session when the hub no longer has this one."""
        if self.closed:
            raise RemoteError("closed", "this RemoteEnv was closed; make a new one")
        try:
            if self.unanswered is not None:
                self._settle(payload["type"])
            return self._send_next(payload)
        except SessionLostError as exc:
            if payload["type"] != "reset" or exc.code not in _GONE:
                raise
            self._reopen()
            return self._send_next(payload)

    def close(self) -> None:
        """End the session on the hub (frees its env at once). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        ws = self.ws
        if ws is None:
            return
        try:
            with contextlib.suppress(Exception):  # closing is best effort: the hub may be gone
                self.seq += 1
                ws.send(orjson.dumps({"type": "close", "seq": self.seq}).decode())
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    timeout = max(0.01, deadline - time.monotonic())
                    message = orjson.loads(ws.recv(timeout=timeout))
                    if message.get("type") == "closed" or message.get("type") == "error":
                        break
        finally:
            with contextlib.suppress(Exception):
                ws.close()
            self.ws = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from __del__
            if self.ws is None:
                return
            if sys.is_finalizing():
                # the interpreter is exiting: websockets' reader thread is frozen, so a close
                # handshake would wait forever; drop the socket (the hub ends the session)
                self.ws.socket.close()
            else:
                self.ws.close()

    def _send_next(self, payload: dict[str, Any]) -> Any:
        """Send ``payload`` with the next ``seq`` and return its answer; the hub's errors are
        raised (``reset_needed``/``episode_over`` as a local env raises them)."""
        kind = payload["type"]
        seq = payload["seq"] = self.seq + 1
        frame = dump_request(payload)
        self._check_size(frame, kind)
        self.seq = seq
        message = self._exchange(seq, frame, kind)
        if isinstance(message, ErrorMessage):
            if message.code in ("busy", "bad_seq"):
                self.seq = seq - 1  # refused unapplied: the hub did not use this seq
            if message.code == "reset_needed":
                raise ResetNeededError(f"{self.env_id} (remote): {message.message}")
            if message.code == "episode_over":
                raise EpisodeOverError(f"{self.env_id} (remote): {message.message}")
            raise RemoteError(message.code, message.message)
        if message.type not in _ANSWERS[kind]:
            raise self._off_protocol(
                f"a {kind} answered with {message.type!r}", message.model_dump_json()
            )
        return message

    def _settle(self, kind: str) -> None:
        """Await the answer to the request given up on (resent with its ``seq``: the hub
        answers it when it ends, and applies nothing twice) and drop it: its caller is gone."""
        if self.unanswered is None:
            return
        seq, frame, was = self.unanswered
        try:
            self._exchange(seq, frame, was)
        except SessionLostError:
            raise
        except RemoteError as exc:
            if exc.code == "request_timeout":
                raise RemoteError(
                    "request_timeout",
                    (
                        f"the {was} given up on earlier still has no answer from the hub at "
                        f"{self.url}: it is still running there (or the hub is stuck), and this "
                        f"{kind} waits for it, up to request_timeout_s="
                        f"{self.request_timeout_s:g} s twice; retry the {kind} later, or pass a "
                        "larger request_timeout_s for an env this slow"
                    ),
                ) from exc
            # any other answer (an unnumbered refusal): the hub is done with it
        self.unanswered = None

    def _exchange(self, seq: int, frame: str, kind: str) -> Any:
        """Send ``frame`` (request ``seq``) and return its answer, resuming the session when the
        link drops; after two silences of ``request_timeout_s`` raise ``request_timeout`` and
        remember the request as unanswered."""
        from websockets.exceptions import ConnectionClosed

        resumes = 0
        timed_out = False
        while True:
            try:
                if self.ws is None:
                    raise ConnectionError("not connected")
                self.ws.send(frame)
                return self._answer(seq)
            except TimeoutError as exc:  # (an OSError: caught first)
                if timed_out:
                    self._drop()
                    self.unanswered = (seq, frame, kind)
                    raise RemoteError(
                        "request_timeout",
                        (
                            f"the hub at {self.url} did not answer this {kind} within "
                            f"request_timeout_s={self.request_timeout_s:g} s, before and after "
                            "reconnecting: it is overloaded or stuck; if its steps take longer, "
                            "pass a larger request_timeout_s to RemoteEnv (or envhub.make)"
                        ),
                    ) from exc
                timed_out = True
                cause: BaseException = exc
            except ConnectionClosed as exc:
                self._raise_if_final(exc, kind)
                cause = exc
            except (OSError, ConnectionError) as exc:
                cause = exc
            if resumes == _MAX_RESUMES:
                self._drop()
                raise SessionLostError(
                    "connection_unstable",
                    (
                        f"the link to {self.url} dropped {resumes + 1} times while this "
                        f"{kind} waited for its answer (last: {type(cause).__name__}: "
                        f"{cause}); the hub or a proxy between cuts it, e.g. at a message size "
                        "limit"
                    ),
                ) from cause
            resumes += 1
            self._resume(cause)

    def _answer(self, seq: int) -> Any:
        """Read messages until the answer to request ``seq``; ``TimeoutError`` after
        ``request_timeout_s``."""
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            message = self._parse(self.ws.recv(timeout=max(0.0, deadline - time.monotonic())))
            if message.type == "draining":
                self.draining = True
            elif getattr(message, "seq", None) == seq:
                return message
            elif isinstance(message, ErrorMessage) and message.seq is None:
                if message.code == "idle_timeout":  # the reaper's notice, before its close
                    raise self._idle_closed()
                self.seq = seq - 1  # refused unread (e.g. too large): the hub used no seq
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

    # ------------------------------------------------------------------ connections
    def _open(self) -> Welcome:
        """A new session: a hub that cannot be reached, or is not a hub, is a
        ``RemoteError("unreachable")`` naming the URL (a resume retries such failures)."""
        from websockets.exceptions import InvalidHandshake, InvalidURI

        try:
            return self._connect({"type": "hello", "env": self.env_id}, self.connect_timeout_s)
        except (OSError, InvalidHandshake, InvalidURI) as exc:  # (TimeoutError is an OSError)
            raise RemoteError(
                "unreachable",
                (
                    f"could not open a session at {self.url} ({type(exc).__name__}: {exc}); "
                    f"the hub address is what `envhub serve` prints, ws://HOST:PORT with no "
                    f"path (got {self.hub!r}), and the hub must be running and reachable from "
                    "here"
                ),
            ) from exc

    def _reopen(self) -> None:
        """Replace a session the hub no longer has with a new one (for a ``reset``)."""
        self._drop()
        self._welcomed(self._open())
        self.seq, self.unanswered = 0, None
        self.reconnects += 1

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
            self.ws = ws
            self.hub_max_message_bytes = message.max_message_bytes
            self.idle_timeout_s = message.idle_timeout_s
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
                    fix = " (env.reset() opens one)" if exc.code in _GONE else ""
                    raise SessionLostError(
                        exc.code,
                        f"session {self.session} could not be resumed: {exc.message}{fix}",
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
        if self.ws is not None:
            _abort(self.ws)
            self.ws = None

    def _raise_if_final(self, exc: Any, kind: str) -> None:
        """Raise for a close that a resume would not mend (``exc``: ``ConnectionClosed``)."""
        rcvd, sent = exc.rcvd, exc.sent
        by_hub = rcvd is not None and (sent is None or exc.rcvd_then_sent)
        first = rcvd if by_hub else sent
        if first is not None and first.code == _MESSAGE_TOO_BIG:
            self._drop()
            if by_hub:
                self.seq -= 1  # the hub closed before reading it: the seq is unused
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
        if rcvd is not None and rcvd.code == _IDLE_CLOSE:
            raise self._idle_closed() from exc
        if rcvd is not None and rcvd.code in _FINAL_CLOSE_CODES:
            raise RemoteError(
                "closed",
                f"the hub closed the session (code {rcvd.code}: {rcvd.reason or 'no reason'})",
            ) from exc
        if rcvd is not None and rcvd.code == 1001:
            raise SessionLostError(
                "draining",
                "the hub shut down; reset() opens a new session if a hub is back at this address",
            ) from exc

    def _idle_closed(self) -> SessionLostError:
        """The error for a session the hub reaped as idle (its notice or its close frame)."""
        idle = "" if self.idle_timeout_s is None else f"={self.idle_timeout_s:g} s"
        return SessionLostError(
            "idle_timeout",
            (
                f"the hub closed session {self.session} after idle_timeout_s{idle} without "
                "a request (its --idle-timeout); call reset() to start a new episode on a new "
                "session, and serve the hub with a larger --idle-timeout if the agent takes "
                "longer than that between steps"
            ),
        )

    def _parse(self, raw: str | bytes) -> Any:
        """The hub's message ``raw`` as its wire type, or ``bad_message`` saying what is off
        (a result of the wrong types included)."""
        try:
            message = server_message.validate_json(raw)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            where = ".".join(str(part) for part in error["loc"])
            raise self._off_protocol(f"{where}: {error['msg']}" if where else error["msg"], raw)
        problem = answer_problem(message)
        if problem:
            raise self._off_protocol(problem, raw)
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


# ---------------------------------------------------------------------- what goes over the wire
def answer_problem(message: Any) -> str:
    """What is wrong with a ``reset_result``/``step_result``/``episode_failed`` answer's
    free-form object ("" if nothing, and for other answers)."""
    kind = message.type
    if kind == "step_result":
        return _step_problem(message.result)
    if kind == "reset_result":
        result = message.result
        missing = [key for key in ("observation", "info") if key not in result]
        if missing:
            return f"result lacks {', '.join(missing)}"
        info = result["info"]
        if type(info) is not dict:
            return f"result.info of type {type(info).__name__}; info must be a dict"
        if type(info.get("tools", [])) is not list:
            return f"result.info.tools of type {type(info['tools']).__name__}; it must be a list"
        return _observation_problem(result["observation"])
    if kind == "episode_failed":
        failure = message.failure
        missing = [key for key in ("reason", "detail") if key not in failure]
        if missing:
            return f"failure lacks {', '.join(missing)}"
        wrong = [key for key in ("reason", "detail") if type(failure[key]) is not str]
        if wrong or type(failure.get("turn", 0)) is not int:
            return f"failure of the wrong types ({', '.join(wrong) or 'turn'})"
    return ""


def _step_problem(result: dict[str, Any]) -> str:
    keys = ("observation", "reward", "terminated", "truncated", "info")
    missing = [key for key in keys if key not in result]
    if missing:
        return f"result lacks {', '.join(missing)}"
    reward, info = result["reward"], result["info"]
    if type(reward) not in (float, int):  # a bool is no reward; JSON has no numpy numbers
        return f"result.reward={reward!r:.40} ({type(reward).__name__}); it must be a number"
    problem = step_output_problem(reward, result["terminated"], result["truncated"], info)
    if problem:
        return f"result.{problem}"
    if type(info.get("turn", 0)) is not int:
        return f"result.info.turn={info['turn']!r:.40}; it must be an int"
    return _observation_problem(result["observation"])


def _observation_problem(observation: Any) -> str:
    problem = observation_problem(observation)
    return f"result.{problem}" if problem else ""


def dump_request(payload: dict[str, Any]) -> str:
    """``payload`` as a JSON text frame (numpy numbers and arrays as JSON); ``TypeError`` naming
    the first value JSON cannot carry and what to send instead."""
    try:
        return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY).decode()
    except TypeError as exc:
        where, value = _first_unencodable(payload, "")
        what = "reset options" if where.startswith("options") else "a request to the hub"
        raise TypeError(
            f"{where or 'the request'} is a {type(value).__name__} ({value!r:.60}): {what} "
            f"must be {_JSON_TYPES}; convert it (list(...), int(...), str(...)) before sending"
        ) from exc


def _first_unencodable(value: Any, where: str) -> tuple[str, Any]:
    """The path (``options['a'][0]``) and value of the first part of ``value`` that orjson
    refuses; ``("", value)`` when no part alone is refused."""
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{where}[{key!r}]" if where else str(key)
            found = (here, key) if not isinstance(key, str) else _first_unencodable(item, here)
            if found[0]:
                return found
        return "", value
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _first_unencodable(item, f"{where}[{i}]")
            if found[0]:
                return found
        return "", value
    try:
        orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return where, value
    return "", value


def _abort(ws: Any) -> None:
    """Close ``ws`` without a close handshake (the peer may be gone or silent)."""
    with contextlib.suppress(OSError):
        ws.socket.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        ws.close()
