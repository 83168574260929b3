"""Env-specific guarantees of the calculator, SQL and retrieval tools."""

from __future__ import annotations

import pytest

import envhub
from envs.tools.base import ToolError
from envs.tools.calculator import safe_eval
from envs.tools.retrieval import RetrievalEnv


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 + 3 * 4", 14),
        ("1,234 * 2", 2468),
        ("round(10 / 3, 2)", 3.33),
        ("2^10", 1024),
        ("ceil(7 / 2)", 4),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert safe_eval(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('echo hi')", "is not allowed"),
        ("(1).__class__", "is not allowed"),
        ("9**9**9", "exponent too large"),
        ("10**99 * 10**99", "out of range"),
        ("1 / 0", "division by zero"),
        ("sqrt(-1)", "math error"),
        ("1 +", "cannot parse"),
        ("1" * 600, "too long"),
    ],
)
# a runaway that is not refused never returns: the timeout catches it
# (speed: benchmarks/speed_checks.py)
@pytest.mark.timeout(60)
def test_calculator_refuses_code_and_runaway_numbers(expression, message):
    with pytest.raises(ToolError, match=message):
        safe_eval(expression)


def sql(env, query):
    return env.step(
        f'<tool_call>{{"name": "run_sql", "arguments": {{"query": "{query}"}}}}</tool_call>'
    )[0][0]["content"]


def test_sql_is_read_only_and_bounded():
    env = envhub.make("tools/sql-v0")
    env.reset(seed=1)
    assert "Error: SQL error" in sql(env, "DROP TABLE employees")
    assert "Error: SQL error" in sql(env, "ATTACH DATABASE '/tmp/x.db' AS x")
    assert "employees" in env.call_tool("list_tables", {})
    runaway = sql(
        env, "SELECT COUNT(*) FROM employees a, employees b, employees c, employees d, employees e"
    )
    # stopped by the query budget, not run to the end (that would take hours)
    assert "aborted" in runaway
    assert "more rows" in sql(env, "SELECT a.id FROM employees a, employees b")
    assert (
        "no table named 'staff'"
        in env.step(
            '<tool_call>{"name": "describe_table", "arguments": {"table": "staff"}}</tool_call>'
        )[0][0]["content"]
    )


def test_sql_database_differs_by_task_and_survives_pickling():
    import pickle

    env = envhub.make("tools/sql-v0")
    env.reset(seed=2)
    copy = pickle.loads(pickle.dumps(env))
    assert copy.call_tool("run_sql", {"query": "SELECT COUNT(*) FROM employees"}) == env.call_tool(
        "run_sql", {"query": "SELECT COUNT(*) FROM employees"}
    )
    counts = set()
    for seed in range(6):
        env.reset(seed=seed)
        counts.add(
            env.call_tool("run_sql", {"query": "SELECT COUNT(*), SUM(salary) FROM employees"})
        )
    assert len(counts) > 1


def test_retrieval_needs_two_hops_and_accepts_a_custom_corpus(tmp_path):
    env = RetrievalEnv()
    env.reset(options={"task_id": "doc-03-0"})
    plan = env.plan()
    assert sum('"read"' in step for step in plan) == 2
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        '{"id": "a", "title": "Zorbl", "text": "Zorbl is a moon of Quax."}\n'
        '{"id": "b", "title": "Quax", "text": "Quax has 7 moons."}\n'
    )
    custom = RetrievalEnv(
        documents=str(docs),
        dataset=[
            {
                "question": "How many moons has the planet Zorbl orbits?",
                "answer": "7",
                "docs": ["a", "b"],
            }
        ],
    )
    custom.reset(seed=0)
    assert "[a] Zorbl" in custom.call_tool("search", {"query": "zorbl moon"})
    while not custom.done:
        _, reward, *_ = custom.step(custom.expert_action())
    assert reward == 1.0


def test_lookup_needs_both_calls_and_grades_each_code():
    env = envhub.make("tools/lookup-v0")
    env.reset(seed=5)
    first, second = env.task["names"]
    codes = [env.task["table"][first], env.task["table"][second]]
    results = []
    for name in (first, second):
        messages, *_ = env.step(
            f'<tool_call>{{"name": "lookup", "arguments": {{"name": "{name}"}}}}</tool_call>'
        )
        results.append(messages[0]["content"])
    assert results == codes
    wrong = str((int(codes[1]) + 1) % 10)
    _, reward, terminated, _, info = env.step(f"<answer>{codes[0]} {wrong}</answer>")
    assert terminated and reward == 0.5 and not info["success"]  # one of two codes right
    env.reset(seed=5)
    messages, reward, *_ = env.step(
        '<tool_call>{"name": "lookup", "arguments": {"name": "teal"}}</tool_call>'
    )
    assert "must be one of" in messages[0]["content"] and reward < 0  # the schema's enum


def test_lookup_answer_with_more_than_two_codes_scores_nothing():
    """A policy that copies both codes and then rambles on (a truncated answer full of digits)
    must not be graded a success: the answer is exactly the two codes."""
    env = envhub.make("tools/lookup-v0")
    env.reset(seed=5)
    codes = [env.task["table"][name] for name in env.task["names"]]
    _, reward, terminated, _, info = env.step(f"<answer>{codes[0]} {codes[1]} 0 9 8</answer>")
    assert terminated and reward == 0.0 and not info["success"]
    env.reset(seed=5)
    _, reward, _, _, info = env.step(f"<answer>{codes[0]} {codes[1]}</answer>")
    assert reward == 1.0 and info["success"]


def test_named_lookup_labels_each_code_in_the_tool_and_in_the_answer():
    """``named=True``: the tool answers ``red=3`` and the answer names each code; a bare code
    (or a code under the wrong name) earns nothing for it."""
    env = envhub.make("tools/lookup-v0", named=True)
    messages, _ = env.reset(seed=5)
    first, second = env.task["names"]
    assert f"<answer>{first}=code {second}=code</answer>" in messages[-1]["content"]
    table = env.task["table"]
    tool, *_ = env.step(
        f'<tool_call>{{"name": "lookup", "arguments": {{"name": "{first}"}}}}</tool_call>'
    )
    assert tool[0]["content"] == f"{first}={table[first]}"
    _, reward, terminated, _, info = env.step(
        f"<answer>{first}={table[first]} {second}={table[second]}</answer>"
    )
    assert terminated and reward == 1.0 and info["success"]
    env.reset(seed=5)
    _, reward, *_ = env.step(f"<answer>{table[first]} {second}={table[first]}9</answer>")
    assert reward == 0.0
    env.reset(seed=5)
    for action in env.unwrapped.plan():  # the expert's plan wins in named form too
        _, reward, terminated, *_ = env.step(action)
    assert terminated and reward == 1.0
