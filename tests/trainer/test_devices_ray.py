"""AutoDeviceMapping on a real two-node Ray cluster whose devices are a custom resource.

``ray start --head`` and ``ray start --address`` subprocesses make two nodes with 2
``envhub_device`` each, so global device ids 0-1 are node 0's and 2-3 node 1's. One cluster
and one layout of roles serve the whole module (each node and each actor process costs
seconds to start):

    actor_train  devices 0,1   two workers   node 0   } colocated: take turns
    actor_infer  devices 0,1   one worker    node 0   }
    critic       devices 2,3   two workers   node 1     disaggregated: runs alongside
    reward       no devices    one worker    anywhere
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.trainer.fake_workers import CountingCluster, CountingWorker
from tests.trainer.ray_nodes import start_ray_nodes, wait_for_nodes
from trainer.config import RoleConfig
from trainer.controller.batch import Batch
from trainer.controller.resources import ResourceManager
from trainer.devices import AutoDeviceMapping, Colocation
from trainer.errors import DeviceMappingError, WorkerCallError
from trainer.workers.actor import ActorCluster

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
pytest.importorskip("psutil", reason="psutil is needed to stop the test's own Ray processes")

REPO = Path(__file__).resolve().parents[2]
DEVICE = "envhub_device"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    if ray.is_initialized():
        ray.shutdown()
    nodes = start_ray_nodes([2, 2])
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        ray.init(
            address=nodes.address,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
            log_to_driver=False,
        )
        wait_for_nodes(2)
        yield
    finally:
        ray.shutdown()
        nodes.stop()
        if previous is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = previous


def role(devices: list[int], per_worker: int = 1, strategy: str = "hf") -> RoleConfig:
    return RoleConfig(strategy=strategy, device_mapping=devices, num_devices_per_worker=per_worker)


ROLES = {
    "actor_train": role([0, 1]),
    "actor_infer": role([0, 1], per_worker=2),
    "critic": role([2, 3]),
    "reward": RoleConfig(strategy="function", device_mapping=[], num_workers=1),
}


@dataclass
class Layout:
    manager: ResourceManager
    clusters: dict[str, CountingCluster]

    def close(self) -> None:
        for cluster in self.clusters.values():
            cluster.shutdown()
        self.manager.shutdown()


@pytest.fixture(scope="module")
def layout(ray_session: None) -> Iterator[Layout]:
    manager = ResourceManager(AutoDeviceMapping(ROLES), device_resource=DEVICE)
    clusters: dict[str, CountingCluster] = {}
    try:
        for name, config in ROLES.items():
            clusters[name] = CountingCluster(name, config, backend="ray", resources=manager)
        built = Layout(manager, clusters)
        yield built
    finally:
        Layout(manager, clusters).close()


def devices_free(expected: float, timeout: float = 30.0) -> bool:
    """Wait for Ray to account released reservations (removal is asynchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get(DEVICE, 0.0) == expected:
            return True
        time.sleep(0.1)
    return False


def test_each_worker_runs_on_the_node_that_owns_its_devices(layout: Layout) -> None:
    manager, clusters = layout.manager, layout.clusters
    assert [n.num_devices for n in manager.nodes] == [2, 2]
    node0, node1 = manager.node_id(0), manager.node_id(1)
    assert node0 != node1
    info = [
        i for name in ("actor_train", "actor_infer", "critic") for i in clusters[name].node_info()
    ]
    assert [(i["role"], i["rank"], i["node_id"], i["devices_env"]) for i in info] == [
        ("actor_train", 0, node0, "0"),
        ("actor_train", 1, node0, "1"),
        ("actor_infer", 0, node0, "0,1"),
        ("critic", 0, node1, "0"),
        ("critic", 1, node1, "1"),
    ]
    assert len({i["pid"] for i in info}) == 5  # one process per actor
    assert clusters["critic"].environ("LOCAL_RANK") == ["0", "1"]
    [reward] = clusters["reward"].node_info()
    assert reward["devices"] == [] and reward["node_id"] in {node0, node1}
    # all reserved
    assert ray.cluster_resources()[DEVICE] - ray.available_resources().get(DEVICE, 0.0) == 4.0


def test_colocated_roles_take_turns_on_their_devices(layout: Layout) -> None:
    plan, clusters = layout.manager.plan, layout.clusters
    assert [g.roles for g in plan.groups] == [("actor_train", "actor_infer"), ("critic",)]
    colocation = Colocation(plan, clusters)
    colocation.activate("actor_infer")
    assert [i["offloaded"] for i in clusters["actor_train"].node_info()] == [True, True]
    colocation.activate("actor_train")
    colocation.activate("critic")  # disaggregated: nobody else is touched
    assert clusters["actor_train"].history()[0][-2:] == ["offload", "reload"]
    assert clusters["actor_infer"].history() == [["offload"]]
    assert "offload" not in clusters["critic"].history()[0]
    assert colocation.history == [
        ("offload", "actor_train"),
        ("offload", "actor_infer"),
        ("reload", "actor_train"),
    ]


def test_disaggregated_roles_run_at_the_same_time(layout: Layout) -> None:
    train, critic = layout.clusters["actor_train"], layout.clusters["critic"]
    both = [train.sleep_async(0.5), critic.sleep_async(0.5)]
    intervals = [interval for future in both for interval in future.result()]
    assert max(s for s, _ in intervals) < min(e for _, e in intervals)  # all four ranks overlapped


def test_data_parallel_calls_rendezvous_and_errors_over_ray(layout: Layout) -> None:
    train = layout.clusters["actor_train"]
    out = train.double(Batch({"x": [1, 2, 3, 4]}))
    assert out["x"] == [2, 4, 6, 8] and out["rank"] == [0, 0, 1, 1]
    assert train.stats(Batch({"x": [0, 0, 0, 0]})) == {"rows": 2.0, "rank": 0.5}
    assert train.environ("WORLD_SIZE") == ["2", "2"] and train.environ("RANK") == ["0", "1"]
    assert len(set(train.environ("MASTER_PORT"))) == 1
    with pytest.raises(
        WorkerCallError,
        match=r"actor_train worker rank 1 failed in fail_on\(\): ValueError: rank 1",
    ):
        train.fail_on(1)


def test_reserved_devices_cannot_be_taken_twice(layout: Layout) -> None:
    with pytest.raises(TimeoutError, match="could not reserve the mapped devices within 1 s"):
        ResourceManager(
            AutoDeviceMapping({"reference": role([0])}), device_resource=DEVICE, timeout_s=1
        )


def test_a_run_whose_devices_stay_taken_stops_after_reserve_timeout_s_naming_it(
    layout: Layout,
) -> None:
    """A run on a cluster whose devices another job holds waits ``cluster.reserve_timeout_s``,
    then stops with an error that names it (not a bare TimeoutError)."""
    from trainer.config import load_config
    from trainer.controller.resources import resources_for
    from trainer.errors import TrainerError

    config = load_config(
        None,
        [
            "model.tiny={}",
            "cluster.address=auto",  # Ray is already up: nothing is joined or started
            "cluster.reserve_timeout_s=1",
            "roles.actor_train.device_mapping=[0]",
            "roles.actor_infer.device_mapping=[0]",
        ],
    )
    with pytest.raises(TrainerError, match=r"within 1 s.*cluster\.reserve_timeout_s"):
        resources_for(config)


def test_mappings_that_do_not_fit_are_refused_before_anything_starts(ray_session: None) -> None:
    mapping = AutoDeviceMapping(
        {"actor_train": role([1, 2], per_worker=2), "critic": role([4, 5], per_worker=3)}
    )
    with pytest.raises(DeviceMappingError) as info:
        ResourceManager(mapping, device_resource=DEVICE)
    assert [str(p) for p in info.value.problems] == [
        (
            "roles.critic.device_mapping: 2 devices do not split into workers of 3 devices "
            "(num_devices_per_worker=3); map a multiple of 3 devices or change "
            "num_devices_per_worker"
        ),
        (
            "roles.critic.device_mapping: devices 4-5 do not exist: the cluster has 4 devices "
            "(ids 0-3) across 2 nodes; use smaller ids or add nodes/devices"
        ),
        (
            "roles.actor_train.device_mapping: worker 0 would span nodes [0, 1] (devices [1, 2]); "
            "a worker's devices must be on one node: reorder device_mapping or change "
            "num_devices_per_worker"
        ),
    ]
    with pytest.raises(DeviceMappingError, match="no Ray node offers the resource 'tpu'"):
        ResourceManager(AutoDeviceMapping({"actor_train": role([0])}), device_resource="tpu")


def test_a_worker_that_fails_while_starting_is_reported_by_its_own_error_line(
    ray_session: None,
) -> None:
    """Ray reports a worker whose ``__init__`` raised as ``ActorDiedError`` carrying the whole
    remote traceback in terminal colours; the run's error is the worker's own exception."""
    from tests.trainer.fake_workers import BrokenWorker

    cluster = CountingCluster("actor_train", worker_cls=BrokenWorker, backend="ray", world_size=1)
    try:
        with pytest.raises(WorkerCallError) as info:
            cluster.add(1)
    finally:
        cluster.shutdown()
    message = str(info.value)
    assert "it failed while starting: ValueError: rank 0 cannot load /no/such/model" in message
    assert "\x1b[" not in message and "Traceback" not in message


def test_a_rank_failing_beside_a_stuck_peer_is_reported_and_shutdown_returns(
    ray_session: None,
) -> None:
    """Rank 1 fails while rank 0 waits for it in a "collective": the error names rank 1, and
    shutdown (whose ``close_weight_sync`` call rank 0 never takes) gives rank 0 up and kills it."""
    cluster = ActorCluster("actor_train", worker_cls=CountingWorker, backend="ray", world_size=2)
    cluster.shutdown_timeout_s = 1.0
    with pytest.raises(WorkerCallError, match=r"actor_train worker rank 1 failed in stall_unless"):
        cluster._call_async("stall_unless_failing", 1).result(timeout=120)
    stopper = threading.Thread(target=cluster.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout=120)
    assert not stopper.is_alive(), "shutdown waited for the stuck rank"
    with pytest.raises(ray.exceptions.RayActorError):  # killed: it no longer holds its device
        ray.get(cluster._workers[0].history.remote(), timeout=60)


def test_shutdown_releases_every_device(layout: Layout) -> None:
    layout.close()
    assert devices_free(4.0)
