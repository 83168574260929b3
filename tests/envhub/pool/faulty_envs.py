"""Envs that misbehave on command, for pool and hub tests (importable by worker processes).

``FaultyEnv`` echoes its action and counts turns, except: ``crash`` exits the process,
``hang`` sleeps forever, ``raise`` raises, ``sleep:S`` sleeps S seconds first, and
``win`` ends the episode with success.
"""

from __future__ import annotations

import os
import time

from envhub.core import TextEnv, Turn
from envhub.registry import EnvSpec

FAULTY = EnvSpec(
    id="test/faulty-v0", entry_point="tests.envhub.pool.faulty_envs:FaultyEnv", max_turns=50
)
NOOP = EnvSpec(
    id="test/noop-v0", entry_point="tests.envhub.pool.faulty_envs:NoopEnv", max_turns=1_000_000
)


class FaultyEnv(TextEnv):
    def __init__(self, **kwargs):
        # the pool and hub tests send actions of megabytes through sockets and frames
        kwargs.setdefault("action_max_length", 10_000_000)
        super().__init__(**kwargs)

    def on_reset(self, options):
        self.secret = int(self.np_random.integers(0, 1_000_000))
        return f"secret {self.secret} pid {os.getpid()}", {"pid": os.getpid()}

    def on_step(self, action):
        if action == "crash":
            os._exit(3)
        if action == "hang":
            time.sleep(3600)
        if action == "raise":
            raise RuntimeError("the env broke on purpose")
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))
        if action == "win":
            return Turn("won", reward=1.0, terminated=True, success=True)
        return Turn(f"echo {action}", reward=0.5, info={"pid": os.getpid()})


class NoopEnv(TextEnv):
    """The cheapest possible env: for throughput measurements."""

    def on_reset(self, options):
        return "ok", {}

    def on_step(self, action):
        return Turn("ok")


def register() -> None:
    """Register both ids in the shared registry (hub tests serve them by id)."""
    from envhub.registry import register as reg

    reg(FAULTY.id, FAULTY.entry_point, max_turns=FAULTY.max_turns)
    reg(NOOP.id, NOOP.entry_point, max_turns=NOOP.max_turns)
