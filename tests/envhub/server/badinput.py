"""What the bad-input tests send to the hub and read back: the limits of the hub they attack,
WebSocket answers and closes, HTTP rollouts, and the state that must return to baseline."""

from __future__ import annotations

import json
import os
import time

import httpx
import orjson
from websockets.exceptions import ConnectionClosed

from tests.envhub.server.hubtools import TOKEN, ask

LIMIT = 4096
"""``max_message_bytes`` of the ``hub`` fixture (conftest.py)."""

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def bad_input_hub(**overrides: object):
    """A running hub (context manager) of test/faulty-v0 on one worker, with small limits and
    short timeouts to run into; ``overrides`` change settings."""
    from tests.envhub.server.hubtools import running_hub

    settings: dict[str, object] = {
        "envs": ["test/faulty-v0"],
        "workers": 1,
        "max_sessions": 6,
        "max_sessions_per_client": 4,
        "max_message_bytes": LIMIT,
        "hello_timeout_s": 0.5,
        "grace_s": 0.3,
        "reset_wait_s": 1.0,
        "request_timeout_s": 1.0,
    }
    return running_hub(**{**settings, **overrides})


def hello(ws, env="test/faulty-v0"):
    reply = ask(ws, {"type": "hello", "env": env})
    assert reply["type"] == "welcome", reply
    return reply


def closed_with(ws) -> int:
    """Read until the hub closes the socket; return the close code."""
    try:
        while True:
            ws.recv(timeout=5)
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd else 1006


def refused(ws, message=None) -> tuple[str, int]:
    """The error code the hub answered with and the close code it then used."""
    reply = ask(ws, message) if message is not None else orjson.loads(ws.recv(timeout=5))
    assert reply["type"] == "error"
    assert reply["message"]
    return reply["code"], closed_with(ws)


def settle(hub) -> tuple[int, int, int]:
    """(sessions, pool episodes, workers alive) once dropped sessions are reaped."""
    pool = hub.hub.pools["test/faulty-v0"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = (len(hub.hub.sessions.sessions), pool.stats().episodes, pool.stats().workers_alive)
        if state == (0, 0, 1):
            break
        time.sleep(0.05)
    return state


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def episodes(hub) -> int:
    return hub.hub.pools["test/faulty-v0"].stats().episodes


def rollout(hub, body: object | str) -> httpx.Response:
    """POST /v1/rollout; a ``str`` body is sent as is (e.g. with a lone surrogate escape)."""
    # json: ints past 64 bits too
    content = body if isinstance(body, (str, bytes)) else json.dumps(body, separators=(",", ":"))
    return httpx.post(
        f"{hub.http}/v1/rollout",
        headers={**AUTH, "Content-Type": "application/json"},
        content=content,
    )
