"""Which GPUs a Ray worker process sees (``CUDA_VISIBLE_DEVICES``), on a real local Ray.

Ray accepts logical GPUs on a machine without any (``num_gpus=5``) and sets
``CUDA_VISIBLE_DEVICES`` for GPU-requesting actors as it does on real GPUs, so this runs on
CPU machines. One Ray on loopback declares 5 GPUs and 4 ``envhub_device``s. Before the run
reserves its devices, "another job" holds one GPU, so Ray's GPU ids of the run's devices are
not the node-local device ids 0-3. Both layouts map the same roles:

    actor_infer  devices 0,1 | 2,3   two workers, two devices each (tensor parallel)  } colocated
    actor_train  devices 0,1,2,3     four workers, one device each                     }
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.controller.gpu_workers import GpuCluster
from trainer.config import RoleConfig
from trainer.controller.resources import ResourceManager, init_local_ray
from trainer.devices import AutoDeviceMapping

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

REPO = Path(__file__).resolve().parents[3]
ROLES = {
    "actor_infer": RoleConfig(device_mapping=[0, 1, 2, 3], num_devices_per_worker=2),
    "actor_train": RoleConfig(device_mapping=[0, 1, 2, 3]),
}


@dataclass
class Layout:
    manager: ResourceManager
    infer: list[dict[str, Any]]
    """What each actor_infer worker process sees (``GpuWorker.gpus``), by rank."""
    train: list[dict[str, Any]]


def run_layout(device_resource: str) -> Layout:
    """Reserve ROLES' devices on ``device_resource``, start their workers, ask what they see."""
    manager = ResourceManager(AutoDeviceMapping(ROLES), device_resource=device_resource)
    clusters: list[GpuCluster] = []
    try:
        for name, config in ROLES.items():
            clusters.append(GpuCluster(name, config, backend="ray", resources=manager))
        infer, train = (cluster.gpus() for cluster in clusters)
        return Layout(manager, infer, train)
    finally:
        for cluster in clusters:
            cluster.shutdown()
        manager.shutdown()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[list[str]]:
    """The Ray, and the GPU ids ("0"-"4") of the GPU the other job holds."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as env:
        env.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # Ray would refuse 5 GPUs over it
        init_local_ray(
            5,
            device_resource="GPU",
            num_cpus=1,
            resources={"envhub_device": 4.0},
            env_vars={"PYTHONPATH": str(REPO)},  # the workers import tests.trainer.controller
        )
    try:
        other_job = placement_group([{"GPU": 1}])
        assert other_job.wait(60)
        held = ray.get(
            ray.remote(lambda: [str(i) for i in ray.get_gpu_ids()])
            .options(
                num_cpus=0,
                num_gpus=0.5,
                scheduling_strategy=PlacementGroupSchedulingStrategy(other_job, 0),
            )
            .remote()
        )
        yield held
        remove_placement_group(other_job)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def gpu_layout(local_ray: list[str]) -> Layout:
    return run_layout("GPU")


def test_a_worker_with_two_devices_sees_both_their_gpus_first_device_first(
    gpu_layout: Layout,
) -> None:
    # Ray's own GPU of each device's bundle: one-device workers are placed one per device
    bundle_gpu = [worker["ray"] for worker in gpu_layout.train]
    assert all(len(ids) == 1 for ids in bundle_gpu), bundle_gpu
    gpu = [ids[0] for ids in bundle_gpu]
    assert [worker["visible"] for worker in gpu_layout.infer] == [
        f"{gpu[0]},{gpu[1]}",
        f"{gpu[2]},{gpu[3]}",
    ]
    # Ray placed each into its first device's bundle; our numbering is published unchanged
    assert [worker["ray"] for worker in gpu_layout.infer] == [[gpu[0]], [gpu[2]]]
    assert [worker["devices"] for worker in gpu_layout.infer] == ["0,1", "2,3"]


def test_colocated_one_device_workers_see_the_same_gpu_as_ray_gives_them(
    gpu_layout: Layout,
) -> None:
    train = gpu_layout.train
    assert [worker["visible"] for worker in train] == [worker["ray"][0] for worker in train]
    assert [worker["devices"] for worker in train] == ["0", "1", "2", "3"]
    infer_gpus = [gpu for worker in gpu_layout.infer for gpu in worker["visible"].split(",")]
    assert infer_gpus == [worker["visible"] for worker in train]  # device by device


def test_the_workers_cover_the_reserved_gpus_and_not_another_jobs(
    gpu_layout: Layout, local_ray: list[str]
) -> None:
    held = local_ray
    seen = [gpu for worker in gpu_layout.infer for gpu in worker["visible"].split(",")]
    assert len(held) == 1 and len(set(seen)) == 4
    assert sorted([*held, *seen]) == ["0", "1", "2", "3", "4"]


def test_a_cluster_of_custom_resource_devices_leaves_cuda_visible_devices_alone(
    local_ray: list[str],
) -> None:
    layout = run_layout("envhub_device")
    for worker in [*layout.infer, *layout.train]:
        assert worker["visible"] is None and worker["ray"] == []
    assert [worker["devices"] for worker in layout.infer] == ["0,1", "2,3"]


def test_a_gpu_probe_that_fails_names_itself_and_frees_the_devices(
    local_ray: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.trainer.controller.gpu_workers import failing_gpu_probe
    from trainer.controller import resources
    from trainer.errors import TrainerError

    monkeypatch.setattr(resources, "_bundle_gpu_ids", failing_gpu_probe)
    with pytest.raises(TrainerError, match="GPU id") as refused:
        ResourceManager(AutoDeviceMapping(ROLES), device_resource="GPU", timeout_s=30)
    assert "no CUDA driver in this worker" in str(refused.value)
    monkeypatch.undo()
    again = ResourceManager(AutoDeviceMapping(ROLES), device_resource="GPU", timeout_s=30)
    again.shutdown()  # (the failed start left the four devices free to reserve)
