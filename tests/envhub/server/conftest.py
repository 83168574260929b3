"""The hub the bad-input tests attack (test_bad_input, test_client_limits, test_fuzz_messages).

A module that needs a hub set up otherwise (test_resume, test_games_over_hub) defines its own
``hub`` fixture, which overrides this one.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hub():
    """test/faulty-v0 on one worker, with small limits and short timeouts to run into."""
    from tests.envhub.server.badinput import LIMIT
    from tests.envhub.server.hubtools import running_hub

    with running_hub(
        envs=["test/faulty-v0"],
        workers=1,
        max_sessions=6,
        max_sessions_per_client=4,
        max_message_bytes=LIMIT,
        hello_timeout_s=0.5,
        grace_s=0.3,
        reset_wait_s=1.0,
        request_timeout_s=1.0,
    ) as running:
        yield running
