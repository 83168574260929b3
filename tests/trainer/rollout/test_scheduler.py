"""RolloutScheduler with a real tiny policy on HFEngine: masks, dynamic sampling, surplus abort,
the staleness bound, crash replacement; EngineRouter routing."""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import envhub
from trainer.errors import RolloutError
from trainer.rollout.collate import collate
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.trajectory import ChatRenderer
from trainer.strategies.base import GenerationRequest, GenerationResult
from trainer.strategies.hf_engine import HFEngine

HANG_GUARD_S = 300  # only stops a hung test; nothing here asserts on time


class ScriptedEnv(envhub.TextEnv):
    """Accepts any text. The task seed decides the episode: ``turns(seed)`` turns, then done.

    ``reward``: "varied" (alternates over env instances, so a group's rewards differ) or
    "flat" (0 for every episode); ``crash``: raise on turn 2; ``budget``: per-turn token cap.
    """

    made = itertools.count()
    closed = 0

    def __init__(
        self,
        turns: Any = lambda seed: 1 + seed % 4,
        reward: Any = lambda seed: "varied",
        crash: Any = lambda seed, instance: False,
        budget: Any = lambda seed: None,
    ) -> None:
        super().__init__(max_turns=50)
        self.instance = next(ScriptedEnv.made)
        self.turns_of, self.reward_of, self.crash_of, self.budget_of = turns, reward, crash, budget
        self.seed_value = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[override]
        self.seed_value = int(seed or 0)
        return super().reset(seed=seed, options=options)

    def _info(self) -> dict[str, Any]:
        budget = self.budget_of(self.seed_value)
        return {} if budget is None else {"max_new_tokens": budget}

    def on_reset(self, options: dict[str, Any]):
        return f"Task {self.seed_value}. Say anything.", self._info()

    def on_step(self, action: str) -> envhub.Turn:
        if self.turn == 2 and self.crash_of(self.seed_value, self.instance):
            raise RuntimeError("simulated env crash")
        done = self.turn >= self.turns_of(self.seed_value)
        reward = 0.0 if self.reward_of(self.seed_value) == "flat" else float(self.instance % 2)
        return envhub.Turn("ok", reward=reward if done else 0.0, terminated=done, info=self._info())

    def on_close(self) -> None:
        ScriptedEnv.closed += 1


