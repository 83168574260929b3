"""Episodes against real envs: masks, rewards, kept log-probs; a crashing env is replaced."""

from __future__ import annotations

import asyncio
import json

import pytest

torch = pytest.importorskip("torch")

import envhub
from tests.trainer.conftest import LAKE, LAKE_KWARGS
from trainer.errors import RolloutError
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.groups import plan_eval, plan_groups, run_episodes
from trainer.rollout.trajectory import ChatRenderer
from trainer.strategies.hf_engine import HFEngine


class CrashingLake(envhub.TextEnv):
    """The 1st and 3rd instances made raise on their first step: a flaky env."""

    made = 0

    def __init__(self) -> None:
        super().__init__(max_turns=2)
        CrashingLake.made += 1
        self.flaky = CrashingLake.made in (1, 3)

    def on_reset(self, options):
        return "Say anything.", {"secret": 7}

    def on_step(self, action):
        if self.flaky:
            raise RuntimeError("simulated env crash")
        return envhub.Turn("ok", reward=1.0, terminated=True, success=True)


def manager_for(policy, max_turns: int = 4) -> tuple[EnvManager, HFEngine]:
    model, tokenizer = policy
    engine = HFEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=0
    )
    return EnvManager(
        engine, ChatRenderer(tokenizer), max_turns=max_turns, max_context_tokens=1024
    ), engine


def test_episodes_are_one_sequence_with_policy_tokens_masked(policy) -> None:
    manager, engine = manager_for(policy)
    specs = plan_groups(0, num_groups=2, group_size=3, env_ids=[LAKE], seed=0)
    finished, failed = asyncio.run(
        run_episodes(specs, manager, LocalEnvSource(LAKE_KWARGS), Sampling(3))
    )
    assert len(finished) == 6 and not failed
    # turns are generated together: the episodes' first turns alone are admitted as one batch
    # (later turns join a running batch as they come, so how many admissions is timing)
    turns = sum(t.num_turns for t in finished)
    assert engine.stats["requests"] == turns and engine.stats["batches"] <= turns - 5
    for t in finished:
        assert len(t.token_ids) == len(t.response_mask) == len(t.logprobs)
        assert 1 <= t.num_turns <= 4 and len(t.turn_ends) == t.num_turns
        assert all(t.response_mask[end] == 1 for end in t.turn_ends)
        assert t.response_mask[: t.prompt_length] == [0] * t.prompt_length
        assert all(
            (lp == 0.0) == (m == 0)
            for lp, m in zip(t.logprobs, t.response_mask, strict=True)
            if m == 0
        )
        # decoding the policy tokens of each turn gives back the actions the env received
        actions = [m["content"] for m in t.messages if m["role"] == "assistant"]
        starts = [
            i for i, m in enumerate(t.response_mask) if m and (i == 0 or not t.response_mask[i - 1])
        ]
        turns = [
            t.token_ids[start : end + 1] for start, end in zip(starts, t.turn_ends, strict=True)
        ]
        assert all(
            t.response_mask[start : end + 1] == [1] * (end + 1 - start)
            for start, end in zip(starts, t.turn_ends)
        )
        assert [manager.renderer.decode(ids) for ids in turns] == actions
        assert len(actions) == t.num_turns
    assert {t.seed for t in finished[:3]} == {finished[0].seed}
    assert {t.group_id for t in finished} == {0, 1}
    assert all(s.seed >= 1_000_000_000 for s in plan_eval(4, env_ids=[LAKE]))


def test_a_crashed_env_episode_is_replaced_not_fatal(policy) -> None:
    manager, _ = manager_for(policy, max_turns=2)
    source = LocalEnvSource(make=lambda env_id, **kw: CrashingLake())
    specs = plan_groups(0, num_groups=1, group_size=4, env_ids=["test/crash-v0"], seed=0)
    finished, failed = asyncio.run(run_episodes(specs, manager, source, Sampling(2)))
    # every crash was replayed on a fresh env
    assert len(finished) == 4 and all(t.success for t in finished)
    assert len(failed) == 2 and all("simulated env crash" in (t.failure or "") for t in failed)
    assert finished[0].info == {"secret": 7, "turn": 0, "success": False, "invalid_action": False}
    # what the store records (and envhub view shows): the reset's info, as the last step left it
    recorded = json.loads(finished[0].as_record(None, 0.0)["info"])
    assert recorded["secret"] == 7 and recorded["success"] is True and recorded["turn"] == 1

    always = LocalEnvSource(make=lambda env_id, **kw: _AlwaysCrash())
    with pytest.raises(RolloutError, match="all 4 episodes failed"):
        asyncio.run(run_episodes(specs, manager, always, Sampling(2)))


class _AlwaysCrash(CrashingLake):
    def __init__(self) -> None:
        super().__init__()
        self.flaky = True
