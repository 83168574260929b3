"""``check_expert_episode`` judges the expert's play, not only its outputs: an expert whose
actions the env refuses, or whose episode ends without a success, is a bug in the env (its
parser, its scorer or its expert) that random play never shows."""

from __future__ import annotations

from envhub.checker import EXPERT_EPISODES, check_env
from tests.envhub import author_bugs


def failures(env_class: type) -> dict[str, str]:
    report = check_env(
        env_class(max_turns=6), factory=lambda: env_class(max_turns=6), raise_on_failure=False
    )
    return {r.name: r.message for r in report.failures}


def test_an_expert_whose_actions_the_env_refuses_fails_naming_the_step_and_the_feedback():
    found = failures(author_bugs.ExpertRefused)
    assert set(found) == {"check_expert_episode"}, found
    message = found["check_expert_episode"]
    assert "the expert's episode with seed=0" in message and "step 1" in message
    assert "refused as invalid" in message
    assert "I found no answer" in message  # the env's own feedback, to show why


def test_an_expert_whose_episode_ends_without_success_fails():
    found = failures(author_bugs.ExpertNeverWins)
    assert set(found) == {"check_expert_episode"}, found
    message = found["check_expert_episode"]
    assert f"seeds 0 to {EXPERT_EPISODES - 1} all ended without success" in message
    assert "reward 0, terminated: 'Out of luck.'" in message


def test_an_expert_that_loses_to_chance_on_the_first_seed_but_can_win_passes():
    env = author_bugs.ExpertLosesToChance(max_turns=6)
    env.reset(seed=0)
    assert not env.step(env.expert_action())[4]["success"]  # seed 0 is a loss
    assert failures(author_bugs.ExpertLosesToChance) == {}


def test_a_winning_expert_still_passes():
    report = check_env(author_bugs.Win(max_turns=6), factory=lambda: author_bugs.Win(max_turns=6))
    expert = next(r for r in report.results if r.name == "check_expert_episode")
    assert expert.passed and not expert.skipped
