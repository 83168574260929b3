"""Every tools/ env: the contract, oracle vs random, tool messages, robust parsing."""

from __future__ import annotations

import json

import pytest

import envhub
from envhub.evaluation import AGENTS, run_episode

IN_PROCESS = ["tools/calculator-v0", "tools/sql-v0", "tools/retrieval-v0", "tools/lookup-v0"]
ALL = [*IN_PROCESS, "tools/mcp-v0"]


# the checker runs over every id in tests/envhub/test_check_all.py
def test_envhub_list_shows_the_tool_envs():
    assert set(ALL) <= {spec.id for spec in envhub.list_envs("tools")}


@pytest.mark.parametrize("env_id", ALL)
def test_oracle_scores_full_reward_and_random_scores_low(env_id):
    env = envhub.make(env_id)
    try:
        expert = [run_episode(env, AGENTS["expert"], seed=seed) for seed in range(12)]
        random = [run_episode(env, AGENTS["random"], seed=seed) for seed in range(12)]
    finally:
        env.close()
    assert all(e.success and e.episode_return == pytest.approx(1.0) for e in expert)
    assert all(e.turns >= 3 for e in expert), "tasks should need several tool calls"
    assert sum(r.success for r in random) <= 1
    assert sum(r.episode_return for r in random) / 12 < 0.1


@pytest.mark.parametrize("env_id", IN_PROCESS)
def test_tool_results_are_tool_messages_and_schemas_are_openai_format(env_id):
    env = envhub.make(env_id)
    messages, info = env.reset(seed=4)
    assert messages[0]["role"] == "system" and "<tool_call>" in messages[0]["content"]
    for tool in info["tools"]:
        assert tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object"
    reply, reward, terminated, _, step_info = env.step(env.expert_action())
    assert [m["role"] for m in reply] == ["tool"] and reply[0]["tool_call_id"] == "call00000"
    assert reply[0]["name"] == step_info["tool_calls"][0] and reward == 0.0 and not terminated


@pytest.mark.parametrize("env_id", IN_PROCESS)
@pytest.mark.parametrize(
    "action, feedback",
    [
        (
            '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>',
            "There is no tool named",
        ),
        ("<tool_call>{not json at all</tool_call>", "not valid JSON"),
        ("I would like to think more.", "neither a tool call nor an answer"),
    ],
)
def test_malformed_calls_get_feedback_and_a_penalty(env_id, action, feedback):
    env = envhub.make(env_id)
    env.reset(seed=0)
    reply, reward, terminated, _, info = env.step(action)
    assert (
        feedback in reply[0]["content"] and reward < 0 and info["invalid_action"] and not terminated
    )


@pytest.mark.parametrize("env_id", IN_PROCESS)
def test_same_seed_same_episode_and_seeds_pick_different_tasks(env_id):
    env = envhub.make(env_id)

    def transcript(seed):
        seen = [env.reset(seed=seed)[0]]
        while not env.done:
            seen.append(env.step(env.expert_action())[:4])
        return json.dumps(seen)

    assert transcript(5) == transcript(5)
    assert len({transcript(s) for s in range(5)}) == 5


def test_wrong_answer_scores_zero_and_ends_the_episode():
    env = envhub.make("tools/calculator-v0")
    env.reset(seed=0)
    reply, reward, terminated, _, info = env.step("<answer>-1</answer>")
    assert (
        reward == 0.0 and terminated and not info["success"] and "incorrect" in reply[0]["content"]
    )


def test_tool_output_is_truncated():
    env = envhub.make("tools/sql-v0", max_tool_chars=100)
    env.reset(seed=0)
    query = "SELECT a.name, b.name FROM employees a, employees b"
    reply = env.step(
        f'<tool_call>{{"name": "run_sql", "arguments": {{"query": "{query}"}}}}</tool_call>'
    )[0]
    assert len(reply[0]["content"]) < 200 and "[truncated" in reply[0]["content"]


def test_an_answer_mused_while_thinking_does_not_end_the_episode():
    env = envhub.make("tools/calculator-v0")
    env.reset(seed=0)
    reply, reward, terminated, _, info = env.step("<think>maybe <answer>-1</answer>?</think>")
    assert not terminated and reward < 0 and info["invalid_action"], reply


def test_an_answer_sent_with_tool_calls_is_not_dropped_silently():
    env = envhub.make("tools/calculator-v0")
    env.reset(seed=0)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "1 + 1"}}</tool_call>'
    reply, _, terminated, _, _ = env.step(call + "<answer>2</answer>")
    assert not terminated and reply[0]["role"] == "tool"
    assert "answer" in reply[-1]["content"] and "not taken" in reply[-1]["content"], reply


def test_an_answer_inside_a_calls_arguments_is_the_calls():
    env = envhub.make("tools/calculator-v0")
    env.reset(seed=0)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "<answer>2</answer>"}}'
    reply, _, terminated, _, _ = env.step(call + "</tool_call>")
    assert not terminated and all("not taken" not in m["content"] for m in reply), reply
