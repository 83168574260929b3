"""``EnvWorkers``: episodes played in worker processes for the driver's scheduler, the same
episodes as in the driver, surviving a worker that dies, leaving no process behind."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.rollout.sim_workload import (
    DYING_SEED,
    FAST,
    broken_setup,
    budgets,
    engines,
    manager,
    source,
    worker_setup,
)
from trainer.rollout import sim_clock
from trainer.rollout.env_manager import Sampling
from trainer.rollout.env_workers import EnvWorkers
from trainer.rollout.groups import EpisodeSpec, run_episodes
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.sim_engine import SimEngine
from trainer.strategies.base import GenerationRequest, GenerationResult

SAMPLING = Sampling(64)


class RecordingSimEngine(SimEngine):
    """Keeps every prompt it was asked to continue."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: dict[str, list[int]] = {}

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        self.prompts[request.request_id] = list(request.prompt_ids)
        return super().start_generate(request)


def specs(count: int, first_seed: int = 0) -> list[EpisodeSpec]:
    return [EpisodeSpec("planned", first_seed + i, i) for i in range(count)]


async def play(player: Any, router: EngineRouter, count: int) -> list[Any]:
    finished, failed = await run_episodes(specs(count), player, source(), SAMPLING)
    assert not failed
    return sorted(finished, key=lambda t: t.seed)


def test_workers_play_the_same_episodes_as_the_driver_and_the_engine_sees_whole_prompts() -> None:
    async def main() -> tuple[list[Any], list[Any], list[RecordingSimEngine]]:
        router = EngineRouter(engines(2, cost=FAST))
        here = await play(manager(router), router, 12)
        recording = engines(2, cost=FAST, kind=RecordingSimEngine)
        remote_router = EngineRouter(recording)
        workers = EnvWorkers(remote_router, worker_setup, workers=2)
        try:
            there = await play(workers, remote_router, 12)
        finally:
            await workers.close()
        return here, there, recording

    here, there, recording = asyncio.run(main())
    assert [t.token_ids for t in there] == [t.token_ids for t in here]
    assert [(t.turn_rewards, t.response_mask, t.messages) for t in there] == [
        (t.turn_rewards, t.response_mask, t.messages) for t in here
    ]
    assert [t.num_turns for t in there] == [len(budgets(t.seed)) for t in there]
    # every turn after the first travels as only its new ids; the engine still gets the
    # episode's whole prompt (each is a prefix of the finished episode)
    prompts = {rid: ids for engine in recording for rid, ids in engine.prompts.items()}
    assert len(prompts) == sum(t.num_turns for t in there)
    assert sum(rid.endswith("/2") for rid in prompts) == sum(t.num_turns == 3 for t in there) > 0
    for ids in prompts.values():
        assert any(t.token_ids[: len(ids)] == ids for t in there)


def test_the_scheduler_runs_on_workers_in_simulated_time() -> None:
    async def main() -> tuple[list[Any], float, int]:
        loop = asyncio.get_running_loop()
        router = EngineRouter(engines(2), clock=loop.time)
        workers = EnvWorkers(router, worker_setup, workers=2, lockstep=True)
        await workers.start()
        scheduler = RolloutScheduler(
            SchedulerConfig(4, 4, ("planned",), mode="async", redundancy=1.5, max_staleness=1),
            workers,
            router,
            source(),
            SAMPLING,
        )
        batches = []
        try:
            for _ in range(2):
                batch = await scheduler.next_batch()
                batches.append(batch)
                await scheduler.update_weights({})
        finally:
            await scheduler.close()
            await workers.close()
        return batches, workers.lane_busy_s, workers.episodes

    batches, lanes_s, left = sim_clock.run(main())
    for batch in batches:
        assert len(batch.trajectories) == 16 and not batch.failed
        for t in batch.trajectories:
            assert t.num_turns == len(budgets(t.seed))
            assert len(t.token_ids) == len(t.response_mask)
    assert lanes_s > 0  # the workers' CPU went to their own timelines
    assert left == 0


