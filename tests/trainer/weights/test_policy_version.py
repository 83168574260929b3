"""One policy version per run: ``PolicyVersion`` is advanced by whoever applies updates, read by all
others."""

from __future__ import annotations

import pytest

from trainer.strategies.batching import BatchingFrontend
from trainer.weights.versioned import PolicyVersion


def test_a_front_handed_the_runs_version_reports_what_the_owner_advanced() -> None:
    policy = PolicyVersion()
    front = BatchingFrontend(policy=policy)
    assert front.version == 0
    policy.advance()
    policy.advance()
    assert front.version == 2  # no copy to keep in step: the front reads the one counter
    with pytest.raises(AttributeError, match=r"policy.restore"):
        front.version = (
            5  # nobody keeps or writes a copy: the owner advances or restores the one counter
        )
    assert policy.value == 2


def test_restore_continues_from_a_checkpoints_version() -> None:
    policy = PolicyVersion()
    policy.restore(41)
    assert policy.advance() == 42 and policy.value == 42


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_a_value_that_is_not_a_version_is_refused_with_what_to_pass(bad: object) -> None:
    with pytest.raises(ValueError, match=r"whole number >= 0, got .*checkpoint"):
        PolicyVersion().restore(bad)  # type: ignore[arg-type]
