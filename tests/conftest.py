"""Shared fixtures: small envs that keep (or deliberately break) the TextEnv contract."""

from __future__ import annotations

import pytest

from envhub.registry import Registry
from tests.helpers import CountdownEnv


@pytest.fixture
def countdown() -> CountdownEnv:
    return CountdownEnv()


@pytest.fixture
def fresh_registry() -> Registry:
    """A registry with no discovery, for tests that register their own ids."""
    return Registry(discover=False)
