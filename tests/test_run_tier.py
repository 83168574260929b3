"""``make test`` runs the tier as two pytest processes (``tests/run_tier.py``): every test runs
once, in one of them, and a selection the user gives runs as given."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "run_tier", Path(__file__).resolve().parent / "run_tier.py"
)
assert spec is not None and spec.loader is not None
run_tier = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_tier)


def test_every_pattern_of_the_second_process_names_tests():
    """A renamed folder would leave its pattern matching nothing (its tests would then run in
    the first process, as before, but the split would drift unseen)."""
    for pattern in (*run_tier.BESIDE, *run_tier.ALONE):
        assert list(run_tier.ROOT.glob(pattern)), pattern
    assert not set(run_tier._paths(run_tier.ALONE)) & set(run_tier._beside())
    assert all(path.startswith("tests/") for path in run_tier._beside())


def test_a_selection_runs_as_one_pytest_and_options_alone_split():
    assert not run_tier._chooses_tests(["--durations=25", "-p", "no:cacheprovider"])
    assert not run_tier._chooses_tests(["-m", ""])  # make test-all
    assert run_tier._chooses_tests(["tests/envs/games"])
    assert run_tier._chooses_tests(["-k", "frozen"])
    assert run_tier._chooses_tests(["--lf"])
