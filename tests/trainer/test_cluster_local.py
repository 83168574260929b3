"""Clusters on the in-process backend: typed calls, dispatch, ordering, futures, errors."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import threading
from typing import Any

import pytest

from tests.trainer.fake_workers import CountingCluster, CountingWorker
from trainer.config import RoleConfig
from trainer.controller.batch import Batch
from trainer.controller.cluster import Cluster, RemoteMethod, remote
from trainer.controller.dispatch import Dispatch, register
from trainer.controller.method_checks import RAY_TRACE_PARAMETER, cluster_method_problems
from trainer.errors import DispatchError, WorkerCallError
from trainer.workers.actor import ActorCluster


@pytest.fixture
def cluster():
    with CountingCluster("actor_train", world_size=3, worker_kwargs={"start": 10}) as c:
        yield c


def test_typed_calls_honour_the_registered_modes(cluster: CountingCluster) -> None:
    out = cluster.double(Batch({"x": [1, 2, 3, 4, 5, 6]}))
    assert out["x"] == [2, 4, 6, 8, 10, 12] and out["rank"] == [0, 0, 1, 1, 2, 2]
    assert cluster.stats(Batch({"x": list(range(6))})) == {"rows": 2.0, "rank": 1.0}
    assert cluster.add(5) == [15, 16, 17]
    assert cluster.whoami()[0] == 0
    with pytest.raises(DispatchError, match="does not split evenly over 3 ranks"):
        cluster.double(Batch({"x": [1, 2]}))


def test_a_ragged_batch_splits_over_two_ranks_and_comes_back_in_order() -> None:
    with CountingCluster("actor_train", world_size=2) as c:
        out = c.tag_rows(Batch({"x": [10, 11, 12, 13, 14]}, meta={"step": 3}))
        assert out["x"] == [10, 11, 12, 13, 14] and out["rank"] == [0, 0, 0, 1, 1]
        assert c.tag_rows(Batch({"x": [7]}))["rank"] == [0]  # rank 1 gets no rows
        with pytest.raises(
            DispatchError, match="a batch of 5 rows does not split evenly over 2 ranks"
        ):
            c.double(Batch({"x": [10, 11, 12, 13, 14]}))  # Dispatch.DP_SPLIT still refuses it


def overlap(intervals: list[tuple[float, float]]) -> bool:
    """True when every interval overlaps every other one (they ran at the same time)."""
    return max(start for start, _ in intervals) < min(end for _, end in intervals)


def test_calls_to_one_worker_run_in_order_and_workers_run_concurrently(
    cluster: CountingCluster,
) -> None:
    first = cluster.add_async(1, delay=0.3)
    second = cluster.add_async(2)
    assert not first.done()
    assert second.result(timeout=30) == [13, 14, 15]  # waited for the first add on every rank
    assert first.done() and first.result() == [11, 12, 13]
    assert cluster.history() == [["add 1", "add 2"]] * 3
    assert overlap(cluster.sleep_async(0.3).result())  # the three ranks slept at the same time


def test_futures_are_awaitable(cluster: CountingCluster) -> None:
    async def both() -> list:
        return await asyncio.gather(cluster.add_async(1), cluster.add_async(1))

    assert asyncio.run(both()) == [[11, 12, 13], [12, 13, 14]]


def test_a_failing_rank_is_named(cluster: CountingCluster) -> None:
    with pytest.raises(
        WorkerCallError,
        match=r"actor_train worker rank 2 failed in fail_on\(\): ValueError: rank 2 "
        r"was told to fail",
    ) as info:
        cluster.fail_on(2)
    assert isinstance(info.value.__cause__, ValueError)

    async def awaited() -> None:
        await cluster._call_async("fail_on", 1)

    with pytest.raises(WorkerCallError, match="rank 1 failed"):
        asyncio.run(awaited())


def test_timeouts_and_shutdown(cluster: CountingCluster) -> None:
    slow = cluster.add_async(1, delay=0.5)
    with pytest.raises(TimeoutError, match="actor_train.add did not finish within 0.05 s"):
        slow.result(timeout=0.05)
    assert slow.result() == [11, 12, 13]
    cluster.shutdown()
    with pytest.raises(DispatchError, match="is shut down"):
        cluster.add(1)


def test_shutdown_gives_up_on_a_rank_stuck_in_a_call_and_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 1 fails while rank 0 waits for it forever (a collective): the failure is reported,
    and shutdown returns (a Ctrl-C or the error path is not stuck behind rank 0) with a warning
    naming what was still running."""
    cluster = ActorCluster("actor_train", worker_cls=CountingWorker, world_size=2)
    cluster.shutdown_timeout_s = 0.2
    try:
        with pytest.raises(WorkerCallError, match=r"rank 1 failed in stall_unless_failing"):
            cluster._call_async("stall_unless_failing", 1).result(timeout=60)
        stopper = threading.Thread(target=cluster.shutdown, daemon=True)
        stopper.start()
        stopper.join(timeout=60)
        assert not stopper.is_alive(), "shutdown waited for the stuck rank"
        assert "actor_train worker rank 0 is still running stall_unless_failing()" in caplog.text
    finally:
        CountingWorker.gate.set()


