"""The env's answers to a step's tool calls, as the agent proxy hands them back.

What a user relies on: an agent framework that checks its conversation as api.openai.com does
(every call id of an assistant message answered by one ``tool`` message right after it) takes
what ``POST /v1/envhub/step`` returns, also when the env refused a call (an unknown tool,
arguments off the schema): the call is answered "Not run" (as ``envhub eval`` answers it) and
the env's feedback follows. Each answer goes to the call it answers, in the order of the calls.
What the proxy records is what it returned, and the next call trains exactly the tokens the
policy was prompted with, the answers included. A step whose calls share an id is refused.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from envhub.model_agent import NOT_RUN
from tests.trainer.rollout.test_agent_proxy_fidelity import CALL, Scripted
from tests.trainer.rollout.test_agent_proxy_input import CALC, QUESTION, error_of, serving
from trainer.models import build_tokenizer, env_corpus
from trainer.rollout.trajectory import ChatRenderer

UNKNOWN_TOOL = '<tool_call>{"name": "browse", "arguments": {"url": "x"}}</tool_call>'
OFF_SCHEMA = '<tool_call>{"name": "calculate", "arguments": {"formula": "2 * 2"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The quickstart's tokenizer kind, learnt on the calculator env (ChatML with tools)."""
    return build_tokenizer(env_corpus(CALC, episodes=12), kind="bpe")


def strict_api_problems(messages: list[dict[str, Any]]) -> list[str]:
    """What a strict chat API (api.openai.com) answers a 400 for in ``messages``: a call id of
    an assistant message that no ``tool`` message right after it answers (or that two calls
    share), and a ``tool`` message answering no call of the assistant message before it."""
    problems: list[str] = []
    open_ids: list[str] | None = None  # the calls the messages being read may answer
    for i, message in enumerate([*messages, {"role": "user", "content": "(next turn)"}]):
        if message["role"] == "tool":
            said = message.get("tool_call_id")
            if open_ids is None or said not in open_ids:
                problems.append(f"messages[{i}] is a tool message answering no call ({said!r})")
            else:
                open_ids.remove(said)
            continue
        if open_ids:
            problems.append(f"tool_call_ids {open_ids} have no tool message (before {i})")
        open_ids = None
        if message["role"] == "assistant" and message.get("tool_calls"):
            open_ids = [str(call["id"]) for call in message["tool_calls"]]
            if len(set(open_ids)) < len(open_ids):
                problems.append(f"messages[{i}] has tool calls sharing an id: {open_ids}")
    return problems


async def reply(client: Any, messages: list[dict[str, Any]], tools: Any) -> dict[str, Any]:
    answer = await client.post("/chat/completions", json={"messages": messages, "tools": tools})
    assert answer.is_success, answer.text
    return dict(answer.json()["choices"][0]["message"])


async def step(client: Any, action: Any) -> list[dict[str, Any]]:
    answer = await client.post("/envhub/step", json={"action": action})
    assert answer.is_success, answer.text
    return list(answer.json()["messages"])


@pytest.mark.parametrize(
    ("call", "feedback"),
    [(UNKNOWN_TOOL, "no tool named 'browse'"), (OFF_SCHEMA, "needs the argument(s) expression")],
    ids=["unknown tool", "arguments off the schema"],
)
def test_a_call_the_env_refused_is_answered_so_a_strict_client_takes_the_reply(
    tokenizer: Any, call: str, feedback: str
) -> None:
    renderer = ChatRenderer(tokenizer)

    async def main() -> None:
        engine = Scripted(tokenizer, [call, "<answer>4</answer>"])
        async with serving(engine, renderer) as (_, episode, client):
            tools = episode.tools
            made = await reply(client, QUESTION, tools)
            (asked,) = made["tool_calls"]  # the model's call reached the agent as data
            answers = await step(client, made)
            transcript = [*QUESTION, made, *answers]
            assert strict_api_problems(transcript) == []
            assert answers[0] == {"role": "tool", "tool_call_id": asked["id"], "content": NOT_RUN}
            assert [m["role"] for m in answers[1:]] == ["user"]  # the env's feedback, after
            assert feedback in answers[1]["content"]
            assert episode.trajectory.messages[-2:] == answers  # recorded as returned

            (row,) = episode.rows
            before = len(row.token_ids)
            await reply(client, transcript, tools)  # the agent's loop: the next call extends
            assert episode.rows == [row]
            prompt = engine.prompts[-1]
            # the policy was prompted with the answers as the agent sent them, and trained so
            assert prompt[before:] == renderer.continuation(answers, True, tools)
            assert row.token_ids[: len(prompt)] == prompt
            assert NOT_RUN in renderer.decode(prompt[before:], skip_special_tokens=False)

    asyncio.run(main())