class RecordingEngine(HFEngine):
    """HFEngine that keeps every result it returned (to see aborts happen inside a batch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.results: list[tuple[GenerationRequest, GenerationResult]] = []

    def submit_many(self, requests: list[GenerationRequest]) -> list[Any]:
        futures = super().submit_many(requests)
        for request, future in zip(requests, futures, strict=True):
            future.add_done_callback(lambda done, r=request: self._record(r, done))
        return futures

    def _record(self, request: GenerationRequest, done: Any) -> None:
        if done.exception() is None:
            self.results.append((request, done.result()))


def make_engine(policy, seed: int = 0) -> RecordingEngine:
    model, tokenizer = policy
    return RecordingEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=seed
    )


def scheduler_for(policy, env_factory, *, engines: int = 1, max_new_tokens: int = 3, **config: Any):
    _, tokenizer = policy
    router = EngineRouter([make_engine(policy, seed=i) for i in range(engines)])
    manager = EnvManager(router, ChatRenderer(tokenizer), max_turns=12, max_context_tokens=1024)
    cfg = SchedulerConfig(
        **{"num_groups": 3, "group_size": 2, "env_ids": ("test/scripted-v0",), **config}
    )
    source = LocalEnvSource(make=lambda env_id, **kw: env_factory())
    return RolloutScheduler(cfg, manager, router, source, Sampling(max_new_tokens)), router


def run(coro):
    async def guarded():
        return await asyncio.wait_for(coro, HANG_GUARD_S)

    return asyncio.run(guarded())


def test_variable_length_episodes_finish_with_correct_masks(policy) -> None:
    _, tokenizer = policy
    scheduler, _ = scheduler_for(policy, ScriptedEnv, num_groups=4)

    async def go():
        batch = await scheduler.next_batch()
        await scheduler.close()
        return batch

    batch = run(go())
    assert len(batch.trajectories) == 8 and not batch.failed
    assert sorted({t.seed for t in batch.trajectories}) == [0, 1, 2, 3]
    for t in batch.trajectories:
        assert t.num_turns == 1 + t.seed % 4 and t.terminated  # 1..4 turns, each ended by the env
        assert len(t.token_ids) == len(t.response_mask) == len(t.logprobs) == len(t.token_versions)
        assert t.response_mask[: t.prompt_length] == [0] * t.prompt_length
        assert all(t.response_mask[end] == 1 for end in t.turn_ends)
        assert all(
            (v == -1) == (m == 0) for v, m in zip(t.token_versions, t.response_mask, strict=True)
        )
        assert t.oldest_version == batch.version == 0
        # each turn's policy tokens decode to the action the env received
        actions = [m["content"] for m in t.messages if m["role"] == "assistant"]
        starts = [
            i
            for i in range(len(t.response_mask))
            if t.response_mask[i] and not t.response_mask[i - 1]
        ]
        spans = [t.token_ids[s : e + 1] for s, e in zip(starts, t.turn_ends, strict=True)]
        assert [tokenizer.decode(s, skip_special_tokens=True) for s in spans] == actions
    tensors = collate(batch.trajectories, tokenizer.pad_token_id)
    assert tensors["response_mask"].sum().item() == sum(
        t.num_policy_tokens for t in batch.trajectories
    )
    assert batch.metrics["rollout/turns_max"] == 4.0 and batch.metrics["rollout/staleness_0"] == 8.0


def test_dynamic_sampling_replaces_zero_variance_groups(policy) -> None:
    even_flat = lambda: ScriptedEnv(
        turns=lambda seed: 1, reward=lambda seed: "flat" if seed % 2 == 0 else "varied"
    )
    scheduler, _ = scheduler_for(policy, even_flat, dynamic_sampling=True)

    async def go():
        first = await scheduler.next_batch()
        second = await scheduler.next_batch()
        await scheduler.close()
        return first, second

    for batch in run(go()):
        groups = {t.group_id for t in batch.trajectories}
        assert len(groups) == 3 and all(g % 2 == 1 for g in groups)  # only groups with a signal
        for g in groups:
            assert len({t.episode_reward for t in batch.trajectories if t.group_id == g}) == 2
        assert batch.metrics["rollout/filtered_groups"] >= 2  # flat groups were started and dropped

    always_flat = lambda: ScriptedEnv(turns=lambda seed: 1, reward=lambda seed: "flat")
    scheduler, _ = scheduler_for(
        policy, always_flat, dynamic_sampling=True, max_filtered_per_batch=2
    )

    async def fallback():
        batch = await scheduler.next_batch()
        await scheduler.close()
        return batch

    batch = run(fallback())  # a policy with no signal anywhere does not stall training
    assert len(batch.trajectories) == 6 and batch.metrics["rollout/filtered_groups"] == 2


def test_surplus_is_aborted_in_the_engine_and_its_envs_closed(policy) -> None:
    # groups 0-2 answer in one short turn; later groups are long (10 turns of up to 40 tokens)
    quick_then_long = lambda: ScriptedEnv(
        turns=lambda seed: 1 if seed < 3 else 10, budget=lambda seed: 2 if seed < 3 else 40
    )
    scheduler, router = scheduler_for(policy, quick_then_long, redundancy=2.0, max_new_tokens=40)
    engine = router.engines[0]
    made_before, closed_before = next(ScriptedEnv.made), ScriptedEnv.closed

    async def go():
        batch = await scheduler.next_batch()
        draining = [task for group in scheduler._draining.values() for task in group.tasks]
        if draining:  # the surplus drains in the background (next_batch did not wait for it)
            await asyncio.wait(draining)
        state = (router.in_flight, len(engine._queue), len(scheduler._running))
        await asyncio.sleep(0.2)  # give a wrongly still-running episode the chance to ask again
        tokens_after = engine.stats["new_tokens"]
        await asyncio.sleep(0.2)
        return batch, state, tokens_after

    batch, state, tokens_after = run(go())
    assert {t.group_id for t in batch.trajectories} == {0, 1, 2}
    assert state == (0, 0, 0)  # once drained: nothing left in flight, queued, or running
    # the engine stopped generating for the surplus
    assert engine.stats["new_tokens"] == tokens_after
    assert batch.metrics["rollout/aborted_surplus_episodes"] == 6  # three surplus groups of two
    # aborted in a running batch (cut short) or taken off the queue before it ran: never finished
    aborted = [(req, res) for req, res in engine.results if res.finish_reason == "abort"]
    assert all(len(res.token_ids) < req.max_new_tokens for req, res in aborted)
    surplus_turns = collections.Counter(
        req.request_id.split("/")[0]
        for req, _ in engine.results
        if int(req.request_id[1:].split("e")[0]) >= 3
    )
    assert surplus_turns and max(surplus_turns.values()) < 10
    made = next(ScriptedEnv.made) - made_before - 1
    assert ScriptedEnv.closed - closed_before == made  # every env the surplus opened was closed


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_async_training_never_trains_a_sample_beyond_the_staleness_bound(
    policy, max_staleness: int
) -> None:
    model, _ = policy
    varied = lambda: ScriptedEnv(turns=lambda seed: 1 + seed % 3)
    scheduler, _ = scheduler_for(
        policy, varied, mode="async", max_staleness=max_staleness, num_groups=2
    )
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}

    async def go():
        batches = []
        for _ in range(4):
            batch = await scheduler.next_batch()
            batches.append(batch)
            # "training": rollouts go on; at least one more group finishes on the old weights
            while not scheduler._ready and not scheduler._running:
                await asyncio.sleep(0.01)
            while len(scheduler._ready) < 1:
                await asyncio.sleep(0.01)
            await scheduler.update_weights(weights)
        await scheduler.close()
        return batches

    batches = run(go())
    lags = [b.version - t.oldest_version for b in batches for t in b.trajectories]
    assert max(lags) <= max_staleness
    assert [b.version for b in batches] == [0, 1, 2, 3]
    if max_staleness == 1:  # samples from the previous policy were trained (and counted)
        assert 1 in lags and sum(b.metrics["rollout/staleness_1"] for b in batches) == lags.count(1)
    else:  # everything produced during "training" went stale and was dropped or aborted
        assert (
            sum(
                b.metrics["rollout/stale_dropped_groups"]
                + b.metrics["rollout/stale_aborted_groups"]
                for b in batches
            )
            >= 1
        )


class PausingEngine(RecordingEngine):
    """Its first batch stops after 3 tokens until an abort comes: a weight update lands mid-turn."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aborted = threading.Event()
        self.sampled = 0

    def _sample(self, logits, temperature, top_p):
        self.sampled += 1
        if self.sampled == 3:  # the 3rd token is sampled once the abort is in: it is the last one
            self.aborted.wait(HANG_GUARD_S)
        return super()._sample(logits, temperature, top_p)

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self.aborted.set()


