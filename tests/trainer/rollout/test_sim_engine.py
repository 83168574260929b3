"""``SimEngine``: a GPU-shaped step cost, vLLM-like scheduling on simulated time, and the real
rollout scheduler running on it."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.rollout.sim_workload import COST, budgets, engines, manager, source
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import Sampling
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.sim_engine import QWEN2_5_7B, SimEngine, StepCost
from trainer.strategies.base import GenerationRequest, GenerationResult, InferenceEngine


def request(request_id: str, prompt: int, new: int) -> GenerationRequest:
    return GenerationRequest(request_id, [1] * prompt, new)


# ------------------------------------------------------------------ the cost model
def test_the_cost_of_qwen2_5_7b_comes_from_its_shape() -> None:
    assert COST.weight_bytes == 2 * 7_615_616_512  # bf16, the checkpoint's parameter count
    assert COST.kv_bytes_per_token == 28 * 4 * 128 * 2 * 2  # layers x kv heads x dim x K,V x bf16
    assert 1.8e6 < COST.kv_capacity_tokens() < 2.0e6  # 0.9 x 141 GB minus the weights


def test_a_decode_step_costs_the_same_up_to_the_ridge_then_grows_with_the_batch() -> None:
    flat = [COST.step_seconds(batch, 0) for batch in (1, 8, 32, 64)]
    assert len(set(flat)) == 1  # bandwidth-bound: reading the weights once per step
    assert flat[0] == pytest.approx(
        COST.step_overhead_s + COST.weight_bytes / (4.8e12 * 0.85), rel=1e-9
    )
    past = [COST.step_seconds(batch, 0) - COST.step_overhead_s for batch in (256, 512)]
    assert past[1] == pytest.approx(2 * past[0], rel=1e-9)  # compute-bound: linear in the batch
    assert past[0] > flat[0]
    # reading the decoding sequences' KV cache costs bandwidth too
    assert COST.step_seconds(64, 64 * 4096) > flat[0]


def test_prefill_costs_in_proportion_to_the_new_tokens() -> None:
    one, two = (COST.step_seconds(0, 0, tokens) - COST.step_overhead_s for tokens in (4096, 8192))
    assert two == pytest.approx(2 * one, rel=1e-9)
    assert COST.step_seconds(0, 0, 4096) > 10 * COST.step_seconds(1, 0)


def test_efficiencies_are_parameters() -> None:
    slow = StepCost.for_model(QWEN2_5_7B, compute_efficiency=0.25)
    assert slow.step_seconds(512, 0) > COST.step_seconds(512, 0)
    assert slow.step_seconds(1, 0) == COST.step_seconds(1, 0)


# ------------------------------------------------------------------ the engine
def test_the_engine_is_an_inference_engine() -> None:
    assert isinstance(SimEngine(COST), InferenceEngine)


def test_one_request_takes_one_step_per_token_at_the_modelled_cost() -> None:
    engine = SimEngine(COST, eos_token_id=0, token_id=9)
    [result] = engine.generate_batch([request("ep/0", 100, 50)])
    assert result.finish_reason == "stop" and result.token_ids == [9] * 49 + [0]
    assert result.logprobs == [-0.5] * 50
    # the prefill step makes the first token; each later step one more, reading a longer context
    expected = COST.step_seconds(0, 0, 100, 100 * 50) + sum(
        COST.step_seconds(1, 100 + made) for made in range(1, 50)
    )
    assert engine.stats.steps == 50
    assert engine.stats.busy_s == pytest.approx(expected, rel=1e-9)


def test_the_engines_own_stepping_stays_off_the_drivers_clock() -> None:
    """On a cluster an engine steps in its own process: the simulated timeline must not charge
    its bookkeeping to the driver, whose cost the benchmark measures. What stays on the clock
    is the loop waking once per step, as it would for an empty timer."""
    engine = SimEngine(COST)

    async def main() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, sim_clock.VirtualClockLoop)
        start, done = loop.time(), loop.create_future()

        def tick(left: int) -> None:  # the loop's own cost of 2000 timers, one after another
            if left:
                loop.call_at(loop.time() + 0.001, tick, left - 1)
            else:
                done.set_result(None)

        tick(2000)
        await done
        wakeups = loop.time() - start - 2.0
        start, uncharged = loop.time(), loop.uncharged_s
        await asyncio.gather(*(engine.generate(request(f"ep{i}/0", 10, 2000)) for i in range(4)))
        await engine.close()
        return wakeups, loop.time() - start, loop.uncharged_s - uncharged

    wakeups, elapsed, engine_cpu = sim_clock.run(main())
    assert engine.stats.steps == 2000 and engine_cpu > 0
    charged = elapsed - engine.stats.busy_s  # on the clock beyond the GPU's own seconds
    assert charged < 2 * wakeups + engine_cpu / 10


def test_a_request_arriving_mid_generation_joins_the_running_batch() -> None:
    engine = SimEngine(COST)

    async def main() -> list[str]:
        finished: list[str] = []

        async def run(req: GenerationRequest, delay: float) -> None:
            await asyncio.sleep(delay)
            await engine.generate(req)
            finished.append(req.request_id)

        await asyncio.gather(
            run(request("long/0", 10, 200), 0.0), run(request("short/0", 10, 10), 0.2)
        )
        await engine.close()
        return finished

    assert sim_clock.run(main()) == ["short/0", "long/0"]
    assert engine.stats.steps == 200  # the short one ran inside the long one's steps


def test_a_busy_driver_does_not_stop_the_engines_steps() -> None:
    """A GPU keeps stepping while the driver's Python is busy elsewhere: a callback that holds
    the loop for half a simulated second delays when the driver *sees* a result, not the
    engine's own timeline (the steps due meanwhile run as soon as the loop is free)."""

    async def finish_time(stall_s: float) -> float:
        loop = asyncio.get_running_loop()
        engine = SimEngine(COST)
        start = loop.time()
        running = asyncio.ensure_future(engine.generate(request("a/0", 10, 400)))
        await asyncio.sleep(0.1)
        loop.skip(stall_s)  # the driver busy for stall_s (CPU charged to the clock)
        await running
        await engine.close()
        return loop.time() - start

    sim_clock.run(finish_time(0.0))  # anything imported or built on first use, charged once
    alone = sim_clock.run(finish_time(0.0))
    assert alone > 1.0  # ~400 decode steps
    assert sim_clock.run(finish_time(0.5)) == pytest.approx(alone, abs=0.01)


