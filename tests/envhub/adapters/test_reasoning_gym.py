"""reasoning-gym datasets as envhub task envs: contract, scoring, tasks, config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import pytest

pytest.importorskip(
    "reasoning_gym", reason="needs the reasoning-gym extra: pip install 'envhub[reasoning-gym]'"
)

import envhub
from envhub.adapters.answer_guard import check_expression
from envhub.errors import SourceConfigError, SourceError
from envs.datasets import TaskSet
from tests.envhub.adapters.sweep import failing

SAMPLE = ["leg_counting", "basic_arithmetic", "word_sorting", "maze", "letter_counting"]
"""Checked in the default tier (fast); test_every_dataset_that_loads_offline_passes checks all."""

NOT_OFFLINE = {"composite": "needs config={'datasets': ...} naming the datasets it mixes"}
"""Listed datasets that fail `envhub check` as listed (propositional_logic is not listed)."""


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
    assert len(datasets) - len(failed) == 102


def test_the_expert_answer_scores_one_and_a_wrong_one_is_told_it_is_wrong():
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
    assert "score" not in messages[0]["content"]  # no closeness to search by
    _, reward, terminated, _, info = retry.step("no tags at all")
    assert info["invalid_action"] and not terminated
    _, reward, terminated, _, info = retry.step(retry.expert_action())
    assert (reward, terminated, info["success"]) == (pytest.approx(1 / 3), True, True)


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


# ---- an answer cannot stall the scorer (ReasoningGymEnv.score_time_limit_s) -----------------
def _step_within(env: Any, action: str, seconds: float = 60.0) -> Any:
    """``env.step(action)`` from a thread: the test fails past ``seconds`` instead of hanging."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(env.step(action)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"the step did not return within {seconds} s"
    return result[0]


def test_an_answer_whose_check_never_ends_scores_zero_and_the_check_is_stopped():
    """Every exponent is small, so answer_guard admits this antiderivative, but sympy.simplify
    never finishes its derivative: the check is killed at score_time_limit_s, the answer scores
    0 with feedback saying why, and the next answer is checked by a fresh helper."""
    env = envhub.make("reasoning-gym/simple_integration-v0")
    env.reset(seed=1)
    assert env.step(env.expert_action())[1] == 1.0
    helper = env.unwrapped.scoring.pid
    env.reset(seed=0)
    variable = env.unwrapped.task["metadata"]["variable"]
    slow = "*".join(f"({variable}+{k})**1000" for k in range(1, 5))
    messages, reward, terminated, _, info = _step_within(env, f"<answer>{slow}</answer>")
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    assert "took too long to check" in messages[0]["content"]
    with pytest.raises(ProcessLookupError):  # killed and reaped: it burns no more CPU
        os.kill(helper, 0)
    env.reset(seed=1)
    assert env.step(env.expert_action())[1] == 1.0


def test_a_retry_after_a_check_that_ran_out_of_time_is_told_why():
    env = envhub.make("reasoning-gym/simple_integration-retry-v0")
    env.reset(seed=0)
    variable = env.unwrapped.task["metadata"]["variable"]
    slow = "*".join(f"({variable}+{k})**1000" for k in range(1, 5))
    messages, reward, terminated, _, _ = _step_within(env, f"<answer>{slow}</answer>")
    assert (reward, terminated) == (0.0, False)
    assert "took too long to check" in messages[0]["content"]
    assert "2 attempt(s) left" in messages[0]["content"]
    assert env.step(env.expert_action())[1] == 0.5  # the second attempt earns half


@pytest.mark.parametrize(
    ("name", "answer"),
    [("countdown", "(((9**999)**999)**999)"), ("puzzle24", "9**(999*999*999)")],
)
def test_an_answer_that_builds_a_huge_number_scores_as_a_wrong_one(name, answer):
    """sympy would compute these integers (~10**9 digits) eagerly in the scorer; the guard
    refuses them before, so they score as unreadable answers (0.01: these scorers give a
    little for the format), with no wait for the time limit."""
    env = envhub.make(f"reasoning-gym/{name}-v0")
    env.reset(seed=0)
    _, reward, terminated, _, info = _step_within(env, f"<answer>{answer}</answer>")
    assert (reward, terminated, info["success"], info["check_timed_out"]) == (
        0.01,
        True,
        False,
        False,
    )


def test_the_guard_refuses_powers_that_multiply_past_the_exponent_limit():
    for text in ("((9**999)**999)**999", "(9**999)**2", "9**(999*999*999)", "x**(500+501)"):
        with pytest.raises(ValueError, match="exponents are at most 1000"):
            check_expression(text, names=["x"])
    for text in ("(x**2)**3", "x**(2*3)", "9**999", "(x**2 + 1)**10", "(x**n)**2", "2**-3"):
        check_expression(text, names=["x", "n"])


def test_the_time_limit_is_an_option_that_names_its_values():
    for wrong in (0, float("nan"), 10**6):
        with pytest.raises(SourceConfigError, match="score_time_limit_s must be > 0 and at most"):
            envhub.make("reasoning-gym/leg_counting-v0", score_time_limit_s=wrong)
    env = envhub.make("reasoning-gym/leg_counting-v0", score_time_limit_s=None)  # in-process
    env.reset(seed=0)
    assert env.step(env.expert_action())[1] == 1.0 and env.unwrapped.scoring is None


def test_a_task_the_scoring_process_cannot_receive_names_the_fix():
    env = envhub.make("reasoning-gym/leg_counting-v0")
    task = {"question": "How many legs do 2 cats have?", "answer": "8", "metadata": {}}
    env.reset(options={"task": {**task, "metadata": {"hint": lambda: 8}}})
    with pytest.raises(SourceError, match="make its fields plain data"):
        env.step("<answer>8</answer>")


