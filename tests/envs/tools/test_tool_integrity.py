"""Attacks on the tool envs' integrity, one property per test: a hedged answer earns nothing,
a hostile call is refused as an invalid action (never an exception or a hang), and the SQL
database stays read-only and bounded."""

from __future__ import annotations

import json
import sqlite3

import pytest

import envhub
from envhub.parsing import format_tool_call
from envs.tools.base import ToolError
from envs.tools.calculator import safe_eval
from envs.tools.retrieval import _COUNTRIES, RetrievalEnv
from envs.tools.sql import SqlEnv

SURROGATE_JSON = '"\\udcff"'  # what a model writes: a JSON escape of a lone surrogate
DEEP = "[" * 1_500 + "]" * 1_500


def structured(name: str, arguments: str) -> dict:
    """An assistant message whose tool call is data, arguments as the raw JSON string."""
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def answer(env, task_id: str, text: str) -> float:
    env.reset(options={"task_id": task_id})
    _, reward, terminated, _, info = env.step(f"<answer>{text}</answer>")
    assert terminated and info["success"] == (reward == 1.0)
    return reward


# ----------------------------------------------------------------------------- retrieval
@pytest.fixture(scope="module")
def retrieval():
    return RetrievalEnv()


def test_retrieval_hedge_over_every_country_scores_nothing(retrieval):
    task_id = "doc-05-2"
    country = retrieval.tasks.get(task_id)["answer"]
    assert answer(retrieval, task_id, " ".join(_COUNTRIES)) == 0.0
    other = next(c for c in _COUNTRIES if c != country)
    assert answer(retrieval, task_id, f"{country} or {other}") == 0.0
    assert answer(retrieval, task_id, country) == 1.0
    assert answer(retrieval, task_id, f"The founder was born in {country}.") == 1.0


def test_retrieval_hedge_over_several_numbers_scores_nothing(retrieval):
    year_task, population_task = "doc-07-0", "doc-07-1"
    year = int(retrieval.tasks.get(year_task)["answer"])
    hedge = " ".join(str(y) for y in range(year - 2, year + 4))
    assert answer(retrieval, year_task, hedge) == 0.0
    assert answer(retrieval, year_task, f"{year} or {year + 1}") == 0.0
    assert answer(retrieval, year_task, str(year)) == 1.0
    assert answer(retrieval, year_task, f"born in {year}") == 1.0
    population = int(retrieval.tasks.get(population_task)["answer"])
    assert answer(retrieval, population_task, f"{population:,}") == 1.0
    assert answer(retrieval, population_task, f"{population} {population + 1}") == 0.0


# ----------------------------------------------------------------------------- calculator
@pytest.mark.timeout(60)  # a safety net only: unrefused, this call never returns
@pytest.mark.parametrize("expression", ["round(1, -10**9)", "round(2.5, 10**9)"])
def test_calculator_refuses_round_with_huge_ndigits(expression):
    env = envhub.make("tools/calculator-v0")
    env.reset(seed=0)
    messages, _, _, _, info = env.step(format_tool_call("calculate", {"expression": expression}))
    assert "ndigits" in messages[0]["content"] and info["tool_errors"] == 1


@pytest.mark.parametrize(
    "expression", ["exp(300)", "floor(1e300)", "max(1e200, 1)", "abs(-1e150)", "1e400"]
)
def test_calculator_range_checks_function_arguments_and_results(expression):
    with pytest.raises(ToolError, match="out of range"):
        safe_eval(expression)


def test_calculator_lone_surrogate_is_an_error_not_a_crash():
    with pytest.raises(ToolError, match="cannot parse"):
        safe_eval("\udcff")


