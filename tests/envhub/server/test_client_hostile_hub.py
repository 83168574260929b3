"""``RemoteEnv`` against hubs that misbehave: every call ends, with an error that says why.

A message over a size limit, a hub that stops answering, a resume that never completes, a link
that drops on every resend, and replies that are not the protocol: each raises a ``RemoteError``
naming the cause and the fix, instead of hanging, resending forever or leaking a ``KeyError``.
Most tests play the hub with ``FakeHub`` (a scripted websockets server in a thread); the size
limits are checked against a real hub.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import inspect
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from envhub.client import RemoteEnv
from envhub.server.errors import RemoteError, SessionLostError
from envhub.server.wire import Welcome
from tests.envhub.server.hubtools import TOKEN, running_hub

Handler = Callable[[Any, dict[str, Any]], None]


class FakeHub:
    """A scripted hub: ``handler(ws, hello)`` plays the hub's part once a connection's hello
    has arrived. ``stall_handshakes_after`` connections complete their WebSocket handshake;
    later ones hang in it (a hub that accepts TCP but never answers the upgrade).

    ``hellos`` lists every hello received; ``released`` is set at teardown, so handlers that
    "never answer" wait on it and the server can shut down.
    """

    def __init__(self, handler: Handler, stall_handshakes_after: int | None = None) -> None:
        from websockets.sync.server import serve

        self.handler = handler
        self.hellos: list[dict[str, Any]] = []
        self.handshakes = 0
        self.stall_handshakes_after = stall_handshakes_after
        self.released = threading.Event()
        self.server = serve(
            self._serve, "127.0.0.1", 0, max_size=None, process_request=self._handshake
        )
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}"

    def _handshake(self, connection: Any, request: Any) -> None:
        self.handshakes += 1
        if (
            self.stall_handshakes_after is not None
            and self.handshakes > self.stall_handshakes_after
        ):
            self.released.wait()

    def _serve(self, ws: Any) -> None:
        hello = json.loads(ws.recv())
        self.hellos.append(hello)
        self.handler(ws, hello)

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()


def welcome(ws: Any, **fields: Any) -> None:
    """Send the welcome a real hub sends (``fields`` override its values)."""
    message = Welcome(
        session="s1",
        resume_key="k",
        env="e",
        last_seq=0,
        resumed=False,
        grace_s=3.0,
        idle_timeout_s=600,
        max_message_bytes=1 << 20,
        max_turns=10,
    ).model_dump()
    message.update(fields)
    ws.send(json.dumps(message))


@pytest.fixture
def fake_hub() -> Iterator[Callable[..., FakeHub]]:
    started: list[FakeHub] = []

    def start(handler: Handler, **kwargs: Any) -> FakeHub:
        started.append(FakeHub(handler, **kwargs))
        return started[-1]

    yield start
    for hub in started:
        hub.close()


def drop_link(ws: Any) -> None:
    """Cut the connection without a close frame (a dead proxy or NAT)."""
    ws.socket.shutdown(socket.SHUT_RDWR)


# ---------------------------------------------------------------------- size limits
@pytest.mark.timeout(60)
def test_a_reply_over_the_clients_limit_raises_naming_max_message_bytes():
    """The hub's answer is bigger than the client takes: the step raises (it is not resent
    forever) and says which setting to raise; the session goes on."""
    with running_hub(envs=["test/faulty-v0"], backend="inline", grace_s=5) as hub:
        env = RemoteEnv("test/faulty-v0", hub.url, token=TOKEN, max_message_bytes=4096)
        env.reset(seed=0)
        with pytest.raises(RemoteError) as raised:
            env.step("x" * 6000)  # faulty-v0 echoes it: the answer is over 4096 bytes
        assert raised.value.code == "message_too_large"
        assert "max_message_bytes=4096" in raised.value.message
        assert "RemoteEnv(" in raised.value.message, "the message says where to raise it"
        assert env.reconnects == 0, "a reply that cannot fit must not be asked for again"
        assert env.step("ok")[0][0]["content"] == "echo ok"
        env.close()


@pytest.mark.timeout(60)
def test_an_action_over_the_hubs_limit_is_refused_before_it_is_sent():
    """An action past the size the hub's welcome states is refused here; one the hub's frame
    limit refuses anyway (1009) is not resent. Either way the error names the hub's limit and
    the session goes on."""
    with running_hub(
        envs=["test/faulty-v0"], backend="inline", grace_s=5, max_message_bytes=4096
    ) as hub:
        env = RemoteEnv("test/faulty-v0", hub.url, token=TOKEN)
        env.reset(seed=0)
        for action in (
            "x" * 6000,  # over the hub's check
            "x" * 30_000,  # over its frame limit too
            "\U0001f600" * 2040,  # 2,040 characters, 8,160 bytes: the hub counts bytes
        ):
            with pytest.raises(RemoteError) as raised:
                env.step(action)
            assert raised.value.code == "message_too_large"
            assert "max_message_bytes" in raised.value.message
            assert "4096" in raised.value.message
            assert "stated in its welcome" in raised.value.message, "refused before sending"
        assert env.reconnects == 0
        assert env.step("ok")[4]["turn"] == 1, "the refused actions were never applied"
        env.close()


@pytest.mark.timeout(30)
def test_a_hub_that_closes_with_message_too_big_is_not_asked_again(fake_hub):
    """A 1009 close from the hub (its frame limit, which its welcome may understate) ends the
    request with an error naming the hub's max_message_bytes, not a resume and a resend."""

    def handler(ws, hello):
        welcome(ws)
        for _ in ws:
            ws.close(1009, "frame too big")

    hub = fake_hub(handler)
    env = RemoteEnv("e", hub.url)
    with pytest.raises(RemoteError) as raised:
        env.step("x" * 1000)
    assert raised.value.code == "message_too_large"
    assert "max_message_bytes" in raised.value.message and "hub" in raised.value.message
    assert len(hub.hellos) == 1, "the request was resent"


