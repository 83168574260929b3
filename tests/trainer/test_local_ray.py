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


def command(process: psutil.Process) -> str:
    """``process``'s command line ("" once it ended or became a zombie)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.slow
def test_a_run_killed_with_sigkill_leaves_no_process_of_its_ray_session(tmp_path: Path) -> None:
    """``kill -9`` (or the OOM killer) of a ray-backend run: Ray's agents, children of its
    raylet, would outlive the driver forever; nothing the run started may survive it."""
    import signal

    from tests.trainer.killed_runs import KILL_AFTER, RUN_DIR, envhub_train
    from tests.trainer.test_cli import QUICKSTART, TINY

    out = tmp_path / "run"
    proc = envhub_train(
        str(QUICKSTART),
        *TINY,
        "env.id=test/frozen-lake-v0",
        "logging.progress=false",
        "cluster.backend=ray",
        "cluster.num_cpus=2",
        "sft.epochs=0",
        "train.steps=3",
        "eval.every=0",
        f"output_dir={out}",
        cwd=tmp_path,
        test_envs=True,
        **{RUN_DIR: str(out), KILL_AFTER: "0"},
    )
    assert proc.stdout is not None
    started = []
    for line in proc.stdout:  # the workers are up once the run says what it evaluates
        if line.startswith("eval:"):
            started = psutil.Process(proc.pid).children(recursive=True)
            break
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, f"the run was to be killed, it exited:\n{log}"
    assert any("DashboardAgent" in command(p) for p in started), log
    _, alive = psutil.wait_procs(started, timeout=60)  # a hang guard: all is gone in seconds
    assert [command(p)[:80] for p in alive] == []


def test_a_run_naming_another_cluster_in_a_process_already_on_ray_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second run in one process (a notebook) with ``cluster.address`` ran on the Ray the first
    run had started, silently: ``ray.init`` is done once per process."""
    from trainer.controller.resources import init_local_ray
    from trainer.errors import TrainerError

    if ray.is_initialized():
        ray.shutdown()
    # (a token-auth local Ray leaves this process unable to start actors on another cluster
    # after ray.shutdown(): Ray's own state; the later tests join `ray start` clusters)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    init_local_ray(1, num_cpus=1)
    try:
        current = ray.get_runtime_context().gcs_address
        config = load_config(None, ["cluster.address=127.0.0.1:1", "cluster.num_cpus=1"])
        with pytest.raises(TrainerError) as refused:
            resources_for(config)
        message = str(refused.value)
        assert "cluster.address '127.0.0.1:1'" in message and current in message
        assert "ray.shutdown()" in message
    finally:
        ray.shutdown()
