"""A model opponent whose server takes the request and never answers: the step fails soon, as
"the opponent model failed", within a bound the env is given (and, by default, well within a
pool's step timeout, so a pool reports the opponent and not a generic worker timeout)."""

from __future__ import annotations

import inspect
import threading

import pytest

pytest.importorskip(
    "textarena", reason="needs the textarena extra: pip install 'envhub[textarena]'"
)

import envhub
from envhub.adapters.opponents import ModelOpponent
from envhub.adapters.textarena import TextArenaEnv
from envhub.errors import SourceConfigError, SourceError
from envhub.pool.pool import EnvPool
from envhub.server.config import HubConfig
from tests.envhub.openai_servers import completion, scripted_server


@pytest.mark.timeout(60)
def test_a_hung_opponent_model_fails_the_step_within_its_timeout():
    answer = threading.Event()

    def reply(body):
        answer.wait(30)  # hangs until the test ends
        return completion("[4]")

    with scripted_server(reply) as server:
        env = envhub.make(
            "textarena/TicTacToe-v0",
            opponent=server.url,
            opponent_timeout_s=0.5,
            opponent_retries=0,
        )
        env.reset(seed=0)
        try:
            with pytest.raises(SourceError) as failed:
                env.step("[4]")
        finally:
            answer.set()
            env.close()
    message = str(failed.value)
    assert "the opponent model at" in message and server.url in message
    assert "opponent_timeout_s=0.5" in message, "the message names the setting"
    assert len(server.requests) == 1, "opponent_retries=0: no second try"


def test_the_default_opponent_bound_is_below_the_pools_step_timeouts():
    """timeout x (retries + 1) stays below the step timeout of an EnvPool's and a hub's
    defaults, so a hung opponent fails as itself, not as a killed worker."""
    params = inspect.signature(TextArenaEnv).parameters
    timeout_s = params["opponent_timeout_s"].default
    retries = params["opponent_retries"].default
    pool_step_s = inspect.signature(EnvPool).parameters["step_timeout_s"].default
    hub_step_s = HubConfig.model_fields["step_timeout_s"].default
    assert timeout_s * (retries + 1) < min(pool_step_s, hub_step_s)
    model_params = inspect.signature(ModelOpponent).parameters
    assert model_params["timeout_s"].default == timeout_s
    assert model_params["retries"].default == retries
    assert "--step-timeout" in (inspect.getdoc(TextArenaEnv) or ""), "the docs say what to set"


def test_opponent_bounds_are_checked_when_the_env_is_made():
    with pytest.raises(SourceConfigError, match="opponent_timeout_s must be a positive number"):
        TextArenaEnv(game="TicTacToe-v0", players=2, opponent_timeout_s=0)
    with pytest.raises(SourceConfigError, match="opponent_retries must be an int >= 0"):
        TextArenaEnv(game="TicTacToe-v0", players=2, opponent_retries=-1)