def test_partial_rollout_resumes_a_preempted_turn_under_new_weights(policy) -> None:
    model, tokenizer = policy
    engine = PausingEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    router = EngineRouter([engine])
    manager = EnvManager(router, ChatRenderer(tokenizer), max_turns=1, max_context_tokens=1024)
    cfg = SchedulerConfig(num_groups=1, group_size=1, env_ids=("x",), mode="async", max_staleness=1)
    source = LocalEnvSource(make=lambda env_id, **kw: ScriptedEnv(turns=lambda seed: 1))
    scheduler = RolloutScheduler(cfg, manager, router, source, Sampling(40, temperature=0.0))
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}

    async def go():
        task = asyncio.ensure_future(scheduler.next_batch())
        while engine.sampled < 3:  # the first turn is decoding and holds at its 3rd token
            await asyncio.sleep(0.005)
        await scheduler.update_weights(weights)
        batch = await task
        await scheduler.close()
        return batch

    batch = run(go())
    (t,) = batch.trajectories
    versions = [v for v in t.token_versions if v >= 0]
    assert batch.metrics["rollout/preempted_turns"] == 1 and t.num_turns == 1  # the in-flight turn
    # tokens kept, the rest from new weights
    assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {1}
    assert t.oldest_version == 0 and batch.version == 1
    first = {req.request_id: res for req, res in engine.results[:1]}
    assert all(res.finish_reason == "abort" and len(res.token_ids) == 3 for res in first.values())
    resumed = {req.request_id: req for req, _ in engine.results[1:]}
    for request_id, cut in first.items():
        again = resumed[request_id + ".1"]
        assert again.prompt_ids[-3:] == cut.token_ids and again.max_new_tokens == 37


