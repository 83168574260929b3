"""The reaper, the drain and shutdown never wait behind a busy worker.

A worker answers its requests in order, so freeing an episode (``pool.close_episode``) can wait
behind every step queued on that worker. Sessions that are reaped, drained or shut down are
gone at once (their slots and per-client counts freed); their envs are closed in the
background. Here the pool's close never finishes until the test lets it: the old reaper hung.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import asyncio

from envhub.server.config import HubConfig
from envhub.server.hub import Hub
from envhub.server.sessions import SessionManager

BOUND_S = 10.0
"""How long a call may take before the test calls it stuck (a bound, not a timing check)."""


class BusyPool:
    """A pool whose worker is stuck behind a long step: ``close_episode`` waits for
    ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.closing: list[int] = []
        self.closed: list[int] = []

    async def close_episode(self, episode: int) -> None:
        self.closing.append(episode)
        await self.release.wait()
        self.closed.append(episode)


def abandoned(manager: SessionManager, pool: BusyPool, client: str, episode: int):
    session = manager.open("e", client, pool)
    session.episode = episode
    session.detached_at = 0.0  # long past grace_s
    return session


def test_the_reaper_frees_abandoned_sessions_while_their_worker_is_busy():
    async def main():
        manager = SessionManager(
            max_sessions=10, max_sessions_per_client=1, idle_timeout_s=60, grace_s=0.0
        )
        pool = BusyPool()
        for i in range(3):
            abandoned(manager, pool, f"client-{i}", episode=i)
        reaped = await asyncio.wait_for(manager.reap(), BOUND_S)
        assert reaped == 3
        assert not manager.sessions and not manager.per_client
        manager.open("e", "client-0", pool)  # its per-client count was freed: no limit error
        await asyncio.wait_for(_until(lambda: len(pool.closing) == 3), BOUND_S)
        assert pool.closed == [], "the envs' closes are still waiting on the worker"
        pool.release.set()
        await asyncio.wait_for(manager.wait_closed(), BOUND_S)
        assert sorted(pool.closed) == [0, 1, 2], "every env was closed once the worker answered"

    asyncio.run(main())


def test_drain_and_shutdown_finish_while_a_worker_is_busy():
    async def main():
        hub = Hub(HubConfig(envs=["games/guess-number-v0"], allow_no_auth=True))
        pool = BusyPool()
        for i in range(3):
            session = hub.sessions.open("games/guess-number-v0", f"client-{i}", pool)
            session.episode = i
        await asyncio.wait_for(hub.drain(), BOUND_S)
        assert not hub.sessions.sessions and hub.drained.is_set()
        assert sorted(pool.closing) == [0, 1, 2], "each env's close was sent to its worker"

    asyncio.run(main())


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)
