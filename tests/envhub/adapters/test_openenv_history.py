"""OpenEnv envs that send the whole conversation in ``messages`` at every step (OpenEnv's own
chat_env does): the transcript holds each message once, as the conversation has it."""

from __future__ import annotations

import pytest

pytest.importorskip("openenv", reason="needs the openenv extra: pip install 'envhub[openenv]'")

import envhub
from tests.envhub.adapters import openenv_apps
from tests.envhub.openai_servers import serve_app

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "hi 0"},
    {"role": "user", "content": "reply 1"},
    {"role": "assistant", "content": "hi 1"},
    {"role": "user", "content": "reply 2"},
]


@pytest.mark.parametrize("app", ["history_chat_app", "new_messages_chat_app"])
def test_each_step_returns_only_the_new_messages_and_the_transcript_is_the_conversation(app):
    """Whether the server repeats its history or sends only what is new, a step returns the
    env's reply alone (not the system prompt again, nor the agent's own echoed turn), and
    ``messages`` is the conversation once."""
    with serve_app(getattr(openenv_apps, app)) as url:
        env = envhub.make("openenv/remote-v0", base_url=url)
        try:
            observation, _ = env.reset(seed=0)
            assert observation == CONVERSATION[:2]
            assert env.step("hi 0")[0] == [{"role": "user", "content": "reply 1"}]
            assert env.step("hi 1")[0] == [{"role": "user", "content": "reply 2"}]
            assert env.messages == CONVERSATION
            observation, _ = env.reset(seed=1)
            assert observation == CONVERSATION[:2], "a new episode starts from its own opening"
            assert env.step("hi 0")[0] == [{"role": "user", "content": "reply 1"}]
        finally:
            env.close()
