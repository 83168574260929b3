"""The OpenEnv adapter against servers that misbehave: they die, close sessions, refuse,
answer garbage, never answer, or trickle their schema. Each error names the server and the
cause, and the env's next reset works once the server does."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("openenv", reason="needs the openenv extra: pip install 'envhub[openenv]'")

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocketDisconnect

import envhub
from envhub.errors import SourceConnectionError, SourceError
from tests.envhub.openai_servers import serve_app

SCHEMA = {
    "action": {
        "type": "object",
        "properties": {"message": {"type": "string"}},
        "required": ["message"],
    },
    "observation": {},
    "state": {},
}
ANSWER = {
    "type": "observation",
    "data": {"observation": {"text": "hi"}, "reward": None, "done": False},
}
GARBAGE = {  # a step answer the server sends, as raw text
    "not json": "<html>502 Bad Gateway</html>",
    "a list": "[1, 2]",
    "a NaN reward": '{"type":"observation","data":{"observation":{},"reward":NaN,"done":false}}',
    "a string done": '{"type":"observation","data":{"observation":{},"reward":0,"done":"false"}}',
}


class Hostile:
    """A scripted OpenEnv server: ``step`` says how it answers a step, ``refuse`` how many
    sessions it refuses (as envhub's hub does at capacity: an error, then it closes)."""

    def __init__(self) -> None:
        self.step = "ok"
        self.refuse = 0
        self.open_sessions = 0
        self.changed = threading.Condition()
        self.app = Starlette(
            routes=[Route("/schema", self._schema), WebSocketRoute("/ws", self._session)]
        )

    async def _schema(self, request):
        return JSONResponse(SCHEMA)

    async def _session(self, websocket) -> None:
        await websocket.accept()
        self._count(+1)
        try:
            with contextlib.suppress(WebSocketDisconnect):  # the client went away
                await self._serve(websocket)
        finally:
            self._count(-1)

    async def _serve(self, websocket) -> None:
        if self.refuse:
            self.refuse -= 1
            await websocket.receive_text()
            error = {"message": "the hub is full", "code": "CAPACITY_REACHED"}
            await websocket.send_text(json.dumps({"type": "error", "data": error}))
            await websocket.close(1013)
            return
        while True:
            message = json.loads(await websocket.receive_text())
            if message["type"] == "close":
                await websocket.close()
                return
            if message["type"] == "reset":
                await websocket.send_text(json.dumps(ANSWER))
            elif self.step == "die":
                await websocket.close(1011)
                return
            elif self.step in GARBAGE:
                await websocket.send_text(GARBAGE[self.step])
            elif self.step == "one episode per session":  # the hub reaping an idle session
                done = {**ANSWER["data"], "reward": 1.0, "done": True}
                await websocket.send_text(json.dumps({**ANSWER, "data": done}))
                await websocket.close(4408, "no message for 1 s; the session was closed")
                return
            elif self.step == "ok":
                await websocket.send_text(json.dumps(ANSWER))
            # "silent": never answers

    def _count(self, change: int) -> None:
        with self.changed:
            self.open_sessions += change
            self.changed.notify_all()

    def wait_sessions(self, count: int) -> int:
        with self.changed:
            self.changed.wait_for(lambda: self.open_sessions == count, timeout=20)
            return self.open_sessions


@pytest.fixture
def hostile() -> Iterator[tuple[Hostile, str]]:
    server = Hostile()
    with serve_app(server.app) as url:
        yield server, url


@pytest.mark.timeout(60)
def test_a_server_that_dies_mid_step_is_named_and_the_next_reset_reconnects(hostile):
    server, url = hostile
    env = envhub.make("openenv/remote-v0", base_url=url, message_timeout_s=10)
    env.reset(seed=0)
    server.step = "die"
    with pytest.raises(SourceConnectionError, match=rf"{url}.*closed the connection.*1011"):
        env.step("x")
    with pytest.raises(SourceConnectionError, match=r"lost.*call env\.reset\(\)"):
        env.step("x")
    server.step = "ok"
    for seed in (1, 2):
        assert env.reset(seed=seed)[0] == [{"role": "user", "content": "hi"}]
        assert env.step("x")[0] == [{"role": "user", "content": "hi"}]
    env.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("garbage", sorted(GARBAGE))
def test_an_answer_that_is_not_an_openenv_answer_is_named(hostile, garbage):
    server, url = hostile
    env = envhub.make("openenv/remote-v0", base_url=url, message_timeout_s=10)
    env.reset(seed=0)
    server.step = garbage
    with pytest.raises(SourceConnectionError, match=rf"{url} answered a step with .*OpenEnv"):
        env.step("x")
    server.step = "ok"
    env.reset(seed=1)
    assert env.step("x")[1] == 0.0
    env.close()


@pytest.mark.timeout(60)
def test_a_session_the_server_closed_between_episodes_is_reopened_at_reset(hostile):
    """envhub's hub reaps a session idle past its idle_timeout_s (the trainer was busy
    between episodes): the next reset opens a new session instead of failing for ever."""
    server, url = hostile
    server.step = "one episode per session"
    env = envhub.make("openenv/remote-v0", base_url=url, message_timeout_s=10)
    for seed in range(3):
        env.reset(seed=seed)
        _, reward, terminated, _, _ = env.step("x")
        assert (reward, terminated) == (1.0, True)
    env.close()


@pytest.mark.timeout(60)
def test_a_refusal_that_closes_the_session_leaves_the_next_reset_working(hostile):
    server, url = hostile
    server.refuse = 1
    env = envhub.make("openenv/remote-v0", base_url=url, message_timeout_s=10)
    with pytest.raises(SourceError, match=rf"{url}.*the hub is full"):
        env.reset(seed=0)
    for seed in (1, 2):
        assert env.reset(seed=seed)[0] == [{"role": "user", "content": "hi"}]
    env.close()


@pytest.mark.timeout(90)
def test_a_step_timeout_closes_the_session_and_names_the_setting(hostile):
    server, url = hostile
    server.step = "silent"
    env = envhub.make("openenv/remote-v0", base_url=url, message_timeout_s=0.5)
    loops = lambda: sum(t.name == "openenv-sync-client-loop" for t in threading.enumerate())
    before = loops()
    for seed in range(3):
        env.reset(seed=seed)
        with pytest.raises(SourceConnectionError, match=rf"{url}.*message_timeout_s=0\.5"):
            env.step("x")
        assert loops() == before  # the timed-out client's thread is gone
    assert server.wait_sessions(0) == 0  # and the server saw each session close
    env.close()


@contextmanager
def raw_http(body_bytes: int, pace_s: float) -> Iterator[str]:
    """A server that answers any request 200 with a ``body_bytes`` body of spaces, sent in
    chunks of 64 KiB, or one byte every ``pace_s`` seconds when ``pace_s`` is positive."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {body_bytes}\r\n\r\n"
            connection.sendall(head.encode())
            sent = 0
            try:
                while sent < body_bytes and not stop.is_set():
                    chunk = b" " if pace_s else b" " * min(65536, body_bytes - sent)
                    connection.sendall(chunk)
                    sent += len(chunk)
                    if pace_s:
                        stop.wait(pace_s)
            except OSError:  # the client hung up
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(10)


@pytest.mark.timeout(30)
def test_a_trickling_schema_answer_is_cut_off_at_connect_timeout_s():
    with raw_http(100_000, pace_s=0.2) as url:
        env = envhub.make("openenv/remote-v0", base_url=url, connect_timeout_s=1)
        with pytest.raises(
            SourceConnectionError, match=rf"{url}.*GET /schema.*connect_timeout_s=1"
        ):
            env.reset(seed=0)


@pytest.mark.timeout(60)
def test_an_oversized_schema_answer_is_refused():
    with raw_http(64 * 2**20, pace_s=0) as url:
        env = envhub.make("openenv/remote-v0", base_url=url)
        with pytest.raises(SourceConnectionError, match=rf"{url}.*GET /schema.*more than 4 MiB"):
            env.reset(seed=0)
