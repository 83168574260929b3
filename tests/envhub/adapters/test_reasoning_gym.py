"""reasoning-gym datasets as envhub task envs: contract, scoring, tasks, config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip(
    "reasoning_gym", reason="needs the reasoning-gym extra: pip install 'envhub[reasoning-gym]'"
)

import envhub
from envhub.errors import SourceConfigError
from envs.datasets import TaskSet
from tests.envhub.adapters.sweep import failing

SAMPLE = ["leg_counting", "basic_arithmetic", "word_sorting", "maze", "letter_counting"]
"""Checked in the default tier (fast); test_every_dataset_that_loads_offline_passes checks all."""

NOT_OFFLINE = {"composite": "needs config={'datasets': ...} naming the datasets it mixes"}


@pytest.mark.parametrize("name", SAMPLE)
def test_sample_datasets_keep_the_contract(name):
    env_id = f"reasoning-gym/{name}-v0"
    envhub.check_env(envhub.make(env_id), factory=lambda: envhub.make(env_id))


def test_the_retry_variant_keeps_the_contract():
    env_id = "reasoning-gym/leg_counting-retry-v0"
    envhub.check_env(envhub.make(env_id), factory=lambda: envhub.make(env_id))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_dataset_that_loads_offline_passes():
    """The README's count: every dataset but those in NOT_OFFLINE passes `envhub check`."""
    datasets = envhub.list_envs("reasoning-gym", variants=False)
    failed = failing(datasets, lambda spec: spec.kwargs["name"])
    assert set(failed) == set(NOT_OFFLINE), failed
    assert len(datasets) - len(failed) == 103


def test_the_expert_answer_scores_one_and_a_wrong_one_is_told_its_score():
    env = envhub.make("reasoning-gym/basic_arithmetic-v0")
    messages, info = env.reset(seed=3)
    assert messages[0]["role"] == "system" and "<answer>" in messages[0]["content"]
    assert "answer" not in info and info["dataset"] == "basic_arithmetic"
    _, reward, terminated, _, info = env.step(env.expert_action())
    assert (reward, terminated, info["success"]) == (1.0, True, True)

    retry = envhub.make("reasoning-gym/basic_arithmetic-retry-v0")
    retry.reset(seed=3)
    messages, reward, terminated, _, info = retry.step("<answer>-123456789</answer>")
    assert (reward, terminated, info["success"]) == (0.0, False, False)
    assert "2 attempt(s) left" in messages[0]["content"]
    _, reward, terminated, _, info = retry.step("no tags at all")
    assert info["invalid_action"] and not terminated
    _, reward, terminated, _, info = retry.step(retry.expert_action())
    assert (reward, terminated, info["success"]) == (1.0, True, True)


def test_tasks_follow_the_dataset_binding_rules():
    env = envhub.make("reasoning-gym/leg_counting-v0", size=50)
    first, info = env.reset(seed=11)
    assert env.reset(seed=11)[0] == first
    again, by_id = env.reset(options={"task_id": info["task_id"]})
    assert again == first and by_id["task_id"] == info["task_id"]
    entry = {"question": "How many legs do 2 dogs have?", "answer": "8", "metadata": {}}
    messages, info = env.reset(options={"task": entry})
    assert entry["question"] in messages[-1]["content"] and info["task_id"] == "custom"
    assert env.step("<answer>8</answer>")[1] == 1.0

    train = envhub.make("reasoning-gym/leg_counting-v0", size=50, split="train", eval_fraction=0.3)
    held = envhub.make("reasoning-gym/leg_counting-v0", size=50, split="eval", eval_fraction=0.3)
    assert set(train.tasks.indices).isdisjoint(held.tasks.indices)
    assert len(train.tasks) + len(held.tasks) == 50
    # the same hash as TaskSet: an id is held out here exactly when it is held out there
    same = TaskSet([{"id": str(i)} for i in range(50)], eval_fraction=0.3).split("eval")
    assert sorted(map(int, same.ids)) == held.tasks.indices