@pytest.mark.timeout(30)
def test_a_link_that_drops_at_every_resend_ends_in_an_error(fake_hub):
    """The hub (or a proxy) cuts the link each time the request arrives: the client resumes and
    resends a bounded number of times, then raises."""

    def handler(ws, hello):
        welcome(ws, resumed="session" in hello)
        ws.recv()
        drop_link(ws)

    hub = fake_hub(handler)
    env = RemoteEnv("e", hub.url, resume_timeout_s=30)
    with pytest.raises(SessionLostError) as raised:
        env.reset(seed=0)
    assert raised.value.code == "connection_unstable"
    assert hub.url in raised.value.message
    assert 2 <= len(hub.hellos) <= 10, len(hub.hellos)


@pytest.mark.timeout(30)
def test_a_request_the_hub_refuses_unread_does_not_use_up_its_seq(fake_hub):
    """The hub answers a request it could not read (too large, malformed) with an unnumbered
    error and applies nothing; the next request must carry the seq it expects, or the hub
    refuses it as ``bad_seq``."""
    step = {"observation": [], "reward": 0.0, "terminated": False, "truncated": False, "info": {}}

    def handler(ws, hello):
        welcome(ws)
        last_seq = 0
        for raw in ws:
            request = json.loads(raw)
            if request["action"] == "too big":
                ws.send(json.dumps({"type": "error", "code": "message_too_large", "message": "m"}))
            elif request["seq"] != last_seq + 1:
                refusal = {
                    "type": "error",
                    "code": "bad_seq",
                    "message": "m",
                    "seq": request["seq"],
                }
                ws.send(json.dumps(refusal))
            else:
                last_seq = request["seq"]
                ws.send(json.dumps({"type": "step_result", "seq": last_seq, "result": step}))

    env = RemoteEnv("e", fake_hub(handler).url)
    with pytest.raises(RemoteError, match="message_too_large"):
        env.step("too big")
    assert env.step("fine")[1] == 0.0


