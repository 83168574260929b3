"""Bad input of every kind gets a clear error code; the hub stays up and leaks no session, worker,
fd or memory.

What a client may hold (episode slots, connections) is in test_client_limits.py; generated input
in test_fuzz_messages.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import dataclasses
import time

import httpx
import orjson

from envhub.client import RemoteEnv
from envhub.server.errors import RemoteError
from tests.envhub.server.badinput import (
    AUTH,
    LIMIT,
    closed_with,
    hello,
    open_fds,
    refused,
    rollout,
    rss_mib,
    settle,
)
from tests.envhub.server.hubtools import TOKEN, ask, raw_connect


# ---------------------------------------------------------------------- one check per bad input
def check_wrong_or_missing_token(hub):
    for token in ("wrong-token-999", None):
        ws = raw_connect(hub, token=token)
        code, close = refused(ws)
        assert (code, close) == ("unauthorized", 1008)


def check_bad_hello(hub):
    assert refused(raw_connect(hub), {"type": "step", "seq": 1, "action": "x"}) == (
        "hello_required",
        1008,
    )
    assert refused(raw_connect(hub), "{not json") == ("hello_required", 1008)
    assert refused(raw_connect(hub), {"type": "hello", "env": "games/nope-v0"}) == (
        "unknown_env",
        1008,
    )
    assert refused(
        raw_connect(hub), {"type": "hello", "env": "test/faulty-v0", "env_kwargs": {"x": 1}}
    ) == ("env_kwargs_refused", 1008)
    assert refused(
        raw_connect(hub), {"type": "hello", "session": "nope", "resume_key": "nope"}
    ) == ("unknown_session", 4404)


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
    assert ask(ws, {"type": "step", "seq": 4, "action": "x"}) == after, (
        "a repeated seq gets the same answer"
    )
    assert ask(ws, {"type": "close", "seq": 5})["type"] == "closed"
    assert closed_with(ws) == 1000


def check_oversized_frame_closes_with_1009(hub):
    ws = raw_connect(hub)
    hello(ws)
    ws.send("x" * (3 * LIMIT))
    assert closed_with(ws) == 1009


def check_text_of_invalid_utf8_closes_with_1007_and_logs_no_traceback(hub):
    """A client may send any bytes: the hub closes with 1007 and logs one line, not a
    traceback per hostile frame (a log to flood)."""
    import logging

    from websockets.frames import Frame, Opcode

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        ws = raw_connect(hub)
        hello(ws)
        ws.protocol.send_frame(Frame(Opcode.TEXT, b'{"type": "step", "action": "\xff"}'))
        with ws.protocol_mutex:
            ws.send_data()
        assert closed_with(ws) == 1007
        settle(hub)
    finally:
        logger.removeHandler(handler)
    assert [r.exc_info for r in records if r.exc_info] == []
    assert any("UTF-8" in r.getMessage() for r in records), [r.getMessage() for r in records]


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
    _obs, _reward, _terminated, truncated, info = env.step("crash")
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
    check_text_of_invalid_utf8_closes_with_1007_and_logs_no_traceback,
    check_connection_flood_is_refused_beyond_the_limits,
    check_crashed_worker_is_an_episode_failure,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_bad_input(hub, check):
    check(hub)


# ---------------------------------------------------------------------- leaks
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


# ------------------------------------------------------------------ hostile fields, handler bugs
def test_hostile_fields_get_an_error_with_a_code(hub):
    """Integers past 64 bits, non-ASCII secrets and lone surrogates are refused with a code; the
    session lives on."""
    ws = raw_connect(hub)
    welcome = hello(ws)
    assert ask(ws, {"type": "reset", "seq": 1, "seed": 0})["type"] == "reset_result"
    for message in (
        {"type": "step", "seq": 2**64, "action": "x"},
        {"type": "step", "seq": -(2**70), "action": "x"},
        {"type": "close", "seq": 2**100},
        {"type": "reset", "seq": 2**64},
    ):
        reply = ask(ws, message)
        assert reply["code"] == "bad_message" and "seq" in reply["message"], reply
    assert (
        ask(ws, {"type": "step", "seq": 2, "action": "x"})["result"]["observation"][0]["content"]
        == "echo x"
    )
    for key in ("ключ", "\u00e9" * 30, "🔑"):
        assert refused(
            raw_connect(hub), {"type": "hello", "session": welcome["session"], "resume_key": key}
        ) == ("unknown_session", 4404)
    assert ask(ws, {"type": "step", "seq": 3, "action": "y"})["type"] == "step_result", (
        "the session is still attached"
    )
    assert ask(ws, {"type": "close", "seq": 4})["type"] == "closed"
    for body in (
        '{"env": "test/faulty-v0", "actions": ["\\ud800"]}',
        '{"env": "test/faulty-v0", "actions": ["ok", "\\udfff tail"]}',
        '{"env": "\\ud800"}',
    ):
        refusal = rollout(hub, body)
        assert refusal.status_code == 422 and refusal.json()["code"] == "bad_message", refusal.text
    assert settle(hub) == (0, 0, 1)


def test_reset_recovers_when_the_pool_no_longer_has_the_sessions_episode(hub):
    """A session whose episode the pool dropped (a failed re-placement) starts a new one on reset
    instead of failing forever."""
    ws = raw_connect(hub)
    hello(ws)
    assert ask(ws, {"type": "reset", "seq": 1, "seed": 0})["type"] == "reset_result"
    session = next(iter(hub.hub.sessions.sessions.values()))
    hub.call(lambda: hub.hub.pools["test/faulty-v0"].close_episode(session.episode))
    assert ask(ws, {"type": "step", "seq": 2, "action": "x"})["code"] == "reset_needed"
    assert ask(ws, {"type": "reset", "seq": 3, "seed": 0})["type"] == "reset_result"
    assert ask(ws, {"type": "step", "seq": 4, "action": "x"})["type"] == "step_result"
    assert ask(ws, {"type": "close", "seq": 5})["type"] == "closed"
    assert settle(hub) == (0, 0, 1)


def test_a_failing_hello_handler_answers_internal_and_keeps_no_session(hub):
    """A bug while welcoming (here: a spec whose max_turns is not a number) is an error with a code,
    not a leaked session."""
    spec = hub.hub.specs["test/faulty-v0"]
    hub.hub.specs["test/faulty-v0"] = dataclasses.replace(
        spec, kwargs={**spec.kwargs, "max_turns": "many"}
    )
    try:
        assert refused(raw_connect(hub), {"type": "hello", "env": "test/faulty-v0"}) == (
            "internal",
            1011,
        )
    finally:
        hub.hub.specs["test/faulty-v0"] = spec
    assert settle(hub) == (0, 0, 1), "the refused session was closed"


# ---------------------------------------------------------------------- HTTP
def test_http_auth_size_limit_metrics_and_rollout(hub):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{hub.http}/health").status_code == 200
    for path in ("/metrics", "/v1/envs", "/v1/protocol"):
        denied = httpx.get(f"{hub.http}{path}")
        assert denied.status_code == 401 and denied.json()["code"] == "unauthorized"
        assert (
            httpx.get(
                f"{hub.http}{path}", headers={"Authorization": "Bearer nope-nope-nope"}
            ).status_code
            == 401
        )
    envs = httpx.get(f"{hub.http}/v1/envs", headers=auth).json()["envs"]
    assert [e["id"] for e in envs] == ["test/faulty-v0"]
    done = httpx.post(
        f"{hub.http}/v1/rollout",
        headers=auth,
        json={"env": "test/faulty-v0", "seed": 1, "actions": ["a", "win", "late"]},
    ).json()
    assert [s["observation"][0]["content"] for s in done["steps"]] == ["echo a", "won"]
    assert done["error"]["code"] == "episode_over"
    assert (
        httpx.post(f"{hub.http}/v1/rollout", headers=auth, json={"env": "x/y-v0"}).json()["code"]
        == "unknown_env"
    )
    assert (
        httpx.post(
            f"{hub.http}/v1/rollout", headers=auth, json={"env": "test/faulty-v0", "extra": 1}
        ).status_code
        == 422
    )
    big = httpx.post(f"{hub.http}/v1/rollout", headers=auth, content=b"x" * (LIMIT + 1))
    assert big.status_code == 413 and big.json()["code"] == "message_too_large"
    metrics = httpx.get(f"{hub.http}/metrics", headers=auth).text
    for name in (
        "envhub_sessions{",
        "envhub_steps_total{",
        "envhub_step_latency_seconds_bucket{",
        "envhub_worker_restarts_total{",
        "envhub_steps_per_second",
        "envhub_errors_total{",
    ):
        assert name in metrics, name


def test_every_http_failure_is_an_error_message_with_a_code(hub):
    """Unknown routes, unparsable bodies, invalid bodies and handler crashes all answer an
    ErrorMessage with a code."""
    cases = [
        (httpx.get(f"{hub.http}/nope", headers=AUTH), 404, "not_found"),
        (httpx.delete(f"{hub.http}/v1/rollout", headers=AUTH), 405, "bad_message"),
        (rollout(hub, "{not json"), 400, "bad_json"),
        (rollout(hub, "[]"), 422, "bad_message"),
        (rollout(hub, {"env": "test/faulty-v0", "extra": 1}), 422, "bad_message"),
    ]
    for response, status, code in cases:
        assert (response.status_code, response.json()["code"]) == (status, code), response.text
        assert response.json()["message"]
    pool = hub.hub.pools["test/faulty-v0"]

    async def broken_step(episode, action):
        raise RuntimeError("a bug in the hub")

    pool.step_json = broken_step  # an instance attribute shadows the method
    try:
        crashed = rollout(hub, {"env": "test/faulty-v0", "seed": 1, "actions": ["a"]})
    finally:
        del pool.step_json
    assert (
        crashed.status_code == 500
        and crashed.json()["code"] == "internal"
        and "a bug in the hub" in crashed.json()["message"]
    ), crashed.text
    assert settle(hub) == (0, 0, 1), "the crashed rollout released its episode"
