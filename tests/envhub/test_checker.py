"""check_env: passes envs that keep the contract; names the problem and the fix otherwise."""

from __future__ import annotations

import random
import threading

import pytest

import envhub
from envhub.checker import CHECKS, check_env
from envhub.errors import EnvCheckError
from tests.helpers import CountdownEnv


def failures(env, **kwargs) -> dict[str, str]:
    report = check_env(env, raise_on_failure=False, **kwargs)
    return {r.name: r.message for r in report.failures}


def test_a_good_env_passes_every_check():
    report = check_env(CountdownEnv(), factory=CountdownEnv)
    assert report.ok
    assert [r.name for r in report.results] == [c.__name__ for c in CHECKS]
    # no expert to play, and no registered id for a new process to build
    skipped = [r.name for r in report.results if r.skipped]
    assert skipped == ["check_new_process", "check_expert_episode"]


def test_without_a_factory_the_fresh_env_check_is_skipped():
    report = check_env(CountdownEnv())
    skipped = [r.name for r in report.results if r.skipped]
    assert skipped == ["check_step_before_reset", "check_new_process", "check_expert_episode"]


class Nondeterministic(CountdownEnv):
    def on_reset(self, options):
        return f"Secret {random.random()}", {}


class RaisesOnBadText(CountdownEnv):
    def on_step(self, action):
        if action.strip() != "go":
            raise ValueError(f"unknown action {action!r}")
        return super().on_step(action)


class NeverEnds(CountdownEnv):
    def on_step(self, action):
        return envhub.Turn("again")


class Unpicklable(CountdownEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lock = threading.Lock()


class AcceptsStepsAfterEnd(CountdownEnv):
    def step(self, action):
        if self.done:
            return (
                [{"role": "user", "content": "still here"}],
                0.0,
                True,
                False,
                {"turn": 0, "success": False},
            )
        return super().step(action)


class CopyPlaysOtherwise(CountdownEnv):
    """Pickles, but the copy's observations differ (it lost the original's goal word)."""

    def __setstate__(self, state):
        self.__dict__.update(state, goal="stop")


class NotJson(CountdownEnv):
    def on_step(self, action):
        return envhub.Turn("ok", terminated=True, info={"raw": object()})


class FailsToClose(CountdownEnv):
    def close(self):
        raise OSError("socket already closed")


@pytest.mark.parametrize(
    "env, check, fix",
    [
        (
            Nondeterministic(),
            "check_seed_determinism",
            "draw every random choice from self.np_random",
        ),
        (
            RaisesOnBadText(),
            "check_step",
            "answer malformed text with self.invalid_action(feedback) instead of raising",
        ),
        (NeverEnds(max_turns=None), "check_episode_ends", "register the env with max_turns=N"),
        (Unpicklable(), "check_picklable", "implement __getstate__/__setstate__"),
        (CopyPlaysOtherwise(), "check_picklable", "the unpickled copy plays a different episode"),
        (AcceptsStepsAfterEnd(), "check_step_after_end", "refuse it"),
        (NotJson(), "check_step", "is not JSON-serialisable"),
        (FailsToClose(), "check_close_twice", "make close() idempotent"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.startswith("check") else None,
)
def test_each_broken_env_fails_the_right_check_with_its_fix(env, check, fix):
    found = failures(env)
    assert check in found, found
    assert fix in found[check]


def test_check_env_raises_one_error_listing_every_problem():
    with pytest.raises(EnvCheckError) as caught:
        check_env(RaisesOnBadText())
    error = caught.value
    assert str(error).startswith(
        f"RaisesOnBadText failed {len(error.problems)} check(s):\n"
        "  - check_step: step('') raised ValueError"
    )
    assert len(error.problems) >= 2


def test_things_that_are_not_envs_stop_after_the_first_check():
    report = check_env(object(), raise_on_failure=False)
    assert [r.name for r in report.results] == ["check_spaces"]
    assert "subclass envhub.TextEnv" in report.results[0].message


def test_an_env_that_fails_the_first_check_is_still_closed():
    """``check_env`` closes the env it was given, also when it stops after ``check_spaces``
    (an env holding a browser or a sandbox would leak it)."""

    class WrongSpaces(CountdownEnv):
        closed = 0

        def close(self):
            type(self).closed += 1
            super().close()

    env = WrongSpaces()
    env.observation_space = None  # (forgot super().__init__(), say)
    report = check_env(env, raise_on_failure=False)
    assert [r.name for r in report.results] == ["check_spaces"] and not report.ok
    assert WrongSpaces.closed == 1


def test_gymnasium_checks_can_be_skipped():
    names = [r.name for r in check_env(CountdownEnv(), gymnasium_checks=False).results]
    assert "check_gymnasium" not in names


def test_the_checker_plays_no_episode_it_has_already_seen(monkeypatch):
    """A web env's random episode costs seconds: the pickle check compares the copy with the
    determinism check's episode, and the step-after-end check uses the episode
    ``check_episode_ends`` just ended, instead of playing them again."""
    from envhub import checker

    played: list[int] = []
    play = checker._play

    def counted(ctx, env, seed, *args):
        played.append(seed)
        return play(ctx, env, seed, *args)

    monkeypatch.setattr(checker, "_play", counted)
    assert check_env(CountdownEnv(), factory=CountdownEnv, seed=10).ok
    # the determinism check's seed, another seed, the seed again and the other seed on a fresh
    # env (the one that must end, too), then the pickled copy's
    assert played == [10, 11, 10, 11, 10], played
