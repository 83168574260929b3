"""Env worker setups whose envs attack ``EnvWorkers`` (built inside the worker process).

``fork_setup(pids)``: each step forks a lingering helper (it inherits the worker's socket),
writes its pid to the file ``pids``, then ends the worker process, as a segfaulting env with a
``multiprocessing`` child would. ``blocking_setup(fifo)``: each step writes a byte to the FIFO
``fifo`` (so a test knows), then blocks the worker's event loop for good.
"""

from __future__ import annotations

import os
import time
from typing import Any

import envhub
from tests.trainer.rollout.sim_workload import PlannedEnv, renderer
from trainer.rollout.env_manager import EnvManager, LocalEnvSource


class _ForkThenCrash(PlannedEnv):
    def __init__(self, pids: str) -> None:
        super().__init__()
        self.pids = pids

    def on_step(self, action: str) -> envhub.Turn:
        pid = os.fork()
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        with open(self.pids, "a") as f:
            f.write(f"{pid}\n")
        os._exit(3)


class _Blocking(PlannedEnv):
    def __init__(self, fifo: str) -> None:
        super().__init__()
        self.fifo = fifo

    def on_step(self, action: str) -> envhub.Turn:
        with open(self.fifo, "wb") as f:
            f.write(b"x")
        time.sleep(300)  # the worker's whole event loop stops here
        return super().on_step(action)


def _manager(engine: Any) -> EnvManager:
    return EnvManager(engine, renderer(), max_turns=10, max_context_tokens=4096)


def fork_setup(pids: str, engine: Any) -> tuple[EnvManager, LocalEnvSource]:
    return _manager(engine), LocalEnvSource(make=lambda env_id, **kw: _ForkThenCrash(pids))


def blocking_setup(fifo: str, engine: Any) -> tuple[EnvManager, LocalEnvSource]:
    return _manager(engine), LocalEnvSource(make=lambda env_id, **kw: _Blocking(fifo))
