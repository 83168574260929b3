"""The checker plays the episodes real use plays: the expert's, far seeds, reused and fresh envs,
and a new Python process; each env here hides one bug from random play on seeds 0 to 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import envhub
import envhub.registry
from envhub.check_workers import check_ids
from envhub.checker import check_env
from envhub.cli import main
from envhub.registry import Registry
from tests.envhub import author_bugs
from tests.helpers import CountdownEnv

BUGS = "tests.envhub.author_bugs"


def failures(env_class: type) -> dict[str, str]:
    report = check_env(
        env_class(max_turns=6), factory=lambda: env_class(max_turns=6), raise_on_failure=False
    )
    return {r.name: r.message for r in report.failures}


def test_a_well_behaved_env_with_an_expert_passes_every_check():
    report = check_env(author_bugs.Win(max_turns=6), factory=lambda: author_bugs.Win(max_turns=6))
    assert report.ok, report.failures
    names = [r.name for r in report.results if not r.skipped]
    assert {"check_expert_episode", "check_more_seeds"} <= set(names)


def test_an_env_that_raises_only_on_the_experts_winning_turn_fails():
    found = failures(author_bugs.RaisesOnWin)
    assert set(found) == {"check_expert_episode"}, found
    message = found["check_expert_episode"]
    assert "the expert's episode with seed=0" in message
    assert "KeyError: 'best'" in message and "step 1" in message


@pytest.mark.parametrize(
    "env_class, problem",
    [
        (author_bugs.NumpyInfoOnWin, "the step() info is not JSON-serialisable"),
        (author_bugs.BadObservationOnWin, "step() observation is not a list of chat messages"),
    ],
)
def test_bad_output_on_the_experts_winning_turn_fails(env_class, problem):
    found = failures(env_class)
    assert set(found) == {"check_expert_episode"}, found
    assert problem in found["check_expert_episode"]


def test_an_env_that_breaks_on_the_trainers_far_eval_seeds_fails_naming_the_seed():
    found = failures(author_bugs.RaisesOnFarSeeds)
    assert "check_more_seeds" in found, found
    assert "seed=1000000000" in found["check_more_seeds"]
    assert "RuntimeError: boom on an evaluation seed" in found["check_more_seeds"]


def test_an_env_whose_episodes_depend_on_the_ones_before_fails_determinism():
    found = failures(author_bugs.LeaksAcrossEpisodes)
    assert "check_seed_determinism" in found, found
    message = found["check_seed_determinism"]
    assert "after an episode with seed=1" in message
    assert "reset every per-episode field in on_reset" in message


def test_an_env_that_keeps_its_first_task_fails_fresh_against_reused():
    """Seed 1 alone is one task; seed 1 after seed 0 on the same object is another (the
    review's lab/leak-v0, which eval and pools reuse)."""
    found = failures(author_bugs.FirstTaskSticks)
    assert "check_seed_determinism" in found, found
    message = found["check_seed_determinism"]
    assert "seed=1 on a fresh env" in message and "after seed=0" in message


def test_without_a_factory_the_fresh_env_comparison_is_left_out_but_reuse_is_still_checked():
    report = check_env(author_bugs.LeaksAcrossEpisodes(max_turns=6), raise_on_failure=False)
    assert "check_seed_determinism" in {r.name for r in report.failures}
    assert check_env(CountdownEnv()).ok


def test_check_env_without_a_registered_id_skips_the_new_process_check():
    report = check_env(CountdownEnv(), factory=CountdownEnv)
    [result] = [r for r in report.results if r.name == "check_new_process"]
    assert result.skipped and "envhub check" in result.message


@pytest.fixture
def bug_ids(monkeypatch):
    """The author_bugs envs registered as a plugin named in ENVHUB_PLUGINS, so a new Python
    process (the checker's cross-process check) registers them too."""
    monkeypatch.setenv("ENVHUB_PLUGINS", f"{BUGS}:register")
    registry = Registry()
    monkeypatch.setattr(envhub.registry, "registry", registry)
    return registry


@pytest.mark.timeout(120)
def test_envhub_check_fails_an_env_that_differs_in_a_new_process_with_another_hash_seed(bug_ids):
    result = CliRunner().invoke(main, ["check", "--no-gymnasium", "bugs/hash-v0", "bugs/win-v0"])
    assert result.exit_code == 1, result.output
    assert "1 of 2 environment(s) failed: bugs/hash-v0" in result.output
    block = result.output.split("bugs/hash-v0\n", 1)[1].split("bugs/win-v0")[0]
    assert "✗ check_new_process" in block
    assert "PYTHONHASHSEED" in block and "sorted(" in block


@pytest.mark.timeout(120)
def test_an_id_registered_only_in_this_process_skips_the_new_process_check(
    fresh_registry, monkeypatch
):
    fresh_registry.register("bugs/local-v0", author_bugs.Win, max_turns=6)  # a class: no path
    monkeypatch.setattr(envhub.registry, "registry", fresh_registry)
    [report] = list(check_ids(["bugs/local-v0"], jobs=1, timeout=60, gymnasium_checks=False))
    assert report.ok, report.failures
    [result] = [r for r in report.results if r.name == "check_new_process"]
    assert result.skipped and "registered only in this process" in result.message


@pytest.mark.timeout(120)
def test_the_new_process_check_runs_once_per_entry_point(bug_ids):
    """Variants share their entry point's code: ``envhub check --all`` starts one new process
    per entry point, not per id (the checker's runtime is part of the test suite)."""
    ids = ["bugs/fam-v0", "bugs/fam-a-v0", "bugs/fam-b-v0"]
    reports = list(check_ids(ids, jobs=1, timeout=60, gymnasium_checks=False))
    assert all(r.ok for r in reports), [r.failures for r in reports]
    results = {
        r.env_name: next(x for x in r.results if x.name == "check_new_process") for r in reports
    }
    assert {i: r.skipped for i, r in results.items()} == {
        "bugs/fam-v0": False,
        "bugs/fam-a-v0": True,
        "bugs/fam-b-v0": True,
    }
    assert "bugs/fam-v0 shares this id's code" in results["bugs/fam-b-v0"].message
