"""Trainer roles on two Ray nodes: the actor on one, the inference engine on the other, weights
moved by the broadcast sync (``weight_sync.transport: broadcast``) between them.

The cluster is real: ``ray start --head`` and ``ray start --address`` subprocesses
(``tests.trainer.ray_nodes``), one ``envhub_device`` each, so ``roles.actor_train.device_mapping:
[0]`` lands on node 0 and ``roles.actor_infer.device_mapping: [1]`` on node 1, and the run joins
it with ``cluster.address``, as a user joins theirs. What a user would notice if the sync broke
(the engine keeps serving old weights, or half-loaded ones): the rollouts after the first update
and the final evaluation would differ from the same run in one process, where weights move
through shared memory. They must not: every metric of every step is the single-process run's
(to 1e-9: the two runs' processes differ, so a KL of ~1e-14 may come out as another ~1e-14).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
pytest.importorskip("psutil", reason="psutil is needed to stop the test's own Ray processes")

from tests.trainer.killed_runs import comparable
from tests.trainer.ray_nodes import RayNodes, start_ray_nodes, wait_for_nodes
from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline

RUN = [*TINY, "train.steps=2", "checkpoint.every=0", "eval.every=0", "train.ppo_epochs=1"]
"""Two RL steps, each followed by a sync; evaluated before and after (greedy, on the engine)."""


@pytest.fixture
def two_nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[RayNodes]:
    if ray.is_initialized():
        ray.shutdown()
    nodes = start_ray_nodes([1, 1])
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the test cluster's mode (loopback only)
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.stop()


@pytest.mark.slow  # two `ray start` nodes and two runs: ~1-2 min on the 2-core VM
@pytest.mark.timeout(600)
def test_actor_and_engine_on_two_nodes_train_like_one_process_through_the_broadcast_sync(
    tmp_path: Path, two_nodes: RayNodes
) -> None:
    one_process = AgenticPipeline(
        load_config(QUICKSTART, [*RUN, f"output_dir={tmp_path / 'one'}"])
    ).fit()
    config = load_config(
        QUICKSTART,
        [
            *RUN,
            f"output_dir={tmp_path / 'two'}",
            "cluster.backend=ray",
            f"cluster.address={two_nodes.address}",
            "roles.actor_train.device_mapping=[0]",
            "roles.actor_infer.device_mapping=[1]",
            "weight_sync.transport=broadcast",
        ],
    )
    pipeline = AgenticPipeline(config)
    wait_for_nodes(2)
    [actor], [engine] = pipeline.roles.actor.node_info(), pipeline.roles.infer.node_info()
    assert actor["node_id"] != engine["node_id"], (
        "the actor and the engine were to run on different nodes"
    )
    assert {actor["node_id"], engine["node_id"]} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert pipeline.weight_sync.transport == "broadcast"
    two_nodes_rows = pipeline.fit()
    assert [r["step"] for r in two_nodes_rows] == [0, 1, 2]
    for mine, theirs in zip(two_nodes_rows, one_process, strict=True):
        # float noise only (approx_kl_old ~1e-14)
        assert comparable(mine) == pytest.approx(comparable(theirs), rel=0, abs=1e-9), (
            f"step {mine['step']} differs from the one-process run"
        )
