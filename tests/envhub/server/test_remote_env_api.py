"""``RemoteEnv`` offers what code written against a local ``TextEnv`` reads (``tools``, ``done``,
``turn``, ``messages``), and refuses env kwargs with the way to serve them, before connecting."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import envhub
from envhub.errors import EnvKwargsError
from tests.envhub.server.hubtools import TOKEN, running_hub

TOOLS_ENV = "tools/lookup-v0"


@pytest.fixture(scope="module")
def hub():
    with running_hub(envs=[TOOLS_ENV], workers=1) as running:
        yield running


def test_a_remote_env_reads_like_the_local_one_through_a_whole_episode(hub):
    local = envhub.make(TOOLS_ENV)
    remote = envhub.make(TOOLS_ENV, hub=hub.url, token=TOKEN)
    try:
        assert (remote.done, remote.turn, remote.messages) == (False, 0, [])
        assert remote.reset(seed=2) == local.reset(seed=2)
        assert remote.tools == local.tools and remote.tools  # `env.tools`, as docs/envs/tools.md
        assert (remote.done, remote.turn) == (False, 0)
        while not local.done:
            action = local.expert_action()
            assert remote.step(action) == local.step(action)
            assert (remote.done, remote.turn) == (local.done, local.turn)
        assert remote.messages == local.messages
        remote.reset(seed=3)
        assert (remote.done, remote.turn) == (False, 0)
        assert [m["role"] for m in remote.messages] == ["system", "user"]
    finally:
        remote.close()
        local.close()


def test_env_kwargs_with_a_hub_name_the_serve_option_instead_of_a_bare_type_error():
    # no hub listens there: the kwargs are refused before any connection is tried
    with pytest.raises(EnvKwargsError) as caught:
        envhub.make("games/guess-number-v0", hub="ws://127.0.0.1:9", token=TOKEN, high=1000)
    message = str(caught.value)
    assert isinstance(caught.value, TypeError)  # what make() raised before, for callers
    assert "envhub serve --env games/guess-number-v0 -k high=1000" in message
    assert "variants=" in message
    assert "connect_timeout_s" in message  # a misspelt client option is named as one