def test_episodes_played_while_the_workers_start_are_spread_over_all_of_them() -> None:
    """Episodes asked for before the workers are ready (a run's first batch) wait for them and
    are then spread evenly, not all handed to the first worker."""

    async def main() -> collections.Counter[int]:
        workers = EnvWorkers(EngineRouter(engines(2, cost=FAST)), worker_setup, workers=2)
        sent: collections.Counter[int] = collections.Counter()
        send = workers._send

        def counting(worker: Any, message: tuple[Any, ...]) -> None:
            if message[0] == "play":
                sent[worker.index] += 1
            send(worker, message)

        workers._send = counting  # type: ignore[method-assign]
        try:
            played = await asyncio.gather(*(workers.play(s, SAMPLING) for s in specs(12)))
        finally:
            await workers.close()
        assert not any(t.failed for t in played)
        return sent

    assert asyncio.run(main()) == {0: 6, 1: 6}


def test_a_worker_that_dies_fails_its_episodes_and_is_replaced() -> None:
    async def main() -> tuple[list[Any], list[Any], EnvWorkers]:
        router = EngineRouter(engines(2, cost=FAST))
        workers = EnvWorkers(router, worker_setup, workers=2)
        try:
            first = await asyncio.gather(
                *(workers.play(spec, SAMPLING) for spec in specs(20))  # seed 13 kills its worker
            )
            second = await asyncio.gather(
                *(workers.play(spec, SAMPLING) for spec in specs(6, first_seed=100))
            )
            processes = [w.process for w in workers._workers]
        finally:
            await workers.close()
        assert [p.poll() for p in processes] == [0, 0]  # they exited on their own
        return first, second, workers

    first, second, workers = asyncio.run(main())
    dead = [t for t in first if t.failed]
    assert any(t.seed == DYING_SEED for t in dead)
    assert all(
        "env worker" in (t.failure or "") and "died (exit code 3)" in t.failure for t in dead
    )
    assert len(dead) < len(first)  # the other worker's episodes finished
    assert workers.restarts == 1
    assert all(not t.failed for t in second)  # the replacement plays


def test_a_setup_that_fails_in_the_worker_is_a_clear_error_not_a_hang() -> None:
    async def main() -> tuple[str, str]:
        workers = EnvWorkers(EngineRouter(engines(1, cost=FAST)), broken_setup, workers=2)
        try:
            with pytest.raises(RuntimeError) as started:
                await workers.start()
            with pytest.raises(RuntimeError) as played:
                await workers.play(specs(1)[0], SAMPLING)
        finally:
            await workers.close()
        return str(started.value), str(played.value)

    started, played = asyncio.run(main())
    assert "could not build its EnvManager" in started and "no tokenizer here" in started
    assert played == started


def test_a_run_with_env_workers_trains_on_episodes_its_workers_played(tmp_path: Path) -> None:
    from tests.trainer.test_cli import QUICKSTART, TINY
    from tests.trainer.test_pipeline import VARIED
    from trainer.config import load_config
    from trainer.pipeline import AgenticPipeline

    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            "rollout.env_workers=2",
            "rollout.mode=async",
            "train.steps=2",
            "sft.epochs=1",
            "eval.episodes=4",
            f"output_dir={tmp_path / 'run'}",
            VARIED,
        ],
    )
    pipeline = AgenticPipeline(cfg)
    workers = pipeline.rollouts.workers
    assert workers is not None
    processes = [w.process for w in workers._workers]
    rows = pipeline.fit()
    trained = [row for row in rows if "actor/grad_norm" in row]
    assert len(trained) == 2 and all(row["actor/grad_norm"] > 0 for row in trained)
    assert workers.played >= 2 * cfg.env.num_groups * cfg.env.group_size
    assert "eval/success" in rows[-1]  # evaluation plays in the driver
    assert [p.poll() for p in processes] == [0, 0]  # the run closed its workers
