"""The hub the bad-input tests attack (test_bad_input, test_client_limits, test_fuzz_messages).

A module that needs a hub set up otherwise (test_resume, test_games_over_hub) defines its own
``hub`` fixture, which overrides this one.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hub():
    """test/faulty-v0 on one worker, with small limits and short timeouts to run into."""
    from tests.envhub.server.badinput import bad_input_hub

    with bad_input_hub() as running:
        yield running