# ---- scorers that gave success to junk (answer_guard.SCORE_FIXES) ----------------------------
JUNK = {  # dataset -> answers its own scorer scored 1 on every task
    "game_of_life_halting": ["banana", "False if it halts", "0"],
    "complex_arithmetic": ["nan", "NaN", "nan + 1i", "1 + nani"],
}


@pytest.mark.parametrize("name", sorted(JUNK))
def test_junk_scores_zero_and_the_right_answer_still_scores_one(name):
    env = envhub.make(f"reasoning-gym/{name}-v0", size=40)
    for index in range(40):
        for junk in JUNK[name]:
            env.reset(options={"task_index": index})
            assert env.step(f"<answer>{junk}</answer>")[1] == 0.0, (index, junk)
        env.reset(options={"task_index": index})
        assert env.step(env.expert_action())[4]["success"], index


def test_the_other_truth_value_does_not_answer_a_halting_question():
    env = envhub.make("reasoning-gym/game_of_life_halting-v0", size=20)
    for index in range(20):
        env.reset(options={"task_index": index})
        answer = env.unwrapped.task["answer"]
        other = {"True": "False", "False": "True"}[answer]
        assert env.step(f"<answer>{other}</answer>")[1] == 0.0
        env.reset(options={"task_index": index})
        assert env.step(f"<answer> {answer.lower()} </answer>")[1] == 1.0


def test_propositional_logic_is_refused_with_the_reason():
    """Its scorer gives 1 to any valid conclusion; a premise copied back is one, and so are
    the dataset's own reference answers a third of the time: no rule separates them."""
    with pytest.raises(SourceError, match="copied premise.*syllogism"):
        envhub.make("reasoning-gym/leg_counting-v0", name="propositional_logic")


def test_a_composite_scores_each_entry_as_the_dataset_it_came_from_would(tmp_path):
    """A composite's scorer hands each entry to its own dataset's: that dataset's guard and
    fix apply as they do alone, and a refused dataset cannot be mixed in."""
    from reasoning_gym.composite import DatasetSpec

    def mix(*names: str) -> dict[str, Any]:
        return {"datasets": [DatasetSpec(name=name, weight=1.0, config={}) for name in names]}

    proof = tmp_path / "ran"
    write = f"__import__('pathlib').Path({str(proof)!r}).write_text('x')"
    junk = {"countdown": write, "game_of_life_halting": "banana"}
    env = envhub.make("reasoning-gym/composite-v0", config=mix(*junk), size=20)
    seen = set()
    for index in range(20):
        env.reset(options={"task_index": index})
        source = env.unwrapped.task["metadata"]["source_dataset"]
        seen.add(source)
        assert env.step(f"<answer>{junk[source]}</answer>")[1] < 0.1, source
        env.reset(options={"task_index": index})
        assert env.step(env.expert_action())[1] == 1.0
    assert seen == set(junk) and not proof.exists()
    with pytest.raises(SourceError, match="propositional_logic is not offered"):
        envhub.make("reasoning-gym/composite-v0", config=mix("countdown", "propositional_logic"))


@pytest.mark.parametrize(
    ("name", "answers"),
    [("course_schedule", ["True", "False"]), ("acre", ["on", "off", "undetermined"])],
)
def test_trying_every_answer_in_the_retry_variant_earns_less_than_answering_right(name, answers):
    """With 2-3 possible answers, three attempts cover them all: a success at attempt k pays
    1/k, so enumerating earns less than answering right at once (0.75 on yes/no), not 1."""
    env = envhub.make(f"reasoning-gym/{name}-retry-v0")
    returns = []
    for seed in range(20):
        env.reset(seed=seed)
        done, ret, attempt = False, 0.0, 0
        while not done:
            _, reward, terminated, truncated, info = env.step(
                f"<answer>{answers[attempt % len(answers)]}</answer>"
            )
            attempt, ret, done = attempt + 1, ret + reward, terminated or truncated
        assert info["success"] and ret == pytest.approx(1 / attempt)
        returns.append(ret)
    assert sum(returns) / len(returns) < 0.8
    single = envhub.make(f"reasoning-gym/{name}-v0")  # one attempt: the dataset's score
    single.reset(seed=0)
    assert single.step(single.expert_action())[1] == 1.0


def test_success_only_reward_pays_nothing_to_a_close_constant_answer():
    """time_intervals scores closeness: the constant '04:00' earns most of the reward on time
    questions. reward='success' pays 1 for a full-score answer and 0 otherwise."""
    default = envhub.make("reasoning-gym/time_intervals-v0", size=60)
    strict = envhub.make("reasoning-gym/time_intervals-v0", size=60, reward="success")
    constant, strict_constant = [], []
    for index in range(60):
        for env, into in ((default, constant), (strict, strict_constant)):
            env.reset(seed=0, options={"task_index": index})
            if env.unwrapped.task["metadata"]["task_type"].startswith("time"):
                into.append(env.step("<answer>04:00</answer>")[1])
    assert sum(constant) / len(constant) > 0.5  # the dataset's own score stays the default
    assert strict_constant and set(strict_constant) == {0.0}
    strict.reset(seed=0, options={"task_index": 3})
    _, reward, _, _, info = strict.step(strict.expert_action())
    assert (reward, info["success"]) == (1.0, True)
    with pytest.raises(SourceConfigError, match="reward must be"):
        envhub.make("reasoning-gym/time_intervals-v0", reward="binary")
