"""`envhub serve` + `envhub.make(ID, hub=...)`: every built-in game plays a full episode, identical
to the local env."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)


import httpx

import envhub
from envhub.errors import EpisodeOverError, ResetNeededError
from tests.envhub.server.hubtools import TOKEN, envhub_serve

GAMES = [s.id for s in envhub.list_envs("games", variants=False)]


class Served:
    def __init__(self, port: int) -> None:
        self.url = f"ws://127.0.0.1:{port}"
        self.http = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def hub():
    args = [arg for env_id in GAMES for arg in ("--env", env_id)]
    with envhub_serve(*args, "--workers", "1") as (_, port):
        yield Served(port)


def test_the_hub_serves_every_built_in_game(hub):
    """What `envhub serve --env ...` reports serving: every game family, each with a live worker."""
    served = httpx.get(f"{hub.http}/v1/envs", headers={"Authorization": f"Bearer {TOKEN}"}).json()[
        "envs"
    ]
    assert sorted(e["id"] for e in served) == sorted(GAMES) and len(GAMES) >= 5
    assert all(e["workers_alive"] >= 1 for e in served), served
    local = {s.id: s for s in envhub.list_envs("games", variants=False)}
    assert all(
        e["max_turns"] == local[e["id"]].kwargs.get("max_turns", local[e["id"]].max_turns)
        for e in served
    )


@pytest.mark.parametrize("env_id", GAMES)
def test_a_full_expert_episode_matches_the_local_env(hub, env_id):
    local = envhub.make(env_id)
    remote = envhub.make(env_id, hub=hub.url, token=TOKEN)
    try:
        with pytest.raises(ResetNeededError, match="reset"):
            remote.step("anything")
        assert remote.reset(seed=3) == local.reset(seed=3)
        done, turns = False, 0
        while not done:
            action = local.expert_action() or local.action_space.sample()
            expected = local.step(action)
            got = remote.step(action)
            assert got == expected, f"turn {turns} differs"
            done = expected[2] or expected[3]
            turns += 1
        assert turns >= 1
        with pytest.raises(EpisodeOverError, match="after the episode ended"):
            remote.step(action)
        assert remote.reset(seed=4)[0] == local.reset(seed=4)[0], (
            "a second episode on the same session"
        )
    finally:
        remote.close()
        remote.close()  # twice is safe, like a local env
        local.close()
    assert httpx.get(f"{hub.http}/health").json()["sessions"] == 0, (
        "close() ended the session on the hub"
    )