def test_offload_reload_and_placement_from_role_config() -> None:
    config = RoleConfig(device_mapping=[2, 3, 4, 5], num_devices_per_worker=2)
    with CountingCluster("critic", config) as c:
        assert c.world_size == 2
        c.offload()
        info = c.node_info()
        assert [i["devices"] for i in info] == [[2, 3], [4, 5]] and all(
            i["offloaded"] for i in info
        )
        c.reload()
        assert c.history() == [["offload", "reload"]] * 2


def test_unregistered_method_is_refused(cluster: CountingCluster) -> None:
    with pytest.raises(DispatchError, match="CountingWorker.__init__ is not registered"):
        cluster._call("__init__")


def test_importing_the_controller_core_loads_neither_ray_nor_torch() -> None:
    code = (
        "import sys; import trainer.controller.dispatch, trainer.controller.cluster, "
        "trainer.devices, trainer.config; "
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def role_clusters() -> list[type[Cluster]]:
    pytest.importorskip(
        "torch", reason="the role workers need the train extra: pip install -e '.[train]'"
    )
    from trainer.workers.actor import ActorCluster
    from trainer.workers.critic import CriticCluster
    from trainer.workers.infer import InferCluster
    from trainer.workers.reference import ReferenceCluster
    from trainer.workers.reward import RewardCluster

    return [ActorCluster, CriticCluster, ReferenceCluster, InferCluster, RewardCluster]


def test_every_cluster_method_takes_its_worker_methods_parameters() -> None:
    for cluster_cls in [CountingCluster, *role_clusters()]:
        assert cluster_method_problems(cluster_cls) == []
        for name in dir(cluster_cls):
            declared = inspect.getattr_static(cluster_cls, name)
            if not isinstance(declared, RemoteMethod):
                continue
            worker_method = getattr(cluster_cls.worker_cls, declared.method)
            ours, theirs = (
                as_written(getattr(cluster_cls, name)),
                as_written(worker_method),
            )
            assert ours == theirs, f"{cluster_cls.__name__}.{name}"


def as_written(method: Any) -> list[inspect.Parameter]:
    """``method``'s parameters without the one ``ray.remote`` adds to every method of a class
    made a Ray actor in this process (``RAY_TRACE_PARAMETER``; other modules start Ray workers)."""
    parameters = inspect.signature(method).parameters.values()
    return [p for p in parameters if p.name != RAY_TRACE_PARAMETER]


def test_the_declaration_says_the_return_type(cluster: CountingCluster) -> None:
    assert str(inspect.signature(cluster.double)) == "(batch: 'Batch') -> 'Batch'"
    assert (
        str(inspect.signature(cluster.add))
        == "(amount: 'int', *, delay: 'float' = 0.0) -> 'list[int]'"
    )
    assert str(inspect.signature(cluster.add_async)) == (
        "(amount: 'int', *, delay: 'float' = 0.0) -> 'CallFuture[list[int]]'"
    )
    assert (
        cluster.whoami.__doc__ is None
        and cluster.sleep_async.__doc__ == CountingWorker.sleep.__doc__
    )


def test_a_worker_class_ray_made_an_actor_still_matches_its_cluster() -> None:
    """``ray.remote(cls)`` adds a ``_ray_trace_ctx`` parameter to the class's methods in place,
    so a cluster built later in the same process (a local run after a Ray run, in one notebook)
    was refused as not matching its worker."""
    ray = pytest.importorskip("ray")

    class TracedWorker(CountingWorker):
        pass

    ray.remote(TracedWorker)
    assert "_ray_trace_ctx" in str(inspect.signature(TracedWorker.add))  # what Ray does

    class TracedCluster(CountingCluster):
        worker_cls = TracedWorker

    assert cluster_method_problems(TracedCluster) == []


def test_a_cluster_that_drifts_from_its_worker_is_refused_when_defined() -> None:
    class NewerWorker(CountingWorker):
        @register(Dispatch.ONE_TO_ALL)
        def add(self, amount: int, *, delay: float = 0.0, twice: bool = False) -> int:
            return super().add(amount * (2 if twice else 1), delay=delay)

        def helper(self) -> None:
            return None

    with pytest.raises(DispatchError) as info:

        class StaleCluster(Cluster):
            worker_cls = NewerWorker
            # derived from the base's older signature
            add = remote(CountingWorker.add, per_rank=True)
            whoami = remote(CountingWorker.whoami, per_rank=True)  # RANK_ZERO collects one result
            history = remote(CountingWorker.history)  # ONE_TO_ALL collects one per rank
            helper = remote(NewerWorker.helper)

            def environ(self, key: str) -> list[str | None]:  # hand-written, parameter renamed
                return self._call("environ", key)

    message = str(info.value)
    assert message.startswith("StaleCluster does not match its worker_cls NewerWorker:")
    assert "StaleCluster.add takes (amount: 'int', *, delay: 'float' = 0.0) but " in message
    assert (
        "NewerWorker.add takes (amount: 'int', *, delay: 'float' = 0.0, twice: 'bool' = False)"
        in message
    )
    assert (
        "StaleCluster.whoami is declared per_rank=True but NewerWorker.whoami collects "
        "Collect.FIRST"
    ) in message
    assert "StaleCluster.history returns a list, one result per rank" in message
    assert "NewerWorker.helper is not registered for cluster calls" in message
    assert (
        "StaleCluster.environ takes (key: 'str') but CountingWorker.environ takes (name: 'str')"
        in message
    )
