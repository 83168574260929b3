"""``RemoteEnv`` after something went wrong: the next call works, or says what to do.

A request that timed out, a session the hub reaped as idle, an episode that failed on the hub
and a hub that restarted: each test plays the user's next move (``reset()``, ``step()``) on a
real hub and pins what the user gets.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

from envhub.client import RemoteEnv
from envhub.errors import EpisodeOverError, ResetNeededError
from envhub.server.errors import RemoteError, SessionLostError
from tests.envhub.server.hubtools import TOKEN, ask, raw_connect, running_hub


@pytest.mark.timeout(90)
def test_after_a_request_timeout_reset_waits_for_the_slow_request_and_then_works():
    """A step runs longer than ``request_timeout_s``: it raises ``request_timeout``; a step on
    that episode is refused with the fix; ``reset()`` waits for the slow step (or times out
    naming it) and, once it has ended, works: never ``busy``, never ``bad_seq``."""
    with running_hub(envs=["test/faulty-v0"], step_timeout_s=30) as hub:
        env = RemoteEnv("test/faulty-v0", hub.url, token=TOKEN, request_timeout_s=0.3)
        env.reset(seed=0)
        with pytest.raises(RemoteError) as slow:
            env.step("sleep:2")  # the hub takes 2 s; the client gives up after 2 x 0.3 s
        assert slow.value.code == "request_timeout"
        with pytest.raises(ResetNeededError, match=r"request_timeout_s.*call reset\(\)"):
            env.step("next")
        refusals = []
        for _ in range(30):  # each try waits at most 2 x request_timeout_s for the slow step
            try:
                observation, info = env.reset(seed=1)
                break
            except RemoteError as exc:
                refusals.append(exc)
        else:
            pytest.fail(f"reset never worked after the slow step ended: {refusals[-3:]}")
        assert {exc.code for exc in refusals} <= {"request_timeout"}, refusals
        assert all("step" in exc.message for exc in refusals), "the wait names the slow step"
        assert info["turn"] == 0 and observation
        assert env.step("hello")[4]["turn"] == 1, "the session goes on in step"
        env.close()


@pytest.mark.timeout(60)
def test_a_session_reaped_as_idle_names_the_setting_and_reset_opens_a_new_one():
    """The agent thinks longer than the hub's ``idle_timeout_s`` between two steps: the step
    fails naming ``idle_timeout_s`` and ``--idle-timeout``; ``reset()`` then starts over on a
    new session."""
    with running_hub(envs=["test/faulty-v0"], idle_timeout_s=0.5) as hub:
        env = RemoteEnv("test/faulty-v0", hub.url, token=TOKEN)
        env.reset(seed=0)
        first = env.session
        hub.call(_wait_until_no_sessions(hub), timeout=30)  # the reaper closed it
        with pytest.raises(RemoteError) as idle:
            env.step("hello")
        assert idle.value.code == "idle_timeout", idle.value
        assert "idle_timeout_s=0.5" in idle.value.message
        assert "--idle-timeout" in idle.value.message and "reset()" in idle.value.message
        env.reset(seed=1)
        assert env.session != first
        assert env.step("hello")[4]["turn"] == 1
        env.close()


@pytest.mark.timeout(60)
def test_the_idle_close_frame_itself_names_the_setting():
    """A client that sends before it reads (so never sees the hub's ``idle_timeout`` message)
    still learns why from the close frame's reason."""
    from websockets.exceptions import ConnectionClosed

    with running_hub(envs=["test/faulty-v0"], idle_timeout_s=0.5) as hub:
        ws = raw_connect(hub)
        assert ask(ws, {"type": "hello", "env": "test/faulty-v0"})["type"] == "welcome"
        hub.call(_wait_until_no_sessions(hub), timeout=30)
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=10)
        assert closed.value.rcvd.code == 4408
        assert "--idle-timeout" in closed.value.rcvd.reason
        assert "idle_timeout_s=0.5" in closed.value.rcvd.reason


def _wait_until_no_sessions(hub):
    async def wait():
        import asyncio

        while hub.hub.sessions.sessions:
            await asyncio.sleep(0.05)

    return wait


@pytest.mark.timeout(60)
def test_a_step_after_a_failed_episode_raises_episode_over_like_a_local_env():
    """The hub's worker crashed mid-episode: that step returns the failure as data; the next
    step raises ``EpisodeOverError`` (as a local env and a normally ended remote one do) instead
    of returning the failure again."""
    with running_hub(envs=["test/faulty-v0"]) as hub:
        env = RemoteEnv("test/faulty-v0", hub.url, token=TOKEN)
        env.reset(seed=0)
        env.step("a")
        observation, reward, terminated, truncated, info = env.step("crash")
        assert (observation, reward, terminated, truncated) == ([], 0.0, False, True)
        assert info["episode_failed"] and env.done
        transcript = env.messages
        with pytest.raises(EpisodeOverError, match=r"after the episode ended.*reset\(\)"):
            env.step("again")
        assert env.messages == transcript, "a refused step adds nothing to the transcript"
        env.reset(seed=1)
        assert env.step("b")[4]["turn"] == 1
        env.close()


@pytest.mark.timeout(120)
def test_after_a_hub_restart_reset_opens_a_new_session():
    """The hub restarts on the same address between two calls: ``step()`` cannot go on (its
    episode is gone) and says the hub may have restarted, not only that the session expired;
    ``reset()`` opens a new session and plays on."""
    with running_hub(envs=["test/faulty-v0"]) as first_hub:
        port = first_hub.port
        env = RemoteEnv("test/faulty-v0", first_hub.url, token=TOKEN, resume_timeout_s=20)
        env.reset(seed=0)
        env.step("a")
        old_session = env.session
    with running_hub(port=port, envs=["test/faulty-v0"]):
        with pytest.raises(SessionLostError) as lost:
            env.step("b")
        assert lost.value.code == "unknown_session"
        assert "restarted" in lost.value.message and "reset()" in lost.value.message
        observation, info = env.reset(seed=1)
        assert observation and info["turn"] == 0
        assert env.session != old_session
        assert env.step("c")[4]["turn"] == 1
        env.reset(seed=2)  # and again, on the new session
        env.close()


def test_the_hubs_idle_notice_read_before_its_close_frame_says_what_to_do():
    """The reaper sends an ``idle_timeout`` message, then closes: a client that reads the
    message first (a race with the close frame) gets the same advice as from the close."""
    from envhub.client_session import HubSession
    from envhub.server.sessions import error_reply

    notice = error_reply("idle_timeout", "no request for idle_timeout_s=0.5 s; closed")

    class Socket:
        def recv(self, timeout: float) -> str:
            return notice

    session = object.__new__(HubSession)  # as a session reaped between two steps
    session.ws, session.session, session.idle_timeout_s = Socket(), "s1", 0.5
    session.request_timeout_s, session.draining, session.seq = 5.0, False, 3
    with pytest.raises(SessionLostError) as idle:
        session._answer(4)
    assert idle.value.code == "idle_timeout"
    assert "idle_timeout_s=0.5" in idle.value.message
    assert "--idle-timeout" in idle.value.message and "reset()" in idle.value.message
