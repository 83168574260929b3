"""``resources_for(config)``: the single-node Ray a CPU run starts for itself, on loopback only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.fake_workers import CountingCluster
from trainer.config import load_config
from trainer.controller.resources import LOOPBACK_NODE_IP, resources_for

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
psutil = pytest.importorskip("psutil", reason="psutil lists the sockets Ray opened")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_run_config_starts_local_ray_that_talks_only_over_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the local Ray's workers import the test workers
    config = load_config(
        None,
        [
            "roles.actor_train.device_mapping=[0,1]",
            "roles.actor_train.strategy=fsdp2",
            "roles.actor_infer.device_mapping=[2]",
            "cluster.num_cpus=1",
        ],
    )
    assert resources_for(load_config(None, ["cluster.backend=local"])) is None
    manager = resources_for(config)
    try:
        [node] = ray.nodes()
        assert node["NodeManagerAddress"] == LOOPBACK_NODE_IP
        assert ray.cluster_resources()["envhub_device"] == 3.0  # highest mapped id + 1
        role = config.roles.actor_train
        with CountingCluster("actor_train", role, backend="ray", resources=manager) as cluster:
            assert cluster.add(1) == [1, 2]
            assert [i["devices_env"] for i in cluster.node_info()] == ["0", "1"]
        remote = set()
        for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                remote |= {c.raddr.ip for c in proc.net_connections("inet") if c.raddr}
            except psutil.Error:
                pass
        assert remote and all(ip.removeprefix("::ffff:").startswith("127.") for ip in remote), (
            remote
        )
    finally:
        manager.shutdown()
        ray.shutdown()