# ---------------------------------------------------------------------- a silent hub
@pytest.mark.timeout(30)
def test_a_hub_that_never_answers_times_out_after_one_resume(fake_hub):
    """Connected, pings answered, requests never answered: the request is resent once on a new
    connection, then raises ``request_timeout`` naming the option."""

    def handler(ws, hello):
        welcome(ws, resumed="session" in hello)
        for _ in ws:  # read every request, answer none
            pass

    hub = fake_hub(handler)
    env = RemoteEnv("e", hub.url, request_timeout_s=0.5)
    with pytest.raises(RemoteError) as raised:
        env.reset(seed=0)
    assert raised.value.code == "request_timeout"
    assert "request_timeout_s" in raised.value.message and hub.url in raised.value.message
    assert len(hub.hellos) == 2, "one resume, then the error"
    assert env.reconnects == 1


def test_request_timeout_s_defaults_above_the_hubs_own_limits():
    """The default waits longer than a hub at its defaults takes to answer or fail a request."""
    from envhub.server.config import HubConfig

    default = inspect.signature(RemoteEnv).parameters["request_timeout_s"].default
    hub_defaults = {name: field.default for name, field in HubConfig.model_fields.items()}
    assert default > hub_defaults["reset_wait_s"] + hub_defaults["step_timeout_s"]


# ---------------------------------------------------------------------- resume deadline
@pytest.mark.timeout(20)
@pytest.mark.parametrize("stall", ["welcome", "handshake"])
def test_resume_gives_up_at_resume_timeout_s(fake_hub, stall):
    """The link drops and the hub takes the reconnect but never welcomes it (or never finishes
    its handshake): the client gives up at ``resume_timeout_s`` (1 s), not after a whole
    ``connect_timeout_s`` (30 s) per attempt, and says it timed out."""

    def handler(ws, hello):
        if "session" in hello:  # a resume: accepted, never answered
            hub.released.wait()
            return
        welcome(ws)
        ws.recv()
        drop_link(ws)

    hub = fake_hub(handler, stall_handshakes_after=1 if stall == "handshake" else None)
    env = RemoteEnv("e", hub.url, resume_timeout_s=1.0)
    with pytest.raises(SessionLostError) as raised:
        env.step("a")
    assert raised.value.code == "resume_timeout"
    assert "resume_timeout_s" in raised.value.message


