"""Small workers and typed clusters for the controller tests (importable by Ray workers)."""

from __future__ import annotations

import os
import threading
import time

from trainer.controller.batch import Batch
from trainer.controller.cluster import Cluster, remote
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

    @register(Dispatch.DP_SPLIT_RAGGED, collect=Collect.CONCAT)
    def tag_rows(self, batch: Batch) -> Batch:
        """Each row with the rank that got it (a batch of any size splits over the ranks)."""
        return Batch({"x": list(batch["x"]), "rank": [self.rank] * len(batch)})

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

    gate = threading.Event()
    """What ``stall_unless_failing`` waits on (a test sets it to free in-process ranks)."""

    @register(Dispatch.ONE_TO_ALL)
    def stall_unless_failing(self, rank: int) -> None:
        """Rank ``rank`` fails, the others wait for a peer that never comes (``gate``): a
        collective in which one rank died."""
        if self.rank == rank:
            raise ValueError(f"rank {rank} was told to fail")
        CountingWorker.gate.wait()

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def setup(self) -> None:
        """What ``ActorCluster`` calls on every rank once they started."""
        self.calls.append("setup")

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def close_weight_sync(self) -> None:
        """What ``ActorCluster`` asks of every rank before it stops them."""
        self.calls.append("close_weight_sync")

    def offload(self) -> None:  # inherits Worker.offload's registration
        self.calls.append("offload")
        super().offload()

    def reload(self) -> None:
        self.calls.append("reload")
        super().reload()


class CountingCluster(Cluster):
    """The typed face of CountingWorker, as role clusters are written."""

    worker_cls = CountingWorker

    double = remote(CountingWorker.double)
    tag_rows = remote(CountingWorker.tag_rows)
    stats = remote(CountingWorker.stats)
    add = remote(CountingWorker.add, per_rank=True)
    add_async = remote(CountingWorker.add, per_rank=True, future=True)
    sleep_async = remote(CountingWorker.sleep, per_rank=True, future=True)
    history = remote(CountingWorker.history, per_rank=True)
    whoami = remote(CountingWorker.whoami)
    fail_on = remote(CountingWorker.fail_on, per_rank=True)
    environ = remote(CountingWorker.environ, per_rank=True)


class BrokenWorker(CountingWorker):
    """Fails in ``__init__``, as a worker whose model cannot load does."""

    def __init__(self, ctx, config=None, **kwargs) -> None:
        raise ValueError(f"rank {ctx.rank} cannot load /no/such/model")
