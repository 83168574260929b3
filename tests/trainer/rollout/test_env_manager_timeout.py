"""``rollout.env_timeout_s`` bounds a local env whose ``step`` blocks (no ``await`` inside):
the episode ends as a recorded failure, is replaced, and nothing hangs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import envhub
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.groups import EpisodeSpec, run_episodes
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.trajectory import ChatRenderer
from trainer.strategies.hf_engine import HFEngine

HANG_GUARD_S = 300  # only stops a hung test; nothing here asserts on time
TIMEOUT_S = 0.5
RELEASE = threading.Event()  # set at the end of each test: lets the abandoned env threads finish


class BlockingEnv(envhub.TextEnv):
    """Two turns; on task seed 1 the first ``step`` blocks its thread (a plain blocking call,
    as a buggy env or a stuck subprocess read would)."""

    closed = 0

    def __init__(self) -> None:
        super().__init__(max_turns=10)
        self.seed_value = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[override]
        self.seed_value = int(seed or 0)
        return super().reset(seed=seed, options=options)

    def on_reset(self, options: dict[str, Any]):
        return f"Task {self.seed_value}.", {}

    def on_step(self, action: str) -> envhub.Turn:
        if self.seed_value == 1:
            RELEASE.wait(HANG_GUARD_S)
        return envhub.Turn("ok", reward=float(self.turn % 2), terminated=self.turn >= 2)

    def on_close(self) -> None:
        BlockingEnv.closed += 1


@pytest.fixture(autouse=True)
def release_blocked_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


def manager_for(policy, engine: Any) -> EnvManager:
    _, tokenizer = policy
    return EnvManager(
        engine,
        ChatRenderer(tokenizer),
        max_turns=4,
        max_context_tokens=1024,
        step_timeout_s=TIMEOUT_S,
    )


def make_engine(policy) -> HFEngine:
    model, tokenizer = policy
    return HFEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=0
    )


def run(coro):
    async def guarded():
        return await asyncio.wait_for(coro, HANG_GUARD_S)

    return asyncio.run(guarded())


def test_a_blocking_env_step_times_out_as_a_recorded_failure(policy) -> None:
    source = LocalEnvSource(make=lambda env_id, **kwargs: BlockingEnv(), threaded=True)
    specs = [EpisodeSpec("test/blocking-v0", seed, seed) for seed in (0, 1, 2)]
    finished, failed = run(
        run_episodes(
            specs, manager_for(policy, make_engine(policy)), source, Sampling(3), max_retries=1
        )
    )
    assert sorted(t.seed for t in finished) == [0, 2] and all(t.num_turns == 2 for t in finished)
    assert len(failed) == 2 and {t.seed for t in failed} == {1}  # the first try and its one replay
    assert all("rollout.env_timeout_s" in (t.failure or "") for t in failed)


def test_the_scheduler_replaces_a_group_whose_env_blocks(policy) -> None:
    router = EngineRouter([make_engine(policy)])
    source = LocalEnvSource(make=lambda env_id, **kwargs: BlockingEnv(), threaded=True)
    config = SchedulerConfig(
        num_groups=2, group_size=2, env_ids=("test/blocking-v0",), max_retries=1
    )
    scheduler = RolloutScheduler(config, manager_for(policy, router), router, source, Sampling(3))

    async def go():
        try:
            return await scheduler.next_batch()
        finally:
            await scheduler.close()

    batch = run(go())
    assert len(batch.trajectories) == 4
    assert {t.seed for t in batch.trajectories} == {0, 2}  # task 1 replaced
    assert batch.failed and all("rollout.env_timeout_s" in (t.failure or "") for t in batch.failed)
    assert batch.metrics["rollout/failed_groups"] == 1.0
