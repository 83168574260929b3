"""Tool envs under native tool calling: the chat template lists the tools, so the env's own
listing is left out of the prompt (``describe_tools``); under the text protocol it stays, as
the only description the model gets."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.trainer.rollout.test_native_tools import (  # noqa: F401 - the fixture
    PLAIN_TEMPLATE,
    expert_turns,
    play,
    tokenizer,
)
from trainer.rollout.trajectory import ChatRenderer

LISTING = "You can call these tools"


def test_native_tools_are_described_once_by_the_template(tokenizer) -> None:  # noqa: F811
    trajectory, engine = play(tokenizer, expert_turns(seed=0))
    prompt = tokenizer.decode(engine.prompts[0])
    assert "<tools>" in prompt and prompt.count('"name": "calculate"') == 1, prompt
    assert LISTING not in prompt and LISTING not in trajectory.messages[0]["content"]
    assert trajectory.success  # the env still reads the calls and grades the answer


def test_the_text_protocol_keeps_the_env_listing(tokenizer) -> None:  # noqa: F811
    for renderer in (ChatRenderer(tokenizer, tool_parser="none"), None):
        if renderer is None:  # a template that renders no tools
            tokenizer.chat_template, saved = PLAIN_TEMPLATE, tokenizer.chat_template
        try:
            trajectory, engine = play(
                tokenizer, expert_turns(seed=0), renderer or ChatRenderer(tokenizer)
            )
        finally:
            if renderer is None:
                tokenizer.chat_template = saved
        prompt = tokenizer.decode(engine.prompts[0])
        assert "<tools>" not in prompt and LISTING in prompt and trajectory.success
