"""Bad input of every kind gets a clear error code; the hub stays up and leaks no session, worker, fd or memory."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[server]')")

import os
import socket
import time

import httpx
import orjson
from websockets.exceptions import ConnectionClosed

from envhub.client import RemoteEnv
from envhub.server.errors import RemoteError
from tests.envhub.server.hubtools import TOKEN, ask, raw_connect, running_hub

LIMIT = 4096


@pytest.fixture(scope="module")
def hub():
    with running_hub(
        envs=["test/faulty-v0"], workers=1, max_sessions=6, max_sessions_per_client=4, max_message_bytes=LIMIT, hello_timeout_s=0.5, grace_s=0.3
    ) as running:
        yield running


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


# ---------------------------------------------------------------------- one check per bad input
def check_wrong_or_missing_token(hub):
    for token in ("wrong-token-999", None):
        ws = raw_connect(hub, token=token)
        code, close = refused(ws)
        assert (code, close) == ("unauthorized", 1008)


def check_bad_hello(hub):
    assert refused(raw_connect(hub), {"type": "step", "seq": 1, "action": "x"}) == ("hello_required", 1008)
    assert refused(raw_connect(hub), "{not json") == ("hello_required", 1008)
    assert refused(raw_connect(hub), {"type": "hello", "env": "games/nope-v0"}) == ("unknown_env", 1008)
    assert refused(raw_connect(hub), {"type": "hello", "env": "test/faulty-v0", "env_kwargs": {"x": 1}}) == ("env_kwargs_refused", 1008)
    assert refused(raw_connect(hub), {"type": "hello", "session": "nope", "resume_key": "nope"}) == ("unknown_session", 4404)


def check_slow_client_gets_a_hello_timeout(hub):
    ws = raw_connect(hub)
    reply = orjson.loads(ws.recv(timeout=5))  # say nothing
    assert reply["code"] == "hello_timeout" and "within 0.5 s" in reply["message"]
    assert closed_with(ws) == 1008


def check_bad_messages_keep_the_session(hub):
    ws = raw_connect(hub)
    hello(ws)
    assert ask(ws, "{oops")["code"] == "bad_json"
    assert ask(ws, b"\xff\xfe binary garbage")["code"] == "bad_json"
    assert ask(ws, {"type": "teleport", "seq": 1})["code"] == "bad_message"
    extra = ask(ws, {"type": "step", "seq": 1, "action": "x", "sneaky": True})
    assert extra["code"] == "bad_message" and "sneaky" in extra["message"]
    assert ask(ws, {"type": "step", "seq": 1, "action": 5})["code"] == "bad_message"
    assert ask(ws, {"type": "hello", "env": "test/faulty-v0"})["code"] == "bad_message"
    big = ask(ws, {"type": "step", "seq": 1, "action": "x" * (LIMIT + 10)})
    assert big["code"] == "message_too_large" and str(LIMIT) in big["message"]
    step_first = ask(ws, {"type": "step", "seq": 1, "action": "x"})
    assert step_first["code"] == "reset_needed" and "reset" in step_first["message"]
    assert ask(ws, {"type": "reset", "seq": 2, "seed": 0})["type"] == "reset_result"
    assert ask(ws, {"type": "step", "seq": 9, "action": "x"})["code"] == "bad_seq"
    assert ask(ws, {"type": "step", "seq": 3, "action": "win"})["result"]["terminated"] is True
    after = ask(ws, {"type": "step", "seq": 4, "action": "x"})
    assert after["code"] == "episode_over" and "after the episode ended" in after["message"]
    assert ask(ws, {"type": "step", "seq": 4, "action": "x"}) == after, "a repeated seq gets the same answer"
    assert ask(ws, {"type": "close", "seq": 5})["type"] == "closed"
    assert closed_with(ws) == 1000


def check_oversized_frame_closes_with_1009(hub):
    ws = raw_connect(hub)
    hello(ws)
    ws.send("x" * (3 * LIMIT))
    assert closed_with(ws) == 1009


def check_connection_flood_is_refused_beyond_the_limits(hub):
    settle(hub)  # sessions dropped by earlier checks count until grace_s ends
    held = []
    for _ in range(4):
        ws = raw_connect(hub)
        hello(ws)
        held.append(ws)
    code, close = refused(raw_connect(hub), {"type": "hello", "env": "test/faulty-v0"})
    assert (code, close) == ("too_many_sessions", 1013)
    for ws in held:
        ws.close()


def check_crashed_worker_is_an_episode_failure(hub):
    env = RemoteEnv("test/faulty-v0", hub.url, token=TOKEN)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("crash")
    assert truncated and info["episode_failed"] and info["failure"]["reason"] == "worker_crashed"
    deadline = time.monotonic() + 20
    while True:  # the replacement worker is starting; reset succeeds once it is up
        try:
            env.reset(seed=1)
            break
        except RemoteError as exc:
            assert time.monotonic() < deadline, exc
    assert env.step("ok")[0][0]["content"] == "echo ok"
    env.close()


CHECKS = [
    check_wrong_or_missing_token,
    check_bad_hello,
    check_slow_client_gets_a_hello_timeout,
    check_bad_messages_keep_the_session,
    check_oversized_frame_closes_with_1009,
    check_connection_flood_is_refused_beyond_the_limits,
    check_crashed_worker_is_an_episode_failure,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_bad_input(hub, check):
    check(hub)


# ---------------------------------------------------------------------- leaks
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


def test_bad_input_leaks_no_session_worker_fd_or_memory(hub):
    for check in CHECKS:  # warm up caches and lazy imports
        check(hub)
    assert settle(hub) == (0, 0, 1)
    fds, rss = open_fds(), rss_mib()
    for _ in range(2):
        for check in CHECKS:
            check(hub)
    assert settle(hub) == (0, 0, 1), "sessions, episodes and workers are back where they started"
    time.sleep(0.3)
    assert open_fds() <= fds + 2, f"fds grew from {fds} to {open_fds()}"
    assert rss_mib() < rss + 25, f"RSS grew from {rss:.0f} MiB to {rss_mib():.0f} MiB"
    assert httpx.get(f"{hub.http}/health").json()["status"] == "ok"


# ---------------------------------------------------------------------- HTTP
def test_http_auth_size_limit_metrics_and_rollout(hub):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{hub.http}/health").status_code == 200
    for path in ("/metrics", "/v1/envs", "/v1/protocol"):
        denied = httpx.get(f"{hub.http}{path}")
        assert denied.status_code == 401 and denied.json()["code"] == "unauthorized"
        assert httpx.get(f"{hub.http}{path}", headers={"Authorization": "Bearer nope-nope-nope"}).status_code == 401
    envs = httpx.get(f"{hub.http}/v1/envs", headers=auth).json()["envs"]
    assert [e["id"] for e in envs] == ["test/faulty-v0"]
    done = httpx.post(f"{hub.http}/v1/rollout", headers=auth, json={"env": "test/faulty-v0", "seed": 1, "actions": ["a", "win", "late"]}).json()
    assert [s["observation"][0]["content"] for s in done["steps"]] == ["echo a", "won"]
    assert done["error"]["code"] == "episode_over"
    assert httpx.post(f"{hub.http}/v1/rollout", headers=auth, json={"env": "x/y-v0"}).json()["code"] == "unknown_env"
    assert httpx.post(f"{hub.http}/v1/rollout", headers=auth, json={"env": "test/faulty-v0", "extra": 1}).status_code == 422
    big = httpx.post(f"{hub.http}/v1/rollout", headers=auth, content=b"x" * (LIMIT + 1))
    assert big.status_code == 413 and big.json()["code"] == "message_too_large"
    metrics = httpx.get(f"{hub.http}/metrics", headers=auth).text
    for name in ("envhub_sessions{", "envhub_steps_total{", "envhub_step_latency_seconds_bucket{", "envhub_worker_restarts_total{", "envhub_steps_per_second", "envhub_errors_total{"):
        assert name in metrics, name


def test_schemathesis_finds_no_server_errors_or_schema_violations(hub):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, settings

    from hypothesis import given

    schema = schemathesis.openapi.from_url(f"{hub.http}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/health", "/metrics", "/v1/envs", "/v1/rollout"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"})

        check()


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
