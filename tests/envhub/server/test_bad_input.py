"""Bad input of every kind gets a clear error code; the hub stays up and leaks no session, worker,
fd or memory."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import json
import os
import socket
import time

import httpx
import orjson
from websockets.exceptions import ConnectionClosed

from envhub.client import RemoteEnv
from envhub.server.errors import RemoteError
from tests.envhub.server.hubtools import (
    TOKEN,
    ask,
    closed_by_server,
    raw_connect,
    running_hub,
    slow_client,
)

LIMIT = 4096
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def hub():
    with running_hub(
        envs=["test/faulty-v0"],
        workers=1,
        max_sessions=6,
        max_sessions_per_client=4,
        max_message_bytes=LIMIT,
        hello_timeout_s=0.5,
        grace_s=0.3,
        reset_wait_s=1.0,
        request_timeout_s=1.0,
    ) as running:
        yield running


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


def test_schemathesis_finds_no_server_errors_or_schema_violations(hub):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

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


# ---------------------------------------------------- issue 13: no client may take what others need
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
    ]
    for seq, fields in enumerate(bad * 2, start=1):
        reply = ask(ws, {"type": "reset", "seq": seq, **fields})
        assert episodes(hub) == 0, f"the refused reset {fields} keeps an episode slot"
        assert reply["code"] == "bad_message", reply
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


# ---------------------------------------------------------------------- more of the same kind
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
    import dataclasses

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


# -------------------------------------------- fuzz: generated messages, invariants after each burst
def fuzz_strategies():
    """(hello, frames) for one WebSocket burst, and HTTP rollout bodies: mostly the right shape,
    hostile values."""
    from hypothesis import strategies as st

    edge_ints = st.sampled_from(
        [0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 2**200]
    )
    ints = st.one_of(st.integers(), edge_ints)
    chars = st.one_of(st.characters(), st.characters(categories=["Cs"]))  # lone surrogates too
    texts = st.text(chars, max_size=30).filter(
        lambda a: a not in ("crash", "hang") and not a.startswith("sleep:")
    )
    leaves = st.one_of(
        st.none(), st.booleans(), ints, st.floats(allow_nan=False, allow_infinity=False), texts
    )
    values = st.one_of(
        st.recursive(
            leaves,
            lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=3),
            max_leaves=10,
        ),
        st.builds(Deep, st.integers(150, 600)),
    )
    objects = st.dictionaries(texts, values, max_size=3)

    def field(strategy):
        return st.one_of(strategy, values)  # the right type, or anything

    seq = st.one_of(st.just(NEXT), ints, edge_ints, values)
    reset = st.fixed_dictionaries(
        {"type": st.just("reset"), "seq": seq},
        optional={"seed": field(ints), "options": field(objects)},
    )
    step = st.fixed_dictionaries({"type": st.just("step"), "seq": seq, "action": field(texts)})
    close = st.fixed_dictionaries({"type": st.just("close"), "seq": seq})
    hellos = st.fixed_dictionaries(
        {"type": st.just("hello")},
        optional={
            "env": field(texts),
            "session": field(texts),
            "resume_key": field(texts),
            "env_kwargs": field(objects),
        },
    )
    extra = st.tuples(st.one_of(reset, step, close), texts, values).map(
        lambda t: {**t[0], t[1] or "x": t[2]}
    )
    messages = st.one_of(reset, step, step, close, hellos, extra, values)
    frames = st.lists(
        st.one_of(messages, st.binary(max_size=40), st.text(max_size=40)), min_size=1, max_size=8
    )
    first = st.one_of(st.just({"type": "hello", "env": "test/faulty-v0"}), hellos)
    bodies = st.one_of(
        st.fixed_dictionaries(
            {"env": st.one_of(st.just("test/faulty-v0"), texts)},
            optional={
                "seed": field(ints),
                "options": field(objects),
                "actions": field(st.lists(texts, max_size=3)),
            },
        ),
        values,
        st.binary(max_size=40),
    )
    return st.tuples(first, frames), bodies


NEXT = object()
"""Stands for the seq the session expects next, so generated requests also get past the seq
check."""


class Deep:
    """``nested(depth)``, expanded only when encoded (Hypothesis cannot print a 600-level dict)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __repr__(self) -> str:
        return f"nested({self.depth})"


