"""Dropped sockets mid-episode: the client resumes its session; no step is lost or applied twice."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import threading
import time

from envhub.client import RemoteEnv
from envhub.server.errors import SessionLostError
from tests.envhub.server.hubtools import TOKEN, DropProxy, running_hub


@pytest.fixture(scope="module")
def hub():
    with running_hub(envs=["test/faulty-v0"], workers=1, grace_s=5.0) as running:
        yield running


@pytest.fixture
def proxy(hub):
    p = DropProxy(hub.port)
    yield p
    p.close()


def applied_turns(hub) -> int:
    """How many steps the hub applied in total (the worker's env counts them)."""
    return hub.hub.pools["test/faulty-v0"].stats().steps


def test_request_lost_on_the_way_up_is_applied_once_after_resume(hub, proxy):
    env = RemoteEnv("test/faulty-v0", proxy.url, token=TOKEN)
    env.reset(seed=0)
    assert env.step("one")[4]["turn"] == 1
    before = applied_turns(hub)
    proxy.eat("up")  # the next step never reaches the hub; the link dies
    obs, _reward, _terminated, _truncated, info = env.step("two")
    assert info["turn"] == 2 and obs[0]["content"] == "echo two"
    assert applied_turns(hub) == before + 1
    assert env.reconnects == 1 and proxy.connections == 2
    assert env.step("three")[4]["turn"] == 3
    env.close()


def test_answer_lost_on_the_way_down_is_not_applied_twice(hub, proxy):
    env = RemoteEnv("test/faulty-v0", proxy.url, token=TOKEN)
    env.reset(seed=0)
    env.step("one")
    before = applied_turns(hub)
    proxy.eat("down")  # the hub applies the step, its answer is lost with the link
    obs, _, _, _, info = env.step("two")
    assert info["turn"] == 2 and obs[0]["content"] == "echo two"
    assert applied_turns(hub) == before + 1, "the resent request must be answered from the record"
    assert env.reconnects == 1
    env.close()


def test_link_killed_while_a_slow_step_runs(hub, proxy):
    env = RemoteEnv("test/faulty-v0", proxy.url, token=TOKEN)
    env.reset(seed=0)
    env.step("one")
    before = applied_turns(hub)
    threading.Timer(0.2, proxy.cut).start()  # mid-step: the env sleeps 0.8 s
    obs, _, _, _, info = env.step("sleep:0.8")
    assert info["turn"] == 2 and obs[0]["content"] == "echo sleep:0.8"
    assert applied_turns(hub) == before + 1
    assert env.step("three")[4]["turn"] == 3
    assert len(hub.hub.sessions.sessions) == 1, "the resume reused the session"
    env.close()


def test_a_session_not_resumed_within_the_grace_period_is_gone(hub, proxy):
    env = RemoteEnv("test/faulty-v0", proxy.url, token=TOKEN, resume_timeout_s=1.0)
    env.reset(seed=0)
    session = env.session
    proxy.close()  # the hub stays up, but this client can never reach it again
    with pytest.raises(SessionLostError, match="could not resume"):
        env.step("x")
    deadline = time.monotonic() + 15
    while session in hub.hub.sessions.sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session not in hub.hub.sessions.sessions, "the reaper closes it after grace_s"
    assert hub.hub.pools["test/faulty-v0"].stats().episodes == 0
