"""OpenEnv's own client (openenv-core) resets and steps envhub envs through `envhub serve`.

The hub runs as `envhub serve --protocol openenv` configures it (one env at the root), and as a
default hub that answers OpenEnv under /openenv/<env id>; the client is openenv-core's
`GenericEnvClient`, untouched: the token rides in the URL.
"""

from __future__ import annotations

import urllib.request

import orjson
import pytest
from pydantic import ValidationError

pytest.importorskip("openenv", reason="needs the openenv extra: pip install 'envhub[openenv]'")

from openenv.core.generic_client import GenericEnvClient

import envhub
from envhub.server.config import HubConfig
from tests.envhub.server.hubtools import TOKEN, running_hub

GAME = "games/guess-number-v0"


def client(base_url: str):
    return GenericEnvClient(base_url=base_url, message_timeout_s=30).sync()


@pytest.fixture(scope="module")
def openenv_hub():
    with running_hub(envs=[GAME], protocol="openenv", max_sessions_per_client=3) as hub:
        yield hub


@pytest.fixture(scope="module")
def multi_hub():
    with running_hub(envs=[GAME, "test/faulty-v0"]) as hub:
        yield hub


def authed(hub, path: str = "") -> str:
    return f"http://envhub:{TOKEN}@127.0.0.1:{hub.port}{path}"


def test_openenvs_client_plays_an_envhub_env_exactly_as_locally(openenv_hub):
    local = envhub.make(GAME)
    messages, info = local.reset(seed=3)
    with client(authed(openenv_hub)) as env:
        result = env.reset(seed=3, episode_id="ep-1")
        assert result.observation == {
            "messages": messages,
            "info": info,
            "terminated": False,
            "truncated": False,
        }
        assert (result.reward, result.done) == (None, False)
        for guess in ["<answer>50</answer>", "no idea", "<answer>25</answer>"]:
            remote = env.step({"message": guess})
            obs, reward, terminated, truncated, info = local.step(guess)
            assert remote.observation == {
                "messages": obs,
                "info": info,
                "terminated": terminated,
                "truncated": truncated,
            }
            assert (remote.reward, remote.done) == (reward, terminated or truncated)
        assert env.state() == {"episode_id": "ep-1", "step_count": 3, "env_id": GAME}
    metrics = urllib.request.Request(
        f"{openenv_hub.http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    body = urllib.request.urlopen(metrics, timeout=10).read().decode()
    assert f'envhub_steps_total{{env="{GAME}"}}' in body


def test_every_hub_answers_openenv_under_the_env_id(multi_hub):
    with client(authed(multi_hub, f"/openenv/{GAME}")) as env:
        assert "guess" in env.reset(seed=0).observation["messages"][-1]["content"].lower()
    with client(authed(multi_hub, "/openenv/test/faulty-v0")) as env:
        env.reset(seed=0)
        assert env.step({"message": "hi"}).observation["messages"][0]["content"] == "echo hi"
        with pytest.raises(RuntimeError, match="episode failed .*env_error.*EXECUTION_ERROR"):
            env.step({"message": "raise"})
        assert env.reset(seed=1).done is False  # a new episode on the same session
    request = urllib.request.Request(
        f"{multi_hub.http}/openenv/{GAME}/schema", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    schema = orjson.loads(urllib.request.urlopen(request, timeout=10).read())
    assert schema["action"]["required"] == ["message"]


def test_envhubs_openenv_adapter_round_trips_through_the_hub(openenv_hub):
    """envhub -> OpenEnv protocol -> envhub: the adapted env keeps the contract."""
    url = authed(openenv_hub)
    make = lambda: envhub.make("openenv/remote-v0", base_url=url)
    envhub.check_env(make(), factory=make)
    env = make()
    messages, _ = env.reset(seed=5)
    assert messages == envhub.make(GAME).reset(seed=5)[0]
    env.close()


def raw(hub, path: str = "/ws", token: str | None = TOKEN):
    from websockets.sync.client import connect

    auth = f"envhub:{token}@" if token else ""
    return connect(f"ws://{auth}127.0.0.1:{hub.port}{path}", open_timeout=10).__enter__()


def ask(ws, message) -> dict:
    ws.send(message if isinstance(message, str) else orjson.dumps(message).decode())
    return orjson.loads(ws.recv(timeout=10))


def test_bad_messages_get_openenvs_error_codes_and_the_session_goes_on(openenv_hub):
    with raw(openenv_hub) as ws:
        cases = [
            ("{not json", "INVALID_JSON", "not JSON"),
            ({"type": "mcp", "data": {}}, "UNKNOWN_TYPE", "reset, step, state or close"),
            ({"type": "step", "data": {"text": "hi"}}, "VALIDATION_ERROR", "message"),
            ({"type": "reset", "data": {"sed": 1}}, "VALIDATION_ERROR", "sed"),
            ({"type": "reset", "data": {"seed": -1}}, "VALIDATION_ERROR", "seed"),
            ({"type": "reset", "data": {"seed": True}}, "VALIDATION_ERROR", "seed"),
            ({"type": "reset", "data": {"seed": 1.0}}, "VALIDATION_ERROR", "seed"),
            ({"type": "step", "data": {"message": "hi"}}, "EXECUTION_ERROR", "before reset"),
        ]
        for message, code, words in cases:
            answer = ask(ws, message)
            assert answer["type"] == "error" and answer["data"]["code"] == code, answer
            assert words in answer["data"]["message"]
        assert ask(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"


def test_the_token_and_the_session_limits_hold(openenv_hub):
    no_token = client(f"http://127.0.0.1:{openenv_hub.port}")
    with no_token, pytest.raises(RuntimeError, match="missing or wrong token.*UNAUTHORIZED"):
        no_token.reset()
    wrong = client(f"http://envhub:not-the-token@127.0.0.1:{openenv_hub.port}")
    with wrong, pytest.raises(RuntimeError, match="UNAUTHORIZED"):
        wrong.reset()
    held = [raw(openenv_hub) for _ in range(3)]
    try:
        for ws in held:
            assert ask(ws, {"type": "reset"})["type"] == "observation"
        with raw(openenv_hub) as extra:
            answer = ask(extra, {"type": "reset"})  # the refusal answers the first request
            assert answer["data"]["code"] == "CAPACITY_REACHED"
            assert "limit per client is 3" in answer["data"]["message"]
    finally:
        for ws in held:
            ws.close()


def test_protocol_openenv_serves_exactly_one_env():
    with pytest.raises(ValidationError, match="--protocol openenv serves one env"):
        HubConfig(envs=[GAME, "games/wordle-v0"], protocol="openenv", token=TOKEN)