def test_a_request_sent_after_the_driver_was_busy_starts_when_it_arrives() -> None:
    """Catching up on the steps due while the driver was busy, the engine does not take a
    request into a step that began before the request was sent."""

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        engine = SimEngine(COST)
        running = asyncio.ensure_future(engine.generate(request("a/0", 10, 1000)))
        await asyncio.sleep(0.1)
        loop.skip(0.5)
        sent = loop.time()
        await engine.generate(request("b/0", 10, 50))
        done = loop.time()
        await engine.abort("a/0")
        await running
        await engine.close()
        return sent, done

    sent, done = sim_clock.run(main())
    assert done - sent >= 49 * COST.step_seconds(1, 0)


def test_requests_beyond_max_num_seqs_wait_for_a_slot() -> None:
    engine = SimEngine(COST, max_num_seqs=1)
    first, second = engine.generate_batch([request("a/0", 10, 20), request("b/0", 10, 20)])
    assert len(first.token_ids) == len(second.token_ids) == 20
    assert engine.stats.steps == 40 and engine.stats.waiting_peak == 2


def test_abort_ends_a_running_request_with_its_tokens_and_a_waiting_one_at_once() -> None:
    engine = SimEngine(COST, max_num_seqs=1)

    async def main() -> tuple[GenerationResult, GenerationResult]:
        running = asyncio.ensure_future(engine.generate(request("a/0", 10, 1000)))
        waiting = asyncio.ensure_future(engine.generate(request("b/0", 10, 5)))
        await asyncio.sleep(0.5)  # simulated: about a hundred steps
        await engine.abort("b/0")
        await engine.abort("a/0")
        results = await asyncio.gather(running, waiting)
        await engine.close()
        return results[0], results[1]

    running, waiting = sim_clock.run(main())
    assert running.finish_reason == "abort" and 10 < len(running.token_ids) < 1000
    assert (waiting.finish_reason, waiting.token_ids) == ("abort", [])


def test_an_episodes_next_turn_prefills_only_its_new_tokens() -> None:
    engine = SimEngine(COST)
    engine.generate_batch([request("ep/0", 100, 10)])
    engine.generate_batch([request("ep/1", 130, 10)])  # +10 generated, +20 from the env
    assert engine.stats.cached_tokens == 110
    assert engine.stats.prefill_tokens == 100 + 20


def test_a_request_larger_than_the_kv_cache_is_refused_with_the_fix() -> None:
    engine = SimEngine(COST, kv_capacity_tokens=50)
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        engine.generate_batch([request("big/0", 100, 10)])


def test_a_weight_load_keeps_the_engine_from_stepping_for_its_sync_time() -> None:
    engine = SimEngine(COST, sync_s=2.0)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        await engine.generate(request("warm/0", 10, 1))  # the engine is up on this loop
        started = loop.time()
        engine.update_weights({})
        await engine.generate(request("after/0", 10, 1))
        await engine.close()
        return loop.time() - started

    assert sim_clock.run(main()) >= 2.0
    assert engine.version == 1


# ------------------------------------------------------------------ the real scheduler on it
def test_the_async_scheduler_runs_on_simulated_engines() -> None:
    """Three async batches (staleness 1) on two simulated engines, with simulated training:
    every episode plays its planned turns in full, no trained token is more than one version
    behind, both engines serve, and the run spans at least the three training steps."""
    train_s = 5.0

    async def main() -> tuple[list, float, list[SimEngine]]:
        loop = asyncio.get_running_loop()
        sims = engines(2)
        router = EngineRouter(sims, clock=loop.time)
        scheduler = RolloutScheduler(
            SchedulerConfig(4, 2, ("test/planned-v0",), mode="async", max_staleness=1),
            manager(router),
            router,
            source(),
            Sampling(64),
        )
        started, batches = loop.time(), []
        try:
            for _ in range(3):
                batch = await scheduler.next_batch()
                batches.append(batch)
                await asyncio.sleep(train_s)  # the trainer trains; rollouts go on
                await scheduler.update_weights({})
        finally:
            await scheduler.close()
            for sim in sims:
                await sim.close()
        return batches, loop.time() - started, sims

    batches, span, sims = sim_clock.run(main())
    assert [len(b.trajectories) for b in batches] == [8, 8, 8]
    for batch in batches:
        for trajectory in batch.trajectories:
            assert not trajectory.failed
            assert trajectory.num_policy_tokens == sum(budgets(trajectory.seed))
            assert batch.version - trajectory.oldest_version <= 1
    assert [b.version for b in batches] == [0, 1, 2]
    assert all(sim.stats.requests > 0 and sim.stats.busy_s > 0 for sim in sims)
    assert span >= 3 * train_s