def test_a_user_dataset_is_scored_by_the_datasets_own_verifier(tmp_path):
    path = tmp_path / "legs.jsonl"
    rows = [
        {"question": "How many legs do 3 spiders have?", "answer": "24", "metadata": {}},
        {"question": "How many legs do 2 cats have?", "answer": "8", "metadata": {}},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = envhub.make("reasoning-gym/leg_counting-v0", dataset=str(path))
    messages, _ = env.reset(options={"task_index": 0})
    assert "3 spiders" in messages[-1]["content"]
    assert env.step("<answer>24</answer>")[1] == 1.0


def test_bad_names_and_configs_say_what_exists():
    with pytest.raises(envhub.errors.UnknownEnvError, match="'reasoning-gym/leg_counting-v0'"):
        envhub.make("reasoning-gym/leg_countin-v0")
    with pytest.raises(SourceConfigError, match="Did you mean 'leg_counting'"):
        envhub.make("reasoning-gym/leg_counting-v0", name="leg_countin")
    with pytest.raises(SourceConfigError, match="Did you mean 'min_animals'.*accepts: min_animals"):
        envhub.make("reasoning-gym/leg_counting-v0", config={"min_animal": 3})
    with pytest.raises(SourceConfigError, match="config refused"):
        envhub.make("reasoning-gym/leg_counting-v0", config={"min_animals": 9, "max_animals": 2})
    harder = envhub.make("reasoning-gym/leg_counting-v0", config={"min_animals": 9})
    assert harder.reset(seed=0)[0][-1]["content"].count(",") >= 7  # 9+ kinds of animal


def test_an_entry_is_the_same_in_another_process():
    code = (
        "import envhub, json; e = envhub.make('reasoning-gym/word_sorting-v0');"
        "print(json.dumps(e.reset(seed=5)[0]))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "123"},
        check=True,
    )
    here = envhub.make("reasoning-gym/word_sorting-v0").reset(seed=5)[0]
    assert json.loads(other.stdout.strip().splitlines()[-1]) == here


# ---- answers are never run as code (envhub/adapters/answer_guard.py) ------------------------
CODE_ANSWERS = {  # dataset -> an answer of the form its scorer reads, that runs code
    "spiral_matrix": "{write} or []",
    "string_insertion": "[{write}]",
    "binary_matrix": "[{write}]",
    "n_queens": "[{write}]",
    "countdown": "{write}",
    "puzzle24": "{write}",
    "polynomial_multiplication": "{write}",
    "simple_integration": "{write}",
    "intermediate_integration": "{write}",
}
REWARD_ONE = (  # patches the adapter's clipping so that any score reads 1
    "setattr(__import__('sys').modules['envhub.adapters.reasoning_gym'], 'min', lambda *a: 1.0)"
)


@pytest.mark.parametrize("name", sorted(CODE_ANSWERS))
def test_an_answer_is_never_run_as_code(name, tmp_path):
    """These datasets' scorers call ``eval`` or sympy's ``parse_expr`` on the answer: an answer
    that writes a file, or patches the adapter to score itself 1, does neither."""
    proof = tmp_path / "ran"
    write = f"__import__('pathlib').Path({str(proof)!r}).write_text('x')"
    env = envhub.make(f"reasoning-gym/{name}-v0")
    for answer in (CODE_ANSWERS[name].format(write=write), REWARD_ONE):
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step(f"<answer>{answer}</answer>")
        assert terminated and reward < 1.0 and not info["success"], (answer, reward)
    assert not proof.exists()
    env.reset(seed=0)
    assert env.step(f"<answer>{env.unwrapped.task['answer']}</answer>")[1] == 1.0


def test_an_unevaluated_integral_is_not_an_antiderivative():
    """sympy's ``Integral(f, x)`` differentiates back to ``f``: as an answer it would solve
    every integration task without integrating. The guard reads only arithmetic and named
    math functions."""
    env = envhub.make("reasoning-gym/simple_integration-v0")
    env.reset(seed=0)
    integrand = env.unwrapped.task["metadata"]["integrand"]
    variable = env.unwrapped.task["metadata"]["variable"]
    _, reward, *_ = env.step(f"<answer>Integral({integrand}, {variable}) + C</answer>")
    assert reward == 0.0
