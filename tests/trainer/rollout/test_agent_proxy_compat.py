"""Requests as other OpenAI clients write them, and requests built to stall the proxy.

What a user relies on: a ``developer`` message is a system message (as OpenAI treats it, and
the policy was post-trained on), text parts read as vLLM joins them, the legacy ``functions``
form is refused naming ``tools`` instead of ignored, a Mistral agent's tool calls get ids its
chat template takes (9 letters and digits), and a request far larger than the context (text,
names, ids, or just many messages) is refused before it is rendered or tokenised, so it
cannot hold the rollout loop that every other episode shares.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.trainer.rollout.test_agent_proxy_input import CALC, QUESTION, Engine, error_of, serving
from tests.trainer.rollout.test_template_fidelity import mistral
from trainer.models import build_tokenizer, env_corpus
from trainer.rollout.trajectory import ChatRenderer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The quickstart's tokenizer kind, learnt on the calculator env (ChatML with tools)."""
    return build_tokenizer(env_corpus(CALC, episodes=12), kind="bpe")


# --------------------------------------------------------------------------- other clients


def test_a_developer_message_is_rendered_as_a_system_message(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer)
    system = [{"role": "system", "content": "be brief"}, *QUESTION]

    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, renderer) as (_, episode, client):
            developer = [{"role": "developer", "content": "be brief"}, *QUESTION]
            answer = await client.post("/chat/completions", json={"messages": developer})
            assert answer.status_code == 200, answer.text
            reply = answer.json()["choices"][0]["message"]
            grown = [*developer, reply, {"role": "user", "content": "and 3+3?"}]
            assert (await client.post("/chat/completions", json={"messages": grown})).is_success
            assert len(episode.rows) == 1  # the second call extends the first
        assert engine.prompts[0] == renderer.prompt(system)

    asyncio.run(main())


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer)
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]

    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, renderer) as (_, __, client):
            body = {"messages": [{"role": "user", "content": parts}]}
            answer = await client.post("/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
        assert engine.prompts == [
            renderer.prompt([{"role": "user", "content": "line one\nline two"}])
        ]

    asyncio.run(main())


@pytest.mark.parametrize(
    ("legacy", "named"),
    [
        ({"functions": [{"name": "calculate", "parameters": {}}]}, "tools"),
        ({"function_call": "auto"}, "tool_choice"),
        ({"function_call": {"name": "calculate"}}, "tool_choice"),
    ],
)
def test_the_legacy_functions_form_is_refused_naming_tools(
    tokenizer: Any, legacy: dict[str, Any], named: str
) -> None:
    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            answer = await client.post("/chat/completions", json={"messages": QUESTION, **legacy})
            status, _, message = error_of(answer)
            assert status == 400 and named in message and next(iter(legacy)) in message
            assert engine.prompts == [] and episode.rows == [] and not episode.ended.is_set()

    asyncio.run(main())


def test_a_mistral_agents_tool_calls_come_back_through_its_template() -> None:
    """Mistral's template refuses a tool call (or a tool answer) whose id is not 9 letters and
    digits; the ids the proxy issues pass it, so the agent's next call renders."""
    tokenizer = mistral(env_corpus(CALC, episodes=4))
    renderer = ChatRenderer(tokenizer, tool_parser="mistral")
    call = '[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "2 + 2"}}]'

    async def main() -> None:
        engine = Engine(tokenizer, call)
        async with serving(engine, renderer) as (_, episode, client):
            body = {"messages": QUESTION, "tools": episode.tools}
            first = await client.post("/chat/completions", json=body)
            reply = first.json()["choices"][0]["message"]
            assert [re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in reply["tool_calls"]]
            step = await client.post("/envhub/step", json={"action": reply})
            assert step.is_success, step.text
            grown = {**body, "messages": [*QUESTION, reply, *step.json()["messages"]]}
            second = await client.post("/chat/completions", json=grown)
            assert second.status_code == 200, second.text
            again = second.json()["choices"][0]["message"]["tool_calls"][0]["id"]
            assert again != reply["tool_calls"][0]["id"]  # unique in the episode

    asyncio.run(main())


# --------------------------------------------------------------------------- the size bound


def spied(tokenizer: Any) -> tuple[ChatRenderer, list[int]]:
    """A renderer that notes the length of every text it tokenises."""
    renderer = ChatRenderer(tokenizer)
    encoded: list[int] = []
    encode = renderer.encode
    renderer.encode = lambda text: encoded.append(len(text)) or encode(text)  # type: ignore
    return renderer, encoded


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": ""}] * 2000,  # more messages than the context has tokens
        [{"role": "user", "content": "12 + 34 ="}] * 50,  # each message costs a token at least
        [{"role": "tool", "tool_call_id": "x" * 5000, "content": "4"}, *QUESTION],
        [{"role": "user", "name": "x" * 5000, "content": "hi"}],
    ],
    ids=["many empty", "many short", "long tool_call_id", "long name"],
)
def test_a_request_larger_than_the_context_is_refused_before_it_is_tokenised(
    tokenizer: Any, messages: list[dict[str, Any]]
) -> None:
    renderer, encoded = spied(tokenizer)

    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, renderer, max_context_tokens=64) as (_, episode, client):
            answer = await client.post("/chat/completions", json={"messages": messages})
            status, _, message = error_of(answer)
            assert status == 400 and "context length is 64 tokens" in message, message
            assert answer.json()["error"]["code"] == "context_length_exceeded"
            assert encoded == [] and engine.prompts == []
            assert episode.trajectory.truncated and episode.rows == []  # as a full context ends it

    asyncio.run(main())