# ---------------------------------------------------------------------- replies off the protocol
GARBAGE = {
    "not JSON": lambda seq: "<html>502 Bad Gateway</html>",
    "a JSON list": lambda seq: "[1, 2]",
    "an unknown type": lambda seq: json.dumps({"type": "surprise", "seq": seq}),
    "no result": lambda seq: json.dumps({"type": "reset_result", "seq": seq, "episode": 1}),
    "a result without its observation": lambda seq: json.dumps(
        {"type": "reset_result", "seq": seq, "episode": 1, "result": {"info": {}}}
    ),
    "an error without a code": lambda seq: json.dumps({"type": "error", "seq": seq, "msg": "x"}),
    "an unnumbered error without a message": lambda seq: json.dumps({"type": "error", "code": "x"}),
    "episode_failed without its failure": lambda seq: json.dumps(
        {"type": "episode_failed", "seq": seq}
    ),
    "an answer to another request": lambda seq: json.dumps({"type": "closed", "seq": seq}),
    "an observation that is a string": lambda seq: json.dumps(
        {
            "type": "reset_result",
            "seq": seq,
            "episode": 1,
            "result": {"observation": "hi", "info": {}},
        }
    ),
    "info that is a list": lambda seq: json.dumps(
        {
            "type": "reset_result",
            "seq": seq,
            "episode": 1,
            "result": {"observation": [], "info": []},
        }
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(GARBAGE))
def test_a_reply_off_the_protocol_raises_bad_message_naming_the_hub(fake_hub, case):
    def handler(ws, hello):
        welcome(ws)
        for raw in ws:
            ws.send(GARBAGE[case](json.loads(raw)["seq"]))

    hub = fake_hub(handler)
    env = RemoteEnv("e", hub.url)
    with pytest.raises(RemoteError) as raised:
        env.reset(seed=0)
    assert raised.value.code == "bad_message"
    assert hub.url in raised.value.message
    assert "version" in raised.value.message, "the message names the likely cause"


OPENING = [{"role": "user", "content": "hi"}]
GOOD_STEP = {"observation": OPENING, "reward": 0.0, "terminated": False, "truncated": False}
WRONGLY_TYPED_STEPS = {
    "reward as a string": ({"reward": "1.0"}, "reward"),
    "reward null": ({"reward": None}, "reward"),
    "reward true": ({"reward": True}, "reward"),
    "terminated as the string 'false'": ({"terminated": "false"}, "terminated"),
    "truncated as 0": ({"truncated": 0}, "truncated"),
    "observation as a string": ({"observation": "hello"}, "observation"),
    "a message without a role": ({"observation": [{"content": "x"}]}, "observation[0]"),
    "info as a list": ({"info": []}, "info"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(WRONGLY_TYPED_STEPS))
def test_a_step_result_of_the_wrong_types_raises_bad_message_naming_the_field(fake_hub, case):
    """The right keys with the wrong types (a hub of another version, a proxy): ``bad_message``
    naming the field, never a str reward, a truthy ``'false'`` or a bare AttributeError."""
    fields, named = WRONGLY_TYPED_STEPS[case]

    def handler(ws, hello):
        welcome(ws)
        for raw in ws:
            request = json.loads(raw)
            if request["type"] == "reset":
                result = {"observation": OPENING, "info": {}}
                ws.send(
                    json.dumps(
                        {
                            "type": "reset_result",
                            "seq": request["seq"],
                            "episode": 1,
                            "result": result,
                        }
                    )
                )
            else:
                result = {**GOOD_STEP, "info": {"turn": 1}, **fields}
                ws.send(
                    json.dumps({"type": "step_result", "seq": request["seq"], "result": result})
                )

    env = RemoteEnv("e", fake_hub(handler).url)
    env.reset(seed=0)
    with pytest.raises(RemoteError) as raised:
        env.step("x")
    assert raised.value.code == "bad_message"
    assert named in raised.value.message and "version" in raised.value.message
    assert env.messages == OPENING, "nothing of the refused step reached the transcript"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "reply",
    [
        json.dumps({"type": "welcome", "resume_key": "k"}),
        "<html>502 Bad Gateway</html>",
        json.dumps(["welcome"]),
    ],
    ids=["no session", "not JSON", "a JSON list"],
)
def test_a_bad_welcome_raises_bad_message_and_closes_the_socket(fake_hub, reply):
    closed = threading.Event()

    def handler(ws, hello):
        ws.send(reply)
        for _ in ws:
            pass
        closed.set()  # the client closed its end

    hub = fake_hub(handler)
    with pytest.raises(RemoteError) as raised:
        RemoteEnv("e", hub.url)
    assert raised.value.code == "bad_message"
    assert hub.url in raised.value.message
    assert closed.wait(10), "the socket of a RemoteEnv that failed to start is left open"


@pytest.mark.timeout(60)
def test_a_wrong_hub_address_is_an_error_naming_the_url_and_the_fix():
    """Nothing listening, a path appended to the hub's address (the hub refuses the upgrade
    with HTTP 403, which read like a wrong token): ``RemoteError("unreachable")`` naming the URL
    and what the address should be, never a bare websockets or socket exception."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        nothing = f"ws://127.0.0.1:{free.getsockname()[1]}"
    with pytest.raises(RemoteError) as raised:
        RemoteEnv("test/faulty-v0", nothing, connect_timeout_s=5)
    assert raised.value.code == "unreachable" and nothing in raised.value.message
    with running_hub(envs=["test/faulty-v0"], backend="inline") as hub:
        wrong = hub.url + "/v1"
        with pytest.raises(RemoteError) as raised:
            RemoteEnv("test/faulty-v0", wrong, token=TOKEN, connect_timeout_s=5)
        assert raised.value.code == "unreachable" and f"{wrong}/v1/session" in raised.value.message
        assert "envhub serve" in raised.value.message and "403" in raised.value.message
