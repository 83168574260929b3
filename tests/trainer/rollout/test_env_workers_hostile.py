"""``EnvWorkers`` against hostile envs: a worker that dies while a forked helper holds its socket
is seen dead at once (and its helper dies with it); a worker whose event loop is stuck does
not hold a weight update's pause forever."""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")

from tests.envhub.pool.hostile_envs import survivors
from tests.trainer.rollout.hostile_setups import blocking_setup, fork_setup
from tests.trainer.rollout.sim_workload import FAST, engines
from trainer.rollout.env_manager import Sampling, in_daemon_thread
from trainer.rollout.env_workers import EnvWorkers
from trainer.rollout.groups import EpisodeSpec
from trainer.rollout.router import EngineRouter
from trainer.rollout.worker_routing import RelayEngines, RelayHost, WorkerRouters


def run(coro: Any, timeout: float = 60.0) -> Any:
    """Run a test coroutine; a hang fails the test instead of blocking the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_a_worker_that_dies_with_a_forked_helper_fails_its_episode_at_once(tmp_path: Path):
    """The helper keeps the worker's socket open: the driver must see the process exit."""
    pids = tmp_path / "helpers"

    async def main() -> None:
        workers = EnvWorkers(
            EngineRouter(engines(1, cost=FAST)),
            functools.partial(fork_setup, str(pids)),
            workers=1,
            close_timeout_s=2,
        )
        try:
            await workers.start()
            trajectory = await workers.play(EpisodeSpec("x", 0, 0), Sampling(8), max_retries=0)
            assert trajectory.failed and "exit code 3" in trajectory.failure
            assert workers.restarts == 1
            helpers = [int(p) for p in pids.read_text().split()]
            assert survivors(helpers) == [], "the dead worker's helper must die with it"
        finally:
            await workers.close()

    try:
        run(main(), timeout=30)
    finally:
        for pid in (int(p) for p in pids.read_text().split()) if pids.exists() else ():
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, 9)


def test_a_worker_stuck_in_its_env_does_not_hold_a_pause_forever(tmp_path: Path):
    """A weight update's pause waits ``pause_timeout_s`` for a worker whose loop is blocked,
    then kills it (its episode fails) and goes on."""
    fifo = tmp_path / "stepping"
    os.mkfifo(fifo)

    def stepping() -> bytes:
        with open(fifo, "rb") as f:
            return f.read(1)

    async def main() -> None:
        sim = engines(1, cost=FAST)
        routers = WorkerRouters(RelayEngines(1), 1, relay=RelayHost(sim), pause_timeout_s=1.0)
        workers = EnvWorkers(
            routers, functools.partial(blocking_setup, str(fifo)), workers=1, close_timeout_s=2
        )
        try:
            await workers.start()
            playing = asyncio.ensure_future(
                workers.play(EpisodeSpec("x", 0, 0), Sampling(8), max_retries=0)
            )
            assert await in_daemon_thread(stepping) == b"x"  # the worker's loop is stuck now
            await routers.pause()
            routers.resume()
            trajectory = await playing
            assert trajectory.failed and "pause_timeout_s" in trajectory.failure
            assert workers.restarts == 1
        finally:
            await workers.close()

    run(main(), timeout=30)
