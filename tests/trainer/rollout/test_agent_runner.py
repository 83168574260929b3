"""How ``AgentRunner`` runs a user's agent, and what ``AgentEpisode`` gives it.

What a user relies on: an ``async def`` agent plays its episode like a plain function; the
loopback clients envhub builds (``openai_client``, ``env``, ``from_environ``), and a program
agent's own ``openai`` clients, reach the proxy on a host whose environment sends HTTP through
an HTTP proxy (``HTTP_PROXY``, common on clusters); and the clients ``openai_client`` made are
closed when the episode ends, so many short episodes do not pile up connections.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.trainer.rollout import proxy_agents
from tests.trainer.rollout.test_agent_proxy_input import CALC, Engine, serving
from trainer.config_rollout import AgentConfig
from trainer.models import build_tokenizer, env_corpus
from trainer.rollout.agents import AgentEpisode, AgentRunner
from trainer.rollout.env_manager import LocalEnvSource, Sampling
from trainer.rollout.groups import EpisodeSpec, play_episode
from trainer.rollout.proxy import AgentProxy
from trainer.rollout.trajectory import ChatRenderer, Trajectory

AGENTS = "tests.trainer.rollout.proxy_agents"
DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens: a request sent through it fails


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The quickstart's tokenizer kind, learnt on the calculator env (ChatML with tools)."""
    return build_tokenizer(env_corpus(CALC, episodes=12), kind="bpe")


@pytest.fixture
def behind_an_http_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a host whose HTTP goes through a proxy, which loopback cannot reach."""
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, DEAD_PROXY)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


def play(tokenizer: Any, **agent: Any) -> Trajectory:
    """One calculator episode played by ``agent`` through a proxy whose policy answers 4."""

    async def main() -> Trajectory:
        engine = Engine(tokenizer, "<answer>4</answer>")
        proxy = AgentProxy(engine, ChatRenderer(tokenizer), max_turns=4, max_context_tokens=4096)
        await proxy.start()
        try:
            runner = AgentRunner(proxy, AgentConfig(**agent))
            spec = EpisodeSpec(CALC, 1, 0)
            return await play_episode(runner, LocalEnvSource(), spec, Sampling(32), max_retries=0)
        finally:
            await proxy.aclose()

    return asyncio.run(main())


def test_an_async_agent_plays_its_episode(tokenizer: Any) -> None:
    t = play(tokenizer, callable=f"{AGENTS}:answers_async")
    assert not t.failed, t.failure
    assert t.num_turns == 1 and t.terminated


def test_the_clients_openai_client_made_are_closed_when_the_episode_ends(tokenizer: Any) -> None:
    proxy_agents.CLIENTS.clear()
    t = play(tokenizer, callable=f"{AGENTS}:keeps_its_client")
    assert not t.failed, t.failure
    assert len(proxy_agents.CLIENTS) == 1 and proxy_agents.CLIENTS[0].is_closed()


@pytest.mark.usefixtures("behind_an_http_proxy")
def test_a_function_agents_loopback_clients_bypass_an_http_proxy(tokenizer: Any) -> None:
    t = play(tokenizer, callable=f"{AGENTS}:steps")
    assert not t.failed, t.failure
    assert t.num_turns == 1 and t.terminated


@pytest.mark.usefixtures("behind_an_http_proxy")
def test_a_function_agents_own_async_client_bypasses_an_http_proxy(tokenizer: Any) -> None:
    """An ``async def`` agent with its own ``openai.AsyncOpenAI``, as the docs suggest."""
    t = play(tokenizer, callable=f"{AGENTS}:answers_async")
    assert not t.failed, t.failure
    assert t.num_turns == 1 and t.terminated


@pytest.mark.usefixtures("behind_an_http_proxy")
def test_a_program_agents_own_openai_client_bypasses_an_http_proxy(tokenizer: Any) -> None:
    """``proxy_agents.play`` builds its own client, which reads ``HTTP_PROXY`` as any would."""
    t = play(tokenizer, command=[sys.executable, "-m", AGENTS])
    assert not t.failed, t.failure
    assert t.num_turns == 1 and t.terminated


def test_from_environ_bypasses_an_http_proxy(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with serving(Engine(tokenizer), ChatRenderer(tokenizer)) as (proxy, episode, _):
            monkeypatch.setenv("HTTP_PROXY", DEAD_PROXY)  # after the test's own client was built
            monkeypatch.setenv("http_proxy", DEAD_PROXY)
            monkeypatch.delenv("NO_PROXY", raising=False)
            monkeypatch.delenv("no_proxy", raising=False)
            environ = {"OPENAI_BASE_URL": proxy.base_url, "OPENAI_API_KEY": episode.api_key}
            view = await asyncio.to_thread(AgentEpisode.from_environ, environ)
            assert view.env_id == CALC and view.messages == episode.first_messages

    asyncio.run(main())
