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


@pytest.mark.parametrize("mode", ["ansi", "human"])
def test_render_mode_renders_the_transcript_as_a_local_env_does(hub, mode, capsys):
    """``render_mode`` is the client's own option (the hub never renders for a client): ``ansi``
    returns the transcript and ``human`` prints it, as a local ``TextEnv`` does."""
    local = envhub.make(TOOLS_ENV, render_mode=mode)
    remote = envhub.make(TOOLS_ENV, hub=hub.url, token=TOKEN, render_mode=mode)
    try:
        assert remote.render_mode == mode
        local.reset(seed=2)
        remote.reset(seed=2)
        action = local.expert_action()
        local.step(action)
        remote.step(action)
        capsys.readouterr()
        expected = local.render()
        local_printed = capsys.readouterr().out
        assert remote.render() == expected
        assert capsys.readouterr().out == local_printed
        if mode == "ansi":
            assert "[assistant]" in expected
    finally:
        remote.close()
        local.close()


def test_render_without_a_mode_returns_none_and_a_bad_mode_is_refused(hub):
    remote = envhub.make(TOOLS_ENV, hub=hub.url, token=TOKEN)
    try:
        remote.reset(seed=0)
        assert remote.render_mode is None and remote.render() is None
    finally:
        remote.close()
    with pytest.raises(ValueError, match=r"render_mode='rgb_array'.*'ansi', 'human'"):
        envhub.make(TOOLS_ENV, hub=hub.url, token=TOKEN, render_mode="rgb_array")


def test_a_remote_env_has_the_spec_of_its_id(hub):
    remote = envhub.make(TOOLS_ENV, hub=hub.url, token=TOKEN)
    try:
        assert remote.spec is not None and remote.spec.id == TOOLS_ENV
        assert remote.spec.max_episode_steps == envhub.make(TOOLS_ENV).spec.max_episode_steps
        assert TOKEN not in repr(remote.spec), "the token is a secret: not in the spec"
    finally:
        remote.close()


def test_numpy_values_in_reset_options_are_sent_as_json(hub):
    """A local env takes numpy scalars and arrays in ``options``; so does a remote one (they
    go as JSON numbers and lists); a value JSON cannot carry is refused naming its key."""
    import numpy as np

    local = envhub.make(TOOLS_ENV)
    remote = envhub.make(TOOLS_ENV, hub=hub.url, token=TOKEN)
    try:
        options = {"task_index": np.int64(3), "weights": np.arange(2), "flag": np.bool_(True)}
        assert remote.reset(seed=1, options=options) == local.reset(
            seed=1, options={"task_index": 3, "weights": [0, 1], "flag": True}
        )
        with pytest.raises(TypeError, match=r"options\['bad'\]\['x'\].*set.*JSON"):
            remote.reset(seed=0, options={"bad": {"x": {1, 2}}})
        assert remote.reset(seed=0)[0], "the refused reset left the session usable"
    finally:
        remote.close()
        local.close()
