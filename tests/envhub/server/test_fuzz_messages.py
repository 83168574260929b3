"""Generated input: schemathesis against the OpenAPI schema, and hypothesis WebSocket bursts and
HTTP rollout bodies; after each one the hub is healthy, and at the end nothing leaked."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import json
import time

import httpx
import orjson
from websockets.exceptions import ConnectionClosed

from envhub.client import RemoteEnv
from tests.envhub.server.badinput import (
    bad_input_hub,
    closed_with,
    episodes,
    nested,
    open_fds,
    rollout,
    rss_mib,
    settle,
)
from tests.envhub.server.hubtools import TOKEN, raw_connect


@pytest.fixture(scope="module")
def hub():
    """The bad-input hub (``conftest.py``) with 10 s for a hello instead of 0.5 s: a burst's
    hello reaches the hub after hypothesis and the hub's own thread have shared this process, and
    on a loaded machine that took longer than 0.5 s once (the hub rightly closed with 1008)."""
    with bad_input_hub(hello_timeout_s=10.0) as running:
        yield running


# ---------------------------------------------------------------------- schemathesis: the HTTP API
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


# ---------------------------------------------- hypothesis: generated WebSocket bursts, HTTP bodies
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


# ---------------------------------------------------------------------- the step fast path
def test_the_step_fast_path_reads_exactly_what_the_full_validation_reads():
    """``ws._plain_step`` skips pydantic for plain text steps; whatever it accepts, the wire
    model must accept as the same request (and what it declines still gets validated)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from envhub.server.wire import StepRequest, client_message
    from envhub.server.ws import _plain_step

    values = st.one_of(
        st.integers(min_value=-(2**64), max_value=2**64),
        st.text(max_size=8),
        st.booleans(),
        st.none(),
        st.floats(allow_nan=False),
        st.lists(st.integers(), max_size=2),
        st.just("step"),
    )
    keys = st.sampled_from(["type", "seq", "action", "seed", "options"])

    @settings(max_examples=400, deadline=None)
    @given(st.dictionaries(keys, values, max_size=4), st.booleans())
    def check(fields, as_step):
        if as_step:
            fields = {"type": "step", **fields}
        raw = json.dumps(fields)  # (orjson cannot write integers past 64 bits)
        fast = _plain_step(raw)
        if fast is None:
            return
        request = client_message.validate_json(raw)
        assert isinstance(request, StepRequest)
        assert (request.seq, request.action) == fast

    check()
    assert _plain_step(b'{"type":"step","seq":3,"action":"go"}') == (3, "go")
    assert _plain_step(b'{"type":"step","seq":0,"action":"go"}') is None  # refused in full
