"""Edges of the hub's OpenEnv endpoint that a raw WebSocket client reaches: a request that
outlasts the idle timeout (answered, not reaped; idleness counts from the answer), and the
message size limit counted in UTF-8 bytes (on the v1 endpoint too, which shares the limit).

OpenEnv's own client plays the endpoint in test_openenv_protocol.py; this file needs no
openenv-core.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import asyncio

import orjson

from envhub.server.sessions import SessionManager
from tests.envhub.server.badinput import hello
from tests.envhub.server.hubtools import TOKEN, raw_connect, running_hub
from tests.envhub.server.hubtools import ask as ask_v1

ENV = "test/faulty-v0"
LIMIT = 1024


def openenv_socket(hub):
    from websockets.sync.client import connect

    url = f"ws://envhub:{TOKEN}@127.0.0.1:{hub.port}/openenv/{ENV}/ws"
    return connect(url, open_timeout=10, max_size=None).__enter__()


def ask(ws, message, timeout: float = 30) -> dict:
    ws.send(message if isinstance(message, str) else orjson.dumps(message).decode())
    return orjson.loads(ws.recv(timeout=timeout))


@pytest.mark.timeout(60)
def test_an_openenv_step_longer_than_the_idle_timeout_is_answered_not_reaped():
    with (
        running_hub(envs=[ENV], idle_timeout_s=1, step_timeout_s=30) as hub,
        openenv_socket(hub) as ws,
    ):
        assert ask(ws, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
        step = ask(ws, {"type": "step", "data": {"message": "sleep:3"}})
        assert step["type"] == "observation", step
        assert ask(ws, {"type": "state"})["data"]["step_count"] == 1


@pytest.mark.timeout(60)
def test_an_openenv_reset_longer_than_the_idle_timeout_is_answered_not_reaped():
    # one worker: the OpenEnv reset waits behind a v1 session's slow step
    with running_hub(envs=[ENV], idle_timeout_s=1, step_timeout_s=30) as hub:
        v1 = raw_connect(hub)
        try:
            hello(v1, ENV)
            assert ask_v1(v1, {"type": "reset", "seq": 1})["type"] == "reset_result"
            v1.send(orjson.dumps({"type": "step", "seq": 2, "action": "sleep:3"}).decode())
            with openenv_socket(hub) as ws:
                reset = ask(ws, {"type": "reset"})
                assert reset["type"] == "observation", reset
            assert orjson.loads(v1.recv(timeout=30))["type"] == "step_result"
        finally:
            v1.close()


class Socket:
    def __init__(self) -> None:
        self.kicked: list[int] = []

    def kick(self, code: int, reply: str) -> None:
        self.kicked.append(code)

    def notify(self, reply: str) -> None:
        pass


@pytest.mark.timeout(30)
def test_a_session_is_idle_from_its_last_answer_not_from_the_request_before_it():
    async def main():
        sessions = SessionManager(
            max_sessions=2, max_sessions_per_client=2, idle_timeout_s=60, grace_s=60
        )
        session = sessions.open("e", "a", None)
        sessions.attach(session, Socket())

        async def two_minutes_long():
            session.last_active -= 120  # the request arrived two minutes ago
            return "answer"

        assert await session.execute(1, two_minutes_long) == "answer"
        assert await sessions.reap() == 0
        assert session.id in sessions.sessions and not session.conn.kicked

    asyncio.run(main())


@pytest.fixture(scope="module")
def small_hub():
    with running_hub(envs=[ENV], max_message_bytes=LIMIT) as hub:
        yield hub


@pytest.mark.timeout(60)
def test_the_openenv_size_limit_counts_utf8_bytes_not_characters(small_hub):
    wide = orjson.dumps({"type": "step", "data": {"message": "\u20ac" * 400}}).decode()
    assert len(wide) < LIMIT < len(wide.encode())  # 3 bytes a character
    with openenv_socket(small_hub) as ws:
        assert ask(ws, {"type": "reset"})["type"] == "observation"
        refused = ask(ws, wide)
        assert refused["type"] == "error" and refused["data"]["code"] == "VALIDATION_ERROR"
        assert f"{len(wide.encode())} bytes" in refused["data"]["message"]
        narrow = ask(ws, {"type": "step", "data": {"message": "x" * 900}})
        assert narrow["type"] == "observation", narrow


@pytest.mark.timeout(60)
def test_the_v1_size_limit_counts_utf8_bytes_not_characters(small_hub):
    wide = orjson.dumps({"type": "step", "seq": 1, "action": "\u20ac" * 400}).decode()
    assert len(wide) < LIMIT < len(wide.encode())
    ws = raw_connect(small_hub)
    try:
        hello(ws, ENV)
        refused = ask_v1(ws, wide)
        assert refused["code"] == "message_too_large"
        assert f"{len(wide.encode())} bytes" in refused["message"]
        assert ask_v1(ws, {"type": "step", "seq": 1, "action": "x" * 900})["code"] == (
            "reset_needed"
        )
    finally:
        ws.close()
