"""Small workers and typed clusters for the controller tests (importable by Ray workers)."""

from __future__ import annotations

import os
import threading
import time

from trainer.controller.batch import Batch
from trainer.controller.cluster import CallFuture, Cluster
from trainer.controller.dispatch import Collect, Dispatch, register
from trainer.controller.worker import Worker


class CountingWorker(Worker):
    """Holds a number per rank; records the order calls arrive in."""

    def __init__(self, ctx, config=None, *, start: int = 0) -> None:
        super().__init__(ctx, config)
        self.value = start + ctx.rank
        self.calls: list[str] = []
        self.threads: set[int] = set()

    @register(Dispatch.DP_SPLIT, collect=Collect.CONCAT)
    def double(self, batch: Batch) -> Batch:
        self.calls.append("double")
        return Batch({"x": [2 * v for v in batch["x"]], "rank": [self.rank] * len(batch)})

    @register(Dispatch.DP_SPLIT, collect=Collect.MEAN)
    def stats(self, batch: Batch) -> dict[str, float]:
        return {"rows": float(len(batch)), "rank": float(self.rank)}

    @register(Dispatch.ONE_TO_ALL)
    def add(self, amount: int, *, delay: float = 0.0) -> int:
        self.calls.append(f"add {amount}")
        self.threads.add(threading.get_ident())
        time.sleep(delay)
        self.value += amount
        return self.value

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, delay: float) -> tuple[float, float]:
        """Sleep; return (start, end) wall-clock times, to check that calls overlapped."""
        start = time.time()
        time.sleep(delay)
        return start, time.time()

    @register(Dispatch.ONE_TO_ALL)
    def history(self) -> list[str]:
        return list(self.calls)

    @register(Dispatch.RANK_ZERO)
    def whoami(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"rank {rank} was told to fail")

    @register(Dispatch.ONE_TO_ALL)
    def environ(self, name: str) -> str | None:
        return os.environ.get(name)

    def offload(self) -> None:  # inherits Worker.offload's registration
        self.calls.append("offload")
        super().offload()

    def reload(self) -> None:
        self.calls.append("reload")
        super().reload()


class CountingCluster(Cluster):
    """The typed face of CountingWorker, as role clusters are written."""

    worker_cls = CountingWorker

    def double(self, batch: Batch) -> Batch:
        return self._call("double", batch)

    def stats(self, batch: Batch) -> dict[str, float]:
        return self._call("stats", batch)

    def add(self, amount: int, *, delay: float = 0.0) -> list[int]:
        return self._call("add", amount, delay=delay)

    def add_async(self, amount: int, *, delay: float = 0.0) -> CallFuture[list[int]]:
        return self._call_async("add", amount, delay=delay)

    def sleep_async(self, delay: float) -> CallFuture[list[tuple[float, float]]]:
        return self._call_async("sleep", delay)

    def history(self) -> list[list[str]]:
        return self._call("history")

    def whoami(self) -> tuple[int, int]:
        return self._call("whoami")

    def fail_on(self, rank: int) -> None:
        self._call("fail_on", rank)

    def environ(self, name: str) -> list[str | None]:
        return self._call("environ", name)