def test_env_crash_mid_episode_is_replaced_not_a_hang(policy) -> None:
    # task 1 crashes on turn 2 on every env (its group is replaced); task 2 crashes once (replayed)
    crashy = lambda: ScriptedEnv(
        turns=lambda seed: 3,
        crash=lambda seed, instance: seed == 1 or (seed == 2 and instance % 7 == 0),
    )
    scheduler, _ = scheduler_for(policy, crashy)

    async def go():
        batch = await scheduler.next_batch()
        await scheduler.close()
        return batch

    batch = run(go())
    assert len(batch.trajectories) == 6 and all(not t.failed for t in batch.trajectories)
    # the broken task was replaced by task 3
    assert 1 not in {t.group_id for t in batch.trajectories}
    assert batch.metrics["rollout/failed_groups"] >= 1 and batch.failed
    assert all("simulated env crash" in (t.failure or "") for t in batch.failed)

    always = lambda: ScriptedEnv(turns=lambda seed: 3, crash=lambda seed, instance: True)
    scheduler, _ = scheduler_for(policy, always, max_failed_groups=3)
    with pytest.raises(RolloutError, match="3 groups in a row failed"):
        run(scheduler.next_batch())


class _FailingEngine(RecordingEngine):
    def _prefill(self, rows: Any) -> Any:
        raise RuntimeError("engine out of memory")


def test_engine_errors_are_recorded_failures(policy) -> None:
    model, tokenizer = policy
    router = EngineRouter(
        [
            _FailingEngine(
                model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
            )
        ]
    )
    manager = EnvManager(router, ChatRenderer(tokenizer), max_turns=2, max_context_tokens=256)
    cfg = SchedulerConfig(
        num_groups=1, group_size=2, env_ids=("x",), max_retries=0, max_failed_groups=2
    )
    scheduler = RolloutScheduler(
        cfg, manager, router, LocalEnvSource(make=lambda env_id, **kw: ScriptedEnv()), Sampling(2)
    )
    with pytest.raises(RolloutError, match="engine error RuntimeError: engine out of memory"):
        run(scheduler.next_batch())


def test_router_is_least_loaded_sticky_and_aborts_where_the_request_runs(policy) -> None:
    _, tokenizer = policy
    engines = [make_engine(policy, seed=i) for i in range(2)]
    router = EngineRouter(engines)
    prompt = tokenizer.encode("Say anything.", add_special_tokens=False)

    async def go():
        first = [
            asyncio.ensure_future(router.generate(GenerationRequest(f"ep{i}/0", prompt, 30)))
            for i in range(4)
        ]
        await asyncio.sleep(0)
        placed = [router.engine_of(f"ep{i}") for i in range(4)]
        loads = router.loads
        await router.abort("ep3/0")
        results = await asyncio.gather(*first)
        again = await router.generate(GenerationRequest("ep1/1", prompt, 2))
        return placed, loads, results, again

    placed, loads, results, again = run(go())
    assert placed == [0, 1, 0, 1] and loads == [2, 2]  # least-loaded spread
    assert results[3].finish_reason == "abort" and len(results[3].token_ids) < 30
    assert all(r.finish_reason != "abort" for r in results[:3])
    assert router.engine_of("ep1") == 1  # same engine next turn
    assert again.finish_reason in ("stop", "length")
    assert engines[1].results[-1][0].request_id == "ep1/1"


def test_rank_engines_route_over_infer_workers_and_abort_a_running_batch(policy_dir) -> None:
    from trainer.config import RoleConfig
    from trainer.workers.infer import InferCluster

    cluster = InferCluster(
        "actor_infer",
        RoleConfig(strategy="hf", device_mapping=[], num_workers=2),
        backend="local",
        worker_kwargs={"model_path": str(policy_dir)},
    )
    try:
        engines = cluster.rank_engines()
        router = EngineRouter(engines)
        prompt = [5, 6, 7, 8, 9]

        async def go():
            calls = [
                asyncio.ensure_future(
                    router.generate(GenerationRequest(f"ep{i}/0", prompt, 80, temperature=0.0))
                )
                for i in range(4)
            ]
            while not engines[1]._running:  # rank 1's batch is running in its worker
                await asyncio.sleep(0.002)
            await router.abort("ep3/0")
            return await asyncio.gather(*calls)

        results = run(go())
        assert [router.engine_of(f"ep{i}") for i in range(4)] == [0, 1, 0, 1]
        # cut inside rank 1
        assert results[3].finish_reason == "abort" and len(results[3].token_ids) < 80
        # same greedy tokens on the same rank until the abort
        assert (
            results[1].finish_reason != "abort"
            and results[1].token_ids[: len(results[3].token_ids)] == results[3].token_ids
        )
    finally:
        cluster.shutdown()