def test_each_answer_goes_to_the_call_it_answers_in_the_order_of_the_calls(
    tokenizer: Any,
) -> None:
    """The env reads a step as text, so its tool messages carry its own numbering of the calls
    (``call00001``: the second call of the step), not the agent's ids: an env that ran only the
    second call of a later turn answers that call, and the first is answered "Not run"."""
    renderer = ChatRenderer(tokenizer)
    two_calls = CALL % "5 * 5" + CALL % "3 * 3"

    async def main() -> None:
        engine = Scripted(tokenizer, [CALL % "2 * 2", two_calls])
        async with serving(engine, renderer) as (_, episode, client):
            tools = episode.tools
            first = await reply(client, QUESTION, tools)
            transcript = [*QUESTION, first, *await step(client, first)]
            made = await reply(client, transcript, tools)
            ids = [c["id"] for c in made["tool_calls"]]
            assert len(ids) == 2 and ids[0] == "call00001"  # the episode numbers its calls

            async def second_call_only(action: str) -> Any:
                ran = {"role": "tool", "name": "calculate", "tool_call_id": "call00001"}
                refused = {"role": "user", "content": "The first call was not run."}
                invalid = {"invalid_action": True}  # (an env that refuses a call says so)
                return [{**ran, "content": "9"}, refused], 0.0, False, False, invalid

            episode.session.step = second_call_only  # type: ignore[method-assign]
            answers = await step(client, made)
            assert strict_api_problems([*transcript, made, *answers]) == []
            assert [(m["tool_call_id"], m["content"]) for m in answers[:2]] == [
                (ids[0], NOT_RUN),
                (ids[1], "9"),
            ]
            assert answers[2] == {"role": "user", "content": "The first call was not run."}

    asyncio.run(main())


def test_a_step_whose_calls_share_an_id_is_refused_naming_it(tokenizer: Any) -> None:
    """Two answers with one id cannot say which call each answers: the step is refused before
    the env sees it, and the agent may step again with its own ids."""

    async def main() -> None:
        engine = Scripted(tokenizer, [CALL % "2 * 2"])
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            made = await reply(client, QUESTION, episode.tools)
            (call,) = made["tool_calls"]
            twice = {**made, "tool_calls": [call, call]}
            refused = await client.post("/envhub/step", json={"action": twice})
            status, _, message = error_of(refused)
            assert status == 400 and "action.tool_calls[1].id" in message, message
            assert repr(call["id"]) in message and "own id" in message
            t = episode.trajectory
            assert t.turn_rewards == [] and not episode.ended.is_set()
            answers = await step(client, made)
            assert [m.get("tool_call_id") for m in answers] == [call["id"]]

    asyncio.run(main())


def test_a_call_without_an_id_gets_one_no_other_call_of_the_step_has(tokenizer: Any) -> None:
    """The proxy numbers a call sent without an id with the episode's next id; a call of the
    same step that already carries that id keeps it, and the unnamed call gets another."""

    async def main() -> None:
        engine = Scripted(tokenizer, [CALL % "2 * 2"])
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            made = await reply(client, QUESTION, episode.tools)  # its call is call00000
            (call,) = made["tool_calls"]
            named = {**call, "id": "call00001"}  # the id the episode would give next
            function = {"name": "calculate", "arguments": '{"expression": "3 * 3"}'}
            unnamed = {"type": "function", "function": function}
            answers = await step(client, {**made, "tool_calls": [unnamed, named]})
            said = [(m["tool_call_id"], m["content"]) for m in answers]
            assert said[1] == ("call00001", "4") and said[0][1] == "9"
            assert said[0][0] not in ("call00001", "", None)

    asyncio.run(main())