# ----------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "action",
    [
        f"<tool_call>{DEEP}</tool_call>",
        structured("calculate", DEEP),
        '<tool_call>{"name": "calculate", "arguments": {"expression": ' + DEEP + "}}</tool_call>",
        (
            f'<tool_call>{{"name": "calculate", "arguments": {{"expression": {SURROGATE_JSON}}}}}'
            "</tool_call>"
        ),
        structured("calculate", f'{{"expression": {SURROGATE_JSON}}}'),
        format_tool_call("calculate", {"expression": "1" * 100_001}),
        structured("calculate", json.dumps({"expression": "1" * 100_001})),
    ],
    ids=[
        "deep-text",
        "deep-structured",
        "deep-argument",
        "surrogate-text",
        "surrogate-structured",
        "long-text",
        "long-structured",
    ],
)
def test_hostile_tool_call_json_is_an_invalid_action(action):
    env = envhub.make("tools/calculator-v0")
    env.reset(seed=0)
    messages, reward, terminated, _, info = env.step(action)
    assert info["invalid_action"] and reward < 0 and not terminated
    json.dumps(messages, ensure_ascii=False).encode()  # the feedback itself is valid text


# ----------------------------------------------------------------------------- mcp
@pytest.fixture(scope="module")
def mcp_env():
    pytest.importorskip("mcp", reason="the mcp SDK is not installed (pip install 'envhub[tools]')")
    from envs.tools.mcp_bridge import McpEnv

    env = McpEnv(call_timeout_s=5.0)
    yield env
    env.close()


@pytest.mark.parametrize(
    "action",
    [
        (
            f'<tool_call>{{"name": "get_inventory", "arguments": {{"item": {SURROGATE_JSON}}}}}'
            "</tool_call>"
        ),
        structured("get_inventory", f'{{"item": {SURROGATE_JSON}}}'),
    ],
    ids=["text", "structured"],
)
def test_mcp_lone_surrogate_is_refused_and_the_server_lives_on(mcp_env, action):
    mcp_env.reset(seed=0)
    messages, reward, terminated, _, info = mcp_env.step(action)
    assert info["invalid_action"] and not terminated and reward < 0
    assert "\\udcff" in messages[0]["content"]
    after = mcp_env.step(format_tool_call("get_inventory", {"item": "widget"}))
    assert after[0][0]["content"].isdigit() and not after[4].get("failed")


def test_mcp_server_gone_on_the_structured_path_is_a_failed_episode(mcp_env):
    from envs.tools.mcp_client import McpError

    mcp_env.reset(seed=0)
    mcp_env.unwrapped._connection.close()
    with pytest.raises(McpError, match=r"went away.*the episode cannot go on"):
        mcp_env.step(structured("get_inventory", '{"item": "widget"}'))
    mcp_env.reset(seed=0)  # reconnects for the tests after this one


# ----------------------------------------------------------------------------- sql
def run_sql(env, query: str) -> str:
    return env.step(format_tool_call("run_sql", {"query": query}))[0][0]["content"]


def test_sql_pragma_cannot_switch_off_read_only():
    env = envhub.make("tools/sql-v0")
    env.reset(seed=0)
    total = run_sql(env, "SELECT SUM(salary) FROM employees")
    assert run_sql(env, "PRAGMA query_only = OFF").startswith("Error: SQL error")
    for write in [
        "UPDATE employees SET salary = 0",
        "DROP TABLE assignments",
        "CREATE TABLE t (x)",
        "BEGIN",
    ]:
        assert run_sql(env, write).startswith("Error: SQL error"), write
    assert run_sql(env, "SELECT SUM(salary) FROM employees") == total
    assert (
        "salary"
        in env.step(format_tool_call("describe_table", {"table": "employees"}))[0][0]["content"]
    )


def test_sql_huge_blob_is_refused():
    env = envhub.make("tools/sql-v0")
    env.reset(seed=0)
    assert "too big" in run_sql(env, "SELECT length(randomblob(400000000))")


def test_sql_describe_table_quotes_an_odd_table_name(tmp_path):
    path = tmp_path / "odd.db"
    db = sqlite3.connect(path)
    db.execute('CREATE TABLE "a""b" (x INT)')
    db.execute('INSERT INTO "a""b" VALUES (7)')
    db.commit()
    db.close()
    env = SqlEnv(dataset=[{"question": "x?", "answer": "7", "database": str(path)}])
    env.reset(seed=0)
    messages, _, _, _, info = env.step(format_tool_call("describe_table", {"table": 'a"b'}))
    assert messages[0]["content"] == 'a"b(x INT)\n7' and not info["invalid_action"]