def encode(message: object, expected: int) -> str | bytes:
    if isinstance(message, dict) and message.get("seq") is NEXT:
        message = {**message, "seq": expected}
    if isinstance(message, (str, bytes)):
        return message
    # ensure_ascii: surrogates as escapes
    return json.dumps(message, separators=(",", ":"), default=lambda deep: nested(deep.depth))


def ws_burst(hub, first: dict, frames: list) -> None:
    """One connection: a hello, then ``frames``; every answer is a valid server message, every close
    an expected one."""
    from envhub.server.wire import server_message

    ws = raw_connect(hub)
    try:
        ws.send(encode(first, 0))
        try:
            welcome = orjson.loads(ws.recv(timeout=20))
        except ConnectionClosed as exc:
            # only a hello over the frame limit closes without an answer
            assert exc.rcvd is not None and exc.rcvd.code == 1009, f"closed with {exc.rcvd}"
            return
        if welcome["type"] != "welcome":
            assert welcome["type"] == "error" and server_message.validate_python(welcome)
            assert closed_with(ws) in (1008, 1013, 4404)
            return
        expected = 1
        for frame in frames:
            try:
                ws.send(encode(frame, expected))
                reply = server_message.validate_json(ws.recv(timeout=20))
            except ConnectionClosed as exc:
                assert exc.rcvd is not None and exc.rcvd.code in (1000, 1009), (
                    f"closed with {exc.rcvd}"
                )
                return
            seq = getattr(reply, "seq", None)
            if seq == expected and getattr(reply, "code", None) not in ("bad_seq", "busy"):
                expected += 1
            if reply.type == "closed":
                assert closed_with(ws) == 1000
                return
    finally:
        ws.close()


def test_fuzzed_messages_break_no_invariant(hub):
    """Generated WebSocket bursts and HTTP bodies: after each, /health is ok and no episode is held
    by nobody; at the end nothing leaked."""
    from hypothesis import HealthCheck, given, settings

    from envhub.server.wire import ErrorMessage, RolloutResponse

    bursts, bodies = fuzz_strategies()
    quick = settings(
        max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    normal_episode(hub)
    assert settle(hub) == (0, 0, 1)
    fds, rss = open_fds(), rss_mib()

    async def held() -> tuple[int, int]:  # read on the hub's loop: both at the same instant
        return episodes(hub), len(hub.hub.sessions.sessions)

    def invariants() -> None:
        assert httpx.get(f"{hub.http}/health").json()["status"] == "ok"
        in_pool, sessions = hub.call(held)
        assert in_pool <= sessions, f"{in_pool} episodes are held by {sessions} sessions"

    @given(burst=bursts)
    @quick
    def over_websocket(burst):
        ws_burst(hub, *burst)
        invariants()

    @given(body=bodies)
    @settings(quick, max_examples=50)
    def over_http(body):
        response = rollout(hub, body if isinstance(body, bytes) else encode(body, 0))
        assert response.status_code in (200, 400, 404, 413, 422, 429, 503), response.text
        model = RolloutResponse if response.status_code == 200 else ErrorMessage
        model.model_validate_json(response.content)
        invariants()

    over_websocket()
    over_http()
    assert settle(hub) == (0, 0, 1), "sessions, episodes and workers are back where they started"
    normal_episode(hub)
    deadline = time.monotonic() + 10
    while open_fds() > fds + 2:  # bounded poll: closed sockets are released asynchronously
        assert time.monotonic() < deadline, f"fds grew from {fds} to {open_fds()}"
        time.sleep(0.05)
    assert rss_mib() < rss + 40, f"RSS grew from {rss:.0f} MiB to {rss_mib():.0f} MiB"


def normal_episode(hub) -> None:
    env = RemoteEnv("test/faulty-v0", hub.url, token=TOKEN)
    env.reset(seed=0)
    assert env.step("ok")[0][0]["content"] == "echo ok"
    env.close()
