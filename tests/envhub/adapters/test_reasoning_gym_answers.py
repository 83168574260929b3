"""reasoning-gym answers are read and scored as reasoning-gym reads and scores them: long
answers, the library's own extraction, and the ids that can be built (composite from a plain
config, refused datasets not listed)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "reasoning_gym", reason="needs the reasoning-gym extra: pip install 'envhub[reasoning-gym]'"
)

import reasoning_gym
from reasoning_gym.utils import extract_answer

import envhub
from envhub.adapters.reasoning_gym import ReasoningGymEnv
from envhub.errors import SourceConfigError, SourceError

LONG = {"min_disks": 7, "max_disks": 8, "min_pegs": 3, "max_pegs": 3}
"""tower_of_hanoi with 7-8 disks on 3 pegs: 127-255 moves, every answer 4,000-8,200 characters."""


def library_score(name: str, index: int, text: str, size: int = 10) -> float:
    """What reasoning-gym itself pays for ``text`` on entry ``index`` (default config)."""
    dataset = reasoning_gym.create_dataset(name, seed=0, size=size)
    entry = dataset[index]
    return float(dataset.score_answer(extract_answer(text), entry))


def test_a_right_answer_of_thousands_of_characters_scores_one():
    env = envhub.make("reasoning-gym/tower_of_hanoi-v0", config=LONG, size=5)
    env.reset(seed=0)
    action = env.expert_action()
    assert action is not None and len(action) > 4_000
    _, reward, terminated, _, info = env.step(action)
    assert (reward, terminated, info["success"], info["invalid_action"]) == (1.0, True, True, False)


def test_envhub_check_passes_the_long_answer_dataset_with_its_expert_played():
    make = lambda: envhub.make("reasoning-gym/tower_of_hanoi-v0", config=LONG, size=5)
    report = envhub.check_env(make(), factory=make, raise_on_failure=False)
    expert = next(r for r in report.results if r.name == "check_expert_episode")
    assert report.ok, report.failures
    assert not expert.skipped


@pytest.mark.parametrize(
    ("name", "index"), [("leg_counting", 0), ("manipulate_matrix", 1), ("basic_arithmetic", 2)]
)
@pytest.mark.parametrize(
    "shape",
    [
        "<answer>{a}</answer>",
        "<ANSWER>{a}</ANSWER>",  # reasoning-gym's tags are lower case
        "<answer>{a}",  # never closed
        "<answer>```\n{a}\n```</answer>",  # a code fence is part of the answer
        "<answer>0</answer> no, wait: <answer>{a}</answer>",  # the last tag counts
        "<answer>\n{a}\n</answer>",
    ],
)
def test_an_answer_pays_what_reasoning_gym_pays(name, index, shape):
    env = envhub.make(f"reasoning-gym/{name}-v0", size=10)
    env.reset(seed=0, options={"task_index": index})
    text = shape.format(a=env.unwrapped.task["answer"])
    reward = env.step(text)[1]
    assert reward == pytest.approx(library_score(name, index, text))


def test_lenient_reading_is_an_option_and_off_by_default():
    strict = envhub.make("reasoning-gym/leg_counting-v0", size=10)
    lenient = envhub.make("reasoning-gym/leg_counting-v0", size=10, parse="lenient")
    for env in (strict, lenient):
        env.reset(seed=0, options={"task_index": 0})
    answer = strict.unwrapped.task["answer"]
    _, reward, _, _, info = strict.step(f"<ANSWER>{answer}</ANSWER>")
    assert (reward, info["invalid_action"]) == (0.0, True)
    assert lenient.step(f"<ANSWER>{answer}</ANSWER>")[1] == 1.0
    with pytest.raises(SourceConfigError, match="parse must be 'reasoning-gym'.*'lenient'"):
        envhub.make("reasoning-gym/leg_counting-v0", parse="loose")


def test_an_answer_given_only_while_thinking_is_not_graded():
    """envhub's one rule on top of reasoning-gym's reading: thinking is never the answer."""
    env = envhub.make("reasoning-gym/leg_counting-v0", size=10)
    env.reset(seed=0, options={"task_index": 0})
    answer = env.unwrapped.task["answer"]
    _, reward, _, _, info = env.step(f"<think>maybe <answer>{answer}</answer></think>")
    assert (reward, info["invalid_action"]) == (0.0, True)


def test_a_composite_is_built_from_a_plain_config_as_yaml_and_the_cli_give_it():
    config = {
        "datasets": [
            {"name": "leg_counting", "weight": 2, "config": {"min_animals": 2}},
            {"name": "basic_arithmetic"},  # weight 1 and the dataset's default config
        ]
    }
    env = envhub.make("reasoning-gym/composite-v0", config=config, size=10)
    seen = set()
    for index in range(10):
        env.reset(options={"task_index": index})
        seen.add(env.unwrapped.task["metadata"]["source_dataset"])
        assert env.step(env.expert_action())[1] == 1.0
    assert seen == {"leg_counting", "basic_arithmetic"}


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({}, "needs the datasets it mixes, config={'datasets'"),
        ({"datasets": [{"nme": "leg_counting"}]}, r"datasets\[0\] has no field 'nme'"),
        ({"datasets": [42]}, r"datasets\[0\] must be a dict"),
        ({"datasets": [{"weight": 1}]}, r"datasets\[0\] needs a dataset's name"),
        ({"datasets": "leg_counting"}, "datasets must be a list"),
        ({"datasets": [{"name": "leg_counting", "weight": -1}]}, "Weight must be positive"),
    ],
)
def test_a_composite_config_that_cannot_work_names_the_format(config, problem):
    with pytest.raises(SourceConfigError, match=problem) as raised:
        envhub.make("reasoning-gym/composite-v0", config=config)
    assert "{'name': " in str(raised.value)  # the format, shown


def test_refused_datasets_are_not_listed_and_still_say_why_when_built():
    ids = {spec.id for spec in envhub.list_envs("reasoning-gym")}
    assert "reasoning-gym/leg_counting-retry-v0" in ids
    assert not {i for i in ids if "propositional_logic" in i}, "a refused dataset is listed"
    composite = envhub.spec("reasoning-gym/composite-v0")
    assert "config={'datasets'" in composite.description
    with pytest.raises(SourceError, match="copied premise.*syllogism"):
        ReasoningGymEnv(name="propositional_logic")
