"""``EnvManager`` against hostile envs: resets that fail or time out in a pool must not leave
their episode there, and an env whose output is malformed (a NaN reward, info that is not a
dict) fails its episode, naming the env and the field, instead of raising or training on it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")

from tests.envhub.pool import hostile_envs
from tests.envhub.pool.hostile_envs import HOSTILE, RAW, RawEnv
from tests.trainer.rollout.sim_workload import FAST, engines, manager
from trainer.rollout.env_manager import LocalEnvSource, PoolEnvSource, Sampling
from trainer.rollout.groups import EpisodeSpec, play_episode
from trainer.rollout.router import EngineRouter


def run(coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(autouse=True, scope="module")
def _ids() -> None:
    hostile_envs.register()


async def play(source: Any, env_id: str, seed: int = 0, **options: Any) -> Any:
    return await play_episode(
        manager(EngineRouter(engines(1, cost=FAST)), **options),
        source,
        EpisodeSpec(env_id, seed, 0),
        Sampling(8),
        max_retries=0,
    )


def test_failed_resets_in_a_pool_leave_no_episode_behind() -> None:
    async def main() -> None:
        source = PoolEnvSource({"reset_raise": True}, num_workers=1, step_timeout_s=30)
        try:
            for seed in range(5):
                trajectory = await play(source, HOSTILE.id, seed)
                assert trajectory.failed and "bad task" in trajectory.failure
            assert source._pools[HOSTILE.id].stats().episodes == 0
        finally:
            await source.aclose()

    run(main())


def test_a_reset_past_the_env_timeout_leaves_no_episode_behind() -> None:
    """The manager gives up on a slow reset (``rollout.env_timeout_s``) before the pool does."""

    async def main() -> None:
        source = PoolEnvSource({"reset_sleep": 1.5}, num_workers=1, step_timeout_s=30)
        try:
            trajectory = await play(source, HOSTILE.id, step_timeout_s=0.2)
            assert trajectory.failed and "no answer within 0.2 s" in trajectory.failure
            assert source._pools[HOSTILE.id].stats().episodes == 0
        finally:
            await source.aclose()

    run(main())


@pytest.mark.parametrize(
    "bad, field",
    [
        ("reward_nan", "reward=nan"),
        ("reward_none", "reward=None"),
        ("reward_huge", "reward=1e+39; a reward must fit float32"),
        ("info_list", "info of type list"),
        ("messages_str", "messages of type str"),
        ("flag_str", "terminated='no'"),
    ],
)
def test_malformed_step_output_fails_the_episode_naming_the_field(bad: str, field: str) -> None:
    async def main() -> None:
        trajectory = await play(LocalEnvSource(make=lambda env_id, **kw: RawEnv(bad)), "raw")
        assert trajectory.failed, f"{bad}: the episode must fail, not train on it"
        assert field in trajectory.failure and "'raw'" in trajectory.failure

    run(main())


def test_a_nan_reward_in_a_pool_fails_the_episode_naming_the_reward() -> None:
    async def main() -> None:
        source = PoolEnvSource(num_workers=1)
        try:
            trajectory = await play(source, RAW.id)
            assert trajectory.failed and "reward=nan" in trajectory.failure
        finally:
            await source.aclose()

    run(main())
