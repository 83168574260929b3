"""AutoDeviceMapping without Ray: groups, node binding, every problem at once, phase switching."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import RoleConfig
from trainer.devices import AutoDeviceMapping, Colocation
from trainer.errors import DeviceMappingError


def role(devices: list[int], per_worker: int = 1, strategy: str = "hf", **kw: object) -> RoleConfig:
    return RoleConfig(
        strategy=strategy, device_mapping=devices, num_devices_per_worker=per_worker, **kw
    )


def test_overlapping_ranges_colocate_and_disjoint_ones_disaggregate() -> None:
    plan = AutoDeviceMapping(
        {
            "actor_train": role([0, 1, 2, 3]),
            "actor_infer": role([0, 1, 2, 3], per_worker=2, strategy="vllm"),
            "reference": role([3]),
            "critic": role([4, 5]),
            "reward": role([], num_workers=3, strategy="function"),
        }
    ).plan()
    assert [g.roles for g in plan.groups] == [
        ("actor_train", "actor_infer", "reference"),
        ("critic",),
    ]
    assert plan.groups[0].colocated and not plan.groups[1].colocated
    assert plan.colocated("actor_train", "reference") and not plan.colocated(
        "actor_train", "critic"
    )
    assert [w.devices for w in plan.roles["actor_infer"].workers] == [(0, 1), (2, 3)]
    assert plan.roles["actor_train"].world_size == 4 and plan.roles["reward"].world_size == 3
    assert plan.group_of("reward") is None
    assert plan.describe().splitlines() == [
        "devices 0-3: actor_train, actor_infer, reference (colocated)",
        "devices 4-5: critic (dedicated)",
        "no devices: reward",
    ]


def test_binding_to_nodes_gives_node_and_local_ids() -> None:
    plan = AutoDeviceMapping({"actor_train": role([2, 3, 4, 5], per_worker=2)}).plan(
        node_devices=[4, 4]
    )
    slots = plan.roles["actor_train"].workers
    assert [(s.node, s.local_devices) for s in slots] == [(0, (2, 3)), (1, (0, 1))]


def test_every_problem_is_reported_at_once() -> None:
    mapping = AutoDeviceMapping(
        {
            "actor_train": role([0, 1, 2], per_worker=2),
            "actor_infer": role([1, 1, -2], strategy="pinned"),
            "critic": role([6, 7, 8, 9], per_worker=2),
        },
        can_offload=lambda strategy: strategy != "pinned",
    )
    with pytest.raises(DeviceMappingError) as info:
        mapping.plan(node_devices=[4, 4])
    assert [str(p) for p in info.value.problems] == [
        "roles.actor_infer.device_mapping: device ids must be >= 0, got [-2]",
        "roles.actor_infer.device_mapping: device ids [1] are listed twice; list each once",
        (
            "roles.actor_train.device_mapping: 3 devices do not split into workers of 2 devices "
            "(num_devices_per_worker=2); map a multiple of 2 devices or change "
            "num_devices_per_worker"
        ),
        (
            "roles.actor_infer.device_mapping: shares devices with actor_train, but strategy "
            "'pinned' cannot offload its state; give it devices of its own (disjoint "
            "device_mapping) or use a strategy that can"
        ),
        (
            "roles.critic.device_mapping: devices 8-9 do not exist: the cluster has 8 devices "
            "(ids 0-7) across 2 nodes; use smaller ids or add nodes/devices"
        ),
    ]
    assert str(info.value).startswith(
        "impossible device mapping: 5 problems\n  - roles.actor_infer"
    )


def test_a_worker_may_not_span_nodes() -> None:
    with pytest.raises(
        DeviceMappingError, match=r"worker 0 would span nodes \[0, 1\] \(devices \[3, 4\]\)"
    ):
        AutoDeviceMapping({"actor_train": role([3, 4], per_worker=2)}).plan(node_devices=[4, 4])


def test_structural_checks_need_no_cluster() -> None:
    mapping = AutoDeviceMapping({"actor_train": role([100])})
    assert mapping.problems() == []  # existence is only known once a cluster is
    assert len(mapping.problems(node_devices=[8])) == 1


class Recorder:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def offload(self) -> None:
        self.log.append(f"offload {self.name}")

    def reload(self) -> None:
        self.log.append(f"reload {self.name}")


def test_colocation_offloads_the_others_and_reloads_the_active_role() -> None:
    plan = AutoDeviceMapping(
        {
            "actor_train": role([0, 1]),
            "actor_infer": role([0, 1]),
            "reference": role([1], offload_params=False, offload_optimizer=False),
            "critic": role([2]),
        }
    ).plan()
    log: list[str] = []
    colocation = Colocation(plan, {name: Recorder(name, log) for name in plan.roles})
    with colocation.phase("actor_infer"):
        pass
    colocation.activate("actor_train")
    colocation.activate("actor_train")  # already resident: nothing to do
    colocation.activate("critic")  # disaggregated: touches nobody
    assert log == ["offload actor_train", "offload actor_infer", "reload actor_train"]
    assert colocation.resident == {
        "actor_train": True,
        "actor_infer": False,
        "reference": True,
        "critic": True,
    }
    with pytest.raises(KeyError, match="roles \\['nobody'\\] have no cluster here"):
        colocation.activate("nobody")


GPU_RECIPE = Path(__file__).resolve().parents[2] / "examples" / "qwen2.5-0.5b-sokoban-8gpu.yaml"


def test_a_local_gpu_run_naming_more_gpus_than_the_machine_has_is_refused_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The 8-GPU recipe on a 1-GPU machine (no cluster.address): refused naming the roles, the
    highest GPU id and the count, before a local Ray is started with GPUs that do not exist."""
    from tests.gpu.recipe_models import QWEN2_5_0_5B, config_json
    from trainer import devices
    from trainer.config import load_config
    from trainer.controller import resources

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a local Ray was started with {args} {kwargs}")

    monkeypatch.setattr(devices, "local_gpu_count", lambda: 1, raising=False)
    monkeypatch.setattr(resources, "init_local_ray", started)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    cfg = load_config(GPU_RECIPE, [f"model.path={config_json(tmp_path, QWEN2_5_0_5B)}"])
    with pytest.raises(DeviceMappingError) as refused:
        resources.resources_for(cfg)
    messages = [str(problem) for problem in refused.value.problems]
    assert messages[0] == (
        "roles.actor_train.device_mapping: names GPU 7 but this machine has 1 GPU "
        "(CUDA_VISIBLE_DEVICES=3); map GPUs 0-0, or set cluster.address to join a Ray cluster "
        "that has them"
    )
    assert [m.split(":")[0] for m in messages] == [
        "roles.actor_train.device_mapping",
        "roles.actor_infer.device_mapping",
        "roles.reference.device_mapping",
    ]


def test_the_gpu_count_is_not_asked_for_cpu_devices_or_a_joined_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainer import devices
    from trainer._config_layout_checks import local_gpu_problems
    from trainer.config import load_config

    def counted() -> int:
        raise AssertionError("the GPUs were counted")

    monkeypatch.setattr(devices, "local_gpu_count", counted)
    wide = ["roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[2]"]
    assert local_gpu_problems(load_config(None, wide)) == []  # envhub_device: host memory
    joined = [*wide, "cluster.device_resource=GPU", "cluster.address=10.0.0.1:6379"]
    assert local_gpu_problems(load_config(None, joined)) == []