def batches_across_updates(scheduler: RolloutScheduler, weights: Any, count: int = 3) -> list[Any]:
    """``count`` batches with a weight update after each, then the scheduler closed."""

    async def go() -> list[Any]:
        batches = []
        for _ in range(count):
            batches.append(await scheduler.next_batch())
            await scheduler.update_weights(weights)
        await scheduler.close()
        return batches

    return run(go())


PADDED = "Say anything." + " pad" * 40


class PaddedPromptEnv(ScriptedEnv):
    """An even task's first observation is long (``PADDED``): its prompt alone can fill a
    small context."""

    def on_reset(self, options: dict[str, Any]):
        text, info = super().on_reset(options)
        return (PADDED if self.seed_value % 2 == 0 else text), info


def test_sync_batches_are_on_policy_across_weight_updates(policy) -> None:
    """``rollout.mode=sync`` trains only tokens of the version being trained, batch after batch.

    A benchmark once reported sync "1 version behind": it counted a trajectory with no policy
    token (``oldest_version`` None, e.g. a prompt that already fills the context) as version 0.
    Such an episode has no staleness; the scheduler's own ``rollout/staleness_*`` counts it at 0."""
    model, tokenizer = policy
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    router = EngineRouter([make_engine(policy)])
    prompt = len(ChatRenderer(tokenizer).prompt([{"role": "user", "content": PADDED}]))
    # room for turns of an odd task; an even task's prompt fills the context (no policy token)
    manager = EnvManager(router, ChatRenderer(tokenizer), max_turns=4, max_context_tokens=prompt)
    cfg = SchedulerConfig(num_groups=2, group_size=2, env_ids=("test/scripted-v0",), redundancy=1.5)
    source = LocalEnvSource(make=lambda env_id, **kw: PaddedPromptEnv(turns=lambda seed: 2))
    scheduler = RolloutScheduler(cfg, manager, router, source, Sampling(3))
    batches = batches_across_updates(scheduler, weights)
    assert [b.version for b in batches] == [0, 1, 2]
    tokenless = [t for b in batches for t in b.trajectories if t.oldest_version is None]
    assert tokenless and all(t.num_policy_tokens == 0 and t.truncated for t in tokenless)
    for batch in batches:
        versions = {t.oldest_version for t in batch.trajectories}
        assert versions <= {batch.version, None}  # every policy token is of the trained version
        assert batch.metrics["rollout/staleness_0"] == len(batch.trajectories)
        assert not any(
            k.startswith("rollout/staleness_") and k != "rollout/staleness_0" and v
            for k, v in batch.metrics.items()
        )


class _StaggeredEngine(RecordingEngine):
    """Answers group ``n``'s turn after ``n`` loop iterations (one EOS token): the groups
    finish one after another, one iteration apart."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        group = int(request.request_id[1:].split("e", 1)[0])
        for _ in range(group):
            await asyncio.sleep(0)
        return GenerationResult(request.request_id, [self.eos_token_id], [0.0], "stop")


def test_a_surplus_group_that_ends_while_the_batch_is_taken_is_not_trained_later(policy) -> None:
    """``sync``: a group finishing while the batch's surplus is being cancelled was judged ready
    (it was not yet marked cancelled) and entered the next batch, one version behind (seen in
    ``rollout_scale.py --env-workers``: whole groups from the previous version in sync batches)."""
    model, tokenizer = policy
    engine = _StaggeredEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=0
    )
    router = EngineRouter([engine])
    manager = EnvManager(router, ChatRenderer(tokenizer), max_turns=1, max_context_tokens=512)
    cfg = SchedulerConfig(num_groups=2, group_size=1, env_ids=("test/scripted-v0",), redundancy=8)
    source = LocalEnvSource(make=lambda env_id, **kw: ScriptedEnv(turns=lambda seed: 1))
    scheduler = RolloutScheduler(cfg, manager, router, source, Sampling(3))
    for batch in batches_across_updates(scheduler, {}):
        assert {t.oldest_version for t in batch.trajectories} == {batch.version}
