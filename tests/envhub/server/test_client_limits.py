"""No client may take what others need (issue 13): a refused request holds no episode slot,
episodes are capped per client, and idle, unfinished or unauthenticated connections are closed."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import contextlib
import select
import socket
import time

import httpx
import orjson

from envhub.client import RemoteEnv
from tests.envhub.server.badinput import (
    closed_with,
    episodes,
    hello,
    nested,
    refused,
    rollout,
    settle,
)
from tests.envhub.server.hubtools import (
    TOKEN,
    ask,
    closed_by_server,
    raw_connect,
    running_hub,
    slow_client,
)


@pytest.fixture(scope="module")
def tight():
    """A hub one client can fill: 2 episode slots, 2 sessions per client, few unauthenticated
    connections."""
    with running_hub(
        envs=["test/faulty-v0"],
        backend="inline",
        max_sessions=2,
        max_sessions_per_client=2,
        reset_wait_s=0.3,
        grace_s=0.3,
        request_timeout_s=60,
        max_unauthenticated=8,
    ) as running:
        yield running


# ---------------------------------------------------------------------- reaping
def test_idle_sessions_are_reaped():
    with running_hub(envs=["test/faulty-v0"], idle_timeout_s=0.5, grace_s=0.2) as idle_hub:
        ws = raw_connect(idle_hub)
        hello(ws)
        ask(ws, {"type": "reset", "seq": 1, "seed": 0})
        reply = orjson.loads(ws.recv(timeout=10))
        assert reply["code"] == "idle_timeout"
        assert closed_with(ws) == 4408
        assert settle(idle_hub) == (0, 0, 1)
        dropped = raw_connect(idle_hub)
        hello(dropped)
        dropped.socket.shutdown(socket.SHUT_RDWR)  # vanish without a close frame
        assert settle(idle_hub) == (0, 0, 1), "a dropped session is closed after grace_s"


def test_a_client_that_stops_reading_is_dropped_not_kept_forever():
    """A client that stops reading its replies: once what the hub has to send it stays
    unsent for ``stall_timeout_s``, the connection is dropped (a graceful close would wait for
    the client to read, holding the socket and its send buffer for good)."""
    import base64
    import os
    import struct

    def frame(message: dict) -> bytes:  # a masked client text frame
        data, mask = orjson.dumps(message), os.urandom(4)
        head = struct.pack("!BBQ", 0x81, 0x80 | 127, len(data))
        return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))

    with running_hub(envs=["test/faulty-v0"], stall_timeout_s=1.0, grace_s=0.2) as hub:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (set before connecting)
        sock.connect(("127.0.0.1", hub.port))
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(
            f"GET /v1/session HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        replies = b""
        for message, wanted in (
            ({"type": "hello", "env": "test/faulty-v0"}, b"welcome"),
            ({"type": "reset", "seq": 1, "seed": 0}, b"reset_result"),
        ):
            if message["type"] == "hello":
                while b"\r\n\r\n" not in replies:  # the upgrade's answer first
                    replies += sock.recv(4096)
            sock.sendall(frame(message))
            while wanted not in replies:  # (read while the client still reads)
                replies += sock.recv(4096)
        sock.sendall(frame({"type": "step", "seq": 2, "action": "x" * 200_000}))
        select.select([sock], [], [], 30)  # its answer is coming (left unread): the step ran
        sock.settimeout(5)
        with contextlib.suppress(OSError):  # repeats, answered again each: megabytes to send
            for _ in range(100):
                sock.sendall(frame({"type": "step", "seq": 2, "action": "x"}))
        # never read: wait (bounded) for the hub to reset the connection; the unread replies
        # do not wake this poll (no POLLIN asked), a reset does (POLLHUP / POLLERR)
        poller = select.poll()
        poller.register(sock, select.POLLRDHUP)
        events = poller.poll(60_000)
        assert events and events[0][1] & (select.POLLHUP | select.POLLERR), (
            "the hub kept a client that stopped reading"
        )
        sock.close()
        assert settle(hub) == (0, 0, 1)


# ---------------------------------------------------------------------- episode slots
def test_rejected_resets_release_their_episode_slot(hub):
    """A reset refused as bad input holds no slot; a session holds one episode however often it
    resets."""
    assert settle(hub) == (0, 0, 1)
    ws = raw_connect(hub)
    hello(ws)
    bad = [
        {"seed": 2**64},
        {"seed": 2**200},
        {"seed": -1},
        {"options": {"n": 2**64}},
        {"options": {"n": -(2**64)}},
        {"seed": True},  # not an integer, whatever Python thinks
        {"options": {"x": float("nan")}},  # JSON has no NaN: it would reach the env as null
        {"options": {"deep": [{"y": float("-inf")}]}},
    ]
    for seq, fields in enumerate(bad * 2, start=1):
        reply = ask(ws, {"type": "reset", "seq": seq, **fields})
        assert episodes(hub) == 0, f"the refused reset {fields} keeps an episode slot"
        assert reply["code"] in ("bad_message", "bad_json"), reply  # NaN: not even JSON
        assert ("seed" in fields) == ("seed" in reply["message"]) and ("options" in fields) == (
            "options" in reply["message"]
        ), reply
    for seq in range(1, 21):  # refused messages used no seq
        assert ask(ws, {"type": "reset", "seq": seq, "seed": seq})["type"] == "reset_result"
    assert episodes(hub) == 1, "a session holds one episode, however often it resets"
    assert ask(ws, {"type": "close", "seq": 21})["type"] == "closed"
    for body in [
        {"env": "test/faulty-v0", "seed": 2**64},
        {"env": "test/faulty-v0", "options": nested(300)},
        # json.loads takes it; the worker could not encode it
        {"env": "test/faulty-v0", "options": nested(600)},
        {"env": "test/faulty-v0", "options": {"n": 2**70}},
        '{"env": "test/faulty-v0", "options": {"s": "\\ud800"}}',
    ] * 2:
        refusal = rollout(hub, body)
        assert episodes(hub) == 0, f"the refused rollout {body!s:.80} keeps an episode slot"
        assert refusal.status_code == 422 and refusal.json()["code"] == "bad_message", refusal.text
        assert "seed" in refusal.json()["message"] or "options" in refusal.json()["message"], (
            refusal.text
        )
    assert (
        rollout(hub, {"env": "test/faulty-v0", "seed": 3, "actions": ["a"]}).json()["steps"][0][
            "observation"
        ][0]["content"]
        == "echo a"
    )
    assert settle(hub) == (0, 0, 1)


def test_episodes_are_capped_per_client_and_a_full_pool_is_degraded(tight):
    """One client's sessions and rollouts together stay within its limit; /health says when the pool
    is full."""
    assert httpx.get(f"{tight.http}/health").json()["status"] == "ok"
    held = []
    for seed in range(2):
        ws = raw_connect(tight)
        hello(ws)
        assert ask(ws, {"type": "reset", "seq": 1, "seed": seed})["type"] == "reset_result"
        held.append(ws)
    refused_rollout = rollout(tight, {"env": "test/faulty-v0", "seed": 1, "actions": ["a"]})
    assert refused_rollout.status_code == 429, refused_rollout.text
    assert (
        refused_rollout.json()["code"] == "too_many_sessions"
        and "2" in refused_rollout.json()["message"]
    )
    health = httpx.get(f"{tight.http}/health").json()
    assert health["status"] == "degraded", health
    assert any(
        "test/faulty-v0" in problem and "2 episode slots" in problem
        for problem in health["problems"]
    ), health
    ask(held.pop(), {"type": "close", "seq": 2})
    assert rollout(tight, {"env": "test/faulty-v0", "seed": 1, "actions": ["a"]}).status_code == 200
    assert httpx.get(f"{tight.http}/health").json()["status"] == "ok"
    ask(held.pop(), {"type": "close", "seq": 2})


def test_one_client_is_one_client_however_it_spells_its_token():
    """The per-client limit counts the token a connection carries, not how its header spells
    it: other spacing, or HTTP Basic with any user name, is the same client."""
    import base64

    from websockets.sync.client import connect

    basic = [base64.b64encode(f"{user}:{TOKEN}".encode()).decode() for user in ("a", "b", "")]
    spellings = [
        f"Bearer {TOKEN}",
        f"Bearer  {TOKEN}",
        *(f"Basic {credential}" for credential in basic),
    ]
    with running_hub(envs=["test/faulty-v0"], max_sessions=8, max_sessions_per_client=2) as hub:
        answers, held = [], []
        for header in spellings:
            ws = connect(
                f"{hub.url}/v1/session", additional_headers={"Authorization": header},
                compression=None, open_timeout=10,
            ).__enter__()  # fmt: skip
            held.append(ws)
            reply = ask(ws, {"type": "hello", "env": "test/faulty-v0"})
            answers.append(reply.get("code", reply["type"]))
        for ws in held:
            ws.close()
    assert answers == ["welcome", "welcome", *["too_many_sessions"] * 3], answers


# ---------------------------------------------------------------------- connections
def test_connections_that_never_finish_their_request_are_closed(hub):
    """Silent sockets, half-sent heads, short bodies and half-sent upgrades are closed after
    request_timeout_s."""
    slow = [
        slow_client(hub.port),
        slow_client(hub.port, b"GET /health HTTP/1.1\r\nHost: hub\r\n"),
        slow_client(
            hub.port,
            b"POST /v1/rollout HTTP/1.1\r\nHost: hub\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b'\r\nContent-Length: 100\r\n\r\n{"env":',
        ),
        slow_client(
            hub.port,
            (
                b"GET /v1/session HTTP/1.1\r\nHost: hub\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\n"
            ),
        ),
    ]
    huge_head = slow_client(
        hub.port, b"GET /health HTTP/1.1\r\nHost: hub\r\nX-Padding: " + b"a" * (256 * 1024)
    )
    try:
        for sock in slow:
            assert closed_by_server(sock, within=20) is not None, (
                "the hub still holds a connection that never finished its request"
            )
        answer = closed_by_server(huge_head, within=20)
        assert answer is not None and answer.startswith(b"HTTP/1.1 431"), answer
        assert httpx.get(f"{hub.http}/health").json()["status"] == "ok"
    finally:
        for sock in [*slow, huge_head]:
            sock.close()


def test_unauthenticated_connections_are_capped(tight):
    """Past max_unauthenticated, the oldest connection that has not shown a token is closed; clients
    with one get through."""
    silent = [slow_client(tight.port) for _ in range(30)]
    try:
        deadline = time.monotonic() + 20
        # bounded poll for the state change
        while sum(closed_by_server(sock, within=0.01) is not None for sock in silent) < 22:
            assert time.monotonic() < deadline, (
                "more than max_unauthenticated=8 silent connections are still held"
            )
        env = RemoteEnv("test/faulty-v0", tight.url, token=TOKEN)
        env.reset(seed=0)
        assert env.step("ok")[0][0]["content"] == "echo ok"
        env.close()
        assert httpx.get(f"{tight.http}/health").json()["status"] == "ok"
    finally:
        for sock in silent:
            sock.close()


def test_a_burst_of_clients_with_the_token_is_answered_not_cut_off(tight):
    """Clients that connect together (a trainer opening its sessions at once) outnumber
    max_unauthenticated before the hub has read a byte from them: each still gets its request
    answered (here the WebSocket upgrade, then a session or too_many_sessions), none is closed
    unread as if it were a flood of silent sockets."""
    burst = [slow_client(tight.port) for _ in range(20)]  # max_unauthenticated is 8
    upgrade = (
        "GET /v1/session HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    ).encode()
    try:
        for sock in burst:
            sock.sendall(upgrade)
        for sock in burst:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                assert chunk, f"the hub closed a client with the token unanswered: {head!r}"
                head += chunk
            assert head.startswith(b"HTTP/1.1 101"), head
    finally:
        for sock in burst:
            sock.close()


def test_a_client_cannot_hold_more_silent_connections_than_sessions(tight):
    """Authenticated sockets that never say hello count against the client's limit while they
    wait."""
    quiet = [raw_connect(tight) for _ in range(2)]
    assert refused(raw_connect(tight), None) == ("too_many_sessions", 1013)
    for ws in quiet:  # the waiting ones are still served
        hello(ws)
        assert ask(ws, {"type": "close", "seq": 1})["type"] == "closed"
    env = RemoteEnv("test/faulty-v0", tight.url, token=TOKEN)
    env.reset(seed=0)
    env.close()
