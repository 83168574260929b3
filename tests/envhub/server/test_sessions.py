"""Session bookkeeping without a network: limits, at-most-once execution, reaping."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import asyncio

import orjson

from envhub.server.config import HubConfig
from envhub.server.errors import SessionLimitError
from envhub.server.sessions import SessionManager


class FakePool:
    def __init__(self):
        self.closed = []

    async def close_episode(self, episode):
        self.closed.append(episode)


def manager(**overrides):
    settings = {
        "max_sessions": 2,
        "max_sessions_per_client": 5,
        "idle_timeout_s": 60,
        "grace_s": 0.0,
    }
    return SessionManager(**{**settings, **overrides})


def test_global_and_per_client_limits_name_the_limit():
    m = manager()
    m.open("e", "a", FakePool())
    m.open("e", "b", FakePool())
    with pytest.raises(SessionLimitError, match="maximum of 2 sessions") as exc:
        m.open("e", "c", FakePool())
    assert exc.value.scope == "global"
    m = manager(max_sessions=10, max_sessions_per_client=1)
    m.open("e", "a", FakePool())
    with pytest.raises(SessionLimitError, match="limit per client is 1"):
        m.open("e", "a", FakePool())
    m.open("e", "b", FakePool())


def test_a_request_runs_at_most_once_per_seq():
    async def main():
        session = manager().open("e", "a", FakePool())
        calls = []

        async def work():
            calls.append(1)
            await asyncio.sleep(0.05)
            return f"answer {len(calls)}"

        first, repeat_while_running = await asyncio.gather(
            session.execute(1, work), session.execute(1, work)
        )
        assert first == repeat_while_running == "answer 1"
        assert await session.execute(1, work) == "answer 1"
        assert orjson.loads(await session.execute(5, work))["code"] == "bad_seq"
        assert await session.execute(2, work) == "answer 2"
        assert len(calls) == 2

    asyncio.run(main())


def test_reaper_closes_abandoned_sessions_and_frees_episodes():
    async def main():
        m = manager()
        pool = FakePool()
        session = m.open("e", "a", pool)
        session.episode = 7
        m.detach(session, None)  # never attached: detach is a no-op for another conn
        session.detached_at = 0.0
        assert await m.reap() == 1
        assert not m.sessions and not m.per_client
        await m.wait_closed()  # the env is closed in the background (test_reaper_busy_workers)
        assert pool.closed == [7]

    asyncio.run(main())


def test_config_refuses_to_serve_the_network_without_a_token():
    with pytest.raises(ValueError, match="no token"):
        HubConfig(envs=["games/sokoban-v0"])
    with pytest.raises(ValueError, match="bind 127.0.0.1 or pass --token"):
        HubConfig(envs=["games/sokoban-v0"], allow_no_auth=True, host="0.0.0.0")
    HubConfig(envs=["games/sokoban-v0"], allow_no_auth=True, host="::1")


def test_serve_cli_refuses_bad_settings_with_the_fix():
    from click.testing import CliRunner

    from envhub.cli import main

    runner = CliRunner()
    no_token = runner.invoke(main, ["serve", "--env", "games/sokoban-v0"], env={"ENVHUB_TOKEN": ""})
    assert no_token.exit_code == 2 and "pass --token" in no_token.output
    open_net = runner.invoke(
        main, ["serve", "--env", "games/sokoban-v0", "--no-auth", "--host", "0.0.0.0"]
    )
    assert open_net.exit_code == 2 and "bind 127.0.0.1" in open_net.output
    unknown = runner.invoke(
        main, ["serve", "--env", "games/sokoban-v9", "--token", "long-enough-token"]
    )
    assert unknown.exit_code == 2 and "Did you mean 'games/sokoban-v0'" in unknown.output
    assert "serve" in runner.invoke(main, ["--help"]).output
