"""What every registered game promises: contract, determinism, robust parsing, success."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

import envhub
from envhub.evaluation import AGENTS, run_episode

GAME_IDS = [spec.id for spec in envhub.list_envs("games")]
FAMILIES = [spec.id for spec in envhub.list_envs("games", variants=False)]


def test_at_least_four_game_families():
    assert len(FAMILIES) >= 4


@pytest.mark.parametrize("env_id", GAME_IDS)
def test_game_passes_the_checker(env_id):
    spec = envhub.spec(env_id)
    report = envhub.check_env(spec.make(), factory=spec.make, raise_on_failure=False)
    assert report.ok, [f"{r.name}: {r.message}" for r in report.failures]


def expert_transcript(env, seed: int) -> str:
    """Everything seen in one expert episode (hidden state shows up through the hints)."""
    seen = [env.reset(seed=seed)[0]]
    while not env.done:
        seen.append(env.step(env.expert_action())[:4])
    return json.dumps(seen)


@pytest.mark.parametrize("env_id", FAMILIES)
def test_same_seed_same_game_and_seeds_vary(env_id):
    env = envhub.make(env_id)
    assert expert_transcript(env, 11) == expert_transcript(env, 11)
    assert len({expert_transcript(env, s) for s in range(6)}) > 1


@pytest.mark.parametrize("env_id", FAMILIES)
def test_garbage_text_is_penalised_and_explained_never_raised(env_id):
    env = envhub.make(env_id)
    env.reset(seed=0)
    for text in ["", "<answer>definitely not a move</answer>", "\x00\x01\x02", "💥" * 500]:
        messages, reward, terminated, truncated, info = env.step(text)
        assert info["invalid_action"] is True, text
        assert reward < 0
        assert "<answer>" in messages[-1]["content"], "feedback should restate the action format"
        if terminated or truncated:
            env.reset(seed=0)


@pytest.mark.parametrize("env_id", FAMILIES)
def test_chatty_expert_actions_parse(env_id):
    env = envhub.make(env_id)
    env.reset(seed=2)
    action = env.expert_action()
    assert action is not None, f"{env_id} has no expert"
    chatty = (
        "Let me think step by step about this state.\nI am fairly sure now.\n"
        f"{action}\nThat should work!"
    )
    _, _, _, _, info = env.step(chatty)
    assert info["invalid_action"] is False


@pytest.mark.parametrize("env_id", FAMILIES)
def test_expert_beats_random_and_reports_success(env_id):
    env = envhub.make(env_id)
    expert = [run_episode(env, AGENTS["expert"], seed=s) for s in range(10)]
    random = [run_episode(env, AGENTS["random"], seed=s) for s in range(10)]
    assert sum(e.success for e in expert) >= 8
    assert sum(e.episode_return for e in expert) > sum(e.episode_return for e in random)


@pytest.mark.parametrize("env_id", FAMILIES)
def test_sampled_actions_are_mostly_valid_and_never_raise(env_id):
    env = envhub.make(env_id)
    rng = np.random.default_rng(0)
    invalid = 0
    env.reset(seed=0)
    for _ in range(200):
        _, reward, terminated, truncated, info = env.step(env.sample_action(rng))
        assert isinstance(reward, float)
        invalid += info["invalid_action"]
        if terminated or truncated:
            env.reset(seed=int(rng.integers(1000)))
    assert 5 <= invalid <= 100, "random agents should see both valid and invalid actions"


@pytest.mark.parametrize("env_id", FAMILIES)
def test_pickle_round_trip_mid_episode(env_id):
    env = envhub.make(env_id)
    env.reset(seed=6)
    env.step(env.expert_action())
    clone = pickle.loads(pickle.dumps(env))
    action = env.expert_action()
    assert clone.step(action) == env.step(action)
