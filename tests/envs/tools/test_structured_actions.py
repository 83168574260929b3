"""Structured actions: a tool env reads an assistant message's ``tool_calls`` as data.

The calls keep the ids the model's API gave them (the tool messages answer those ids), bad calls
are the env's feedback and penalty like bad text, and the same message gives the same episode
whether the env runs here, in a pool's worker process or behind ``envhub serve``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import envhub

CALCULATOR = "tools/calculator-v0"


def call(name: str, arguments: Any, call_id: str = "call_abc") -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def reply(*calls: dict[str, Any], content: str | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def test_tool_calls_as_data_keep_their_ids_and_bad_ones_are_feedback() -> None:
    env = envhub.make(CALCULATOR)
    _, info = env.reset(seed=3)
    assert info["structured_actions"] is True
    messages, reward, *_, step_info = env.step(
        reply(
            call("calculate", {"expression": "6*7"}, "call_1"),
            call("calculate", '{"expression": "1+2"}', "c2"),  # arguments as a JSON string
        )
    )
    assert [m["tool_call_id"] for m in messages] == ["call_1", "c2"]
    assert [m["content"] for m in messages] == ["42", "3"] and not step_info["invalid_action"]
    for bad, says in (
        (reply(call("calculat", {"expression": "1"})), "Did you mean 'calculate'?"),
        (reply(call("calculate", "{not json")), "not valid JSON"),
        (reply(call("calculate", {"expression": 5})), "must be of type string"),
        (reply(*[call("calculate", {"expression": "1"}, f"c{i}") for i in range(9)]), "at most"),
    ):
        messages, reward, terminated, _, step_info = env.step(bad)
        assert step_info["invalid_action"] and reward < 0 and not terminated
        assert says in messages[0]["content"]
    # the text form still works, and an answer without calls ends the episode
    messages, *_ = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}')
    assert messages[0]["content"] == "2"
    *_, terminated, _, step_info = env.step(reply(content="<answer>0</answer>"))
    assert terminated and not step_info["success"]


def script(env: Any) -> list[Any]:
    """One episode of structured actions; every step's outcome."""
    out = [env.reset(seed=5)]
    out.append(env.step(reply(call("calculate", {"expression": "2**10"}, "x1"))))
    out.append(env.step(reply(call("nope", {}, "x2"))))
    out.append(env.step(reply(content="<answer>1024</answer>")))
    return out


def test_a_pool_and_the_hub_pass_structured_actions_to_their_envs() -> None:
    from envhub.pool import EnvPool
    from tests.envhub.server.hubtools import TOKEN, running_hub

    local = script(envhub.make(CALCULATOR))

    async def pooled() -> list[Any]:
        async with EnvPool(CALCULATOR, num_workers=1) as pool:
            first = await pool.reset(seed=5)
            out: list[Any] = [(first.observation, first.info)]
            for action in (
                reply(call("calculate", {"expression": "2**10"}, "x1")),
                reply(call("nope", {}, "x2")),
                reply(content="<answer>1024</answer>"),
            ):
                r = await pool.step(first.episode, action)
                out.append((r.observation, r.reward, r.terminated, r.truncated, r.info))
            with pytest.raises(TypeError, match="assistant message"):
                await pool.step(first.episode, {"role": "tool", "content": "x"})
            return out

    assert [list(x) for x in asyncio.run(pooled())] == [list(x) for x in local]
    with running_hub(envs=[CALCULATOR]) as hub:
        remote = envhub.make(CALCULATOR, hub=hub.url, token=TOKEN)
        try:
            assert [list(x) for x in script(remote)] == [list(x) for x in local]
        finally:
            remote.close()
