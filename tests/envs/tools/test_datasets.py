"""Dataset binding: JSONL or iterables, train/eval splits, per-task seeds, task selection."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import envhub
from envs.datasets import TaskSet, TaskSetError

PROBLEMS = [{"id": f"p{i}", "question": f"What is {i} + {i}?", "answer": 2 * i} for i in range(40)]


def test_splits_are_stable_disjoint_and_respect_explicit_fields():
    tasks = TaskSet(PROBLEMS, eval_fraction=0.25)
    train, evaluation = tasks.split("train"), tasks.split("eval")
    assert len(train) + len(evaluation) == 40 and 4 <= len(evaluation) <= 18
    assert not set(train.ids) & set(evaluation.ids)
    assert TaskSet(list(reversed(PROBLEMS)), eval_fraction=0.25).split("eval").ids == list(
        reversed(evaluation.ids)
    )
    explicit = TaskSet([{"id": "x", "split": "eval"}, {"id": "y"}])
    assert explicit.split("eval").ids == ["x"] and explicit.split("train").ids == ["y"]


def test_per_task_seeds_are_stable_and_distinct():
    a, b = TaskSet(PROBLEMS), TaskSet(PROBLEMS)
    assert [t["seed"] for t in a] == [t["seed"] for t in b]
    assert len({t["seed"] for t in a}) == 40
    assert TaskSet([{"id": "k", "seed": 7}])[0]["seed"] == 7


def test_selection_precedence():
    tasks = TaskSet(PROBLEMS)
    rng = np.random.default_rng(0)
    assert tasks.select({"task": {"question": "q", "answer": 1}}, rng)["question"] == "q"
    assert tasks.select({"task_id": "p3"}, rng)["answer"] == 6
    assert tasks.select({"task_index": -1}, rng)["id"] == "p39"
    assert tasks.select({}, np.random.default_rng(5)) == tasks.select({}, np.random.default_rng(5))


def test_bad_datasets_explain_the_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok", "answer": 1}\nnot json\n')
    with pytest.raises(TaskSetError, match="bad.jsonl:2 is not valid JSON"):
        TaskSet.from_jsonl(bad)
    with pytest.raises(TaskSetError, match="lacks the field"):
        envhub.make("tools/calculator-v0", dataset=[{"question": "no answer"}])
    with pytest.raises(TaskSetError, match="split is empty"):
        TaskSet(PROBLEMS).split("eval")
    with pytest.raises(TaskSetError, match="duplicate task id"):
        TaskSet([{"id": 1}, {"id": 1}])
    with pytest.raises(TaskSetError, match="no task with id 'zz'"):
        TaskSet(PROBLEMS).get("zz")


def test_an_env_plays_a_bound_jsonl_split(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROBLEMS))
    env = envhub.make("tools/calculator-v0", dataset=str(path), split="eval", eval_fraction=0.3)
    eval_ids = TaskSet.from_jsonl(path, eval_fraction=0.3).split("eval").ids
    seen = {env.reset(seed=s)[1]["task_id"] for s in range(30)}
    assert seen <= set(eval_ids) and len(seen) > 1
    messages, _ = env.reset(options={"task_id": eval_ids[0]})
    problem = next(p for p in PROBLEMS if p["id"] == eval_ids[0])
    assert messages[-1]["content"] == problem["question"]
    _, reward, terminated, _, _ = env.step(env.expert_action())
    assert terminated and reward == 1.0


def test_a_custom_task_missing_a_field_names_it_and_what_a_task_needs():
    tasks, rng = TaskSet(PROBLEMS, name="sums"), np.random.default_rng(0)
    needs = ("question", "answer")
    with pytest.raises(TaskSetError) as error:
        tasks.select({"task": {"question": "q"}}, rng, required=needs)
    assert str(error.value).startswith(
        "sums: options['task'] lacks the field(s) ['answer']; a task needs "
        "['question', 'answer'] (got keys ['question'])"
    )
    with pytest.raises(TaskSetError, match=re.escape(", or ['kind'] to draw one from its seed")):
        tasks.select({"task": {"question": "q"}}, rng, required=needs, generated=("kind",))
    # the env's own generated form needs none of the fields a dataset's record needs
    drawn = tasks.select({"task": {"kind": "k"}}, rng, required=needs, generated=("kind",))
    assert drawn["kind"] == "k" and drawn["id"] == "custom"


@pytest.mark.parametrize(
    "env_id, task, missing",
    [
        ("tools/calculator-v0", {"question": "What is 2+2?"}, ["answer"]),
        ("tools/sql-v0", {"question": "How many employees?"}, ["answer"]),
        ("tools/retrieval-v0", {"answer": "1935"}, ["question"]),
        ("tools/lookup-v0", {"names": ["red", "blue"]}, ["table"]),
        ("tools/mcp-v0", {"question": "How many widgets?"}, ["answer"]),
    ],
)
def test_a_tool_env_refuses_a_custom_task_missing_a_field(env_id, task, missing):
    env = envhub.make(env_id)
    try:
        with pytest.raises(TaskSetError, match=re.escape(f"lacks the field(s) {missing}")):
            env.reset(options={"task": task})
    finally:
        env.close()


def test_sql_still_plays_a_task_in_its_generated_form():
    env = envhub.make("tools/sql-v0")
    messages, _ = env.reset(options={"task": {"template": 2, "seed": 7}})
    assert messages[-1]["content"].startswith("Who logged the most hours on project")
    while not env.done:
        _, reward, *_ = env.step(env.expert_action())
    assert reward == 1.0
