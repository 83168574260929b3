"""Shutdown releases everything a run started even when one part fails to stop, and never
replaces the error that stopped the run: a shutdown failure is then logged."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from trainer.controller import Cluster, Worker
from trainer.roles import Roles

closed: list[tuple[str, int]] = []
ROLES = ("actor_train", "actor_infer", "critic")


class Engine(Worker):
    """A worker whose ``close`` fails on ``actor_infer`` rank 0 (a vLLM engine already dead)."""

    def close(self) -> None:
        if self.role == "actor_infer" and self.rank == 0:
            raise RuntimeError("engine shutdown failed (EngineDeadError)")
        closed.append((self.role, self.rank))


class PlacementGroups:
    def __init__(self) -> None:
        self.released = False

    def shutdown(self) -> None:
        self.released = True


class BrokenCluster:
    """A cluster whose shutdown raises (Ray gone mid-kill, a bug)."""

    def shutdown(self) -> None:
        raise RuntimeError("ray.kill failed")


def rank_threads(*roles: str) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(roles))


def test_a_worker_whose_close_fails_does_not_keep_the_other_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed.clear()
    clusters = [Cluster(role, worker_cls=Engine, world_size=2) for role in ROLES]
    resources = PlacementGroups()
    Roles(clusters[0], clusters[1], None, clusters[2], resources, clusters).shutdown()
    assert closed == [
        (role, rank) for role in ROLES for rank in (0, 1) if role != "actor_infer" or rank == 1
    ]
    assert resources.released, "the placement groups were not released"
    assert rank_threads(*ROLES) == []
    assert "actor_infer worker rank 0 failed to close" in caplog.text
    assert "EngineDeadError" in caplog.text


def test_a_cluster_failing_to_stop_keeps_neither_later_clusters_nor_placement_groups() -> None:
    closed.clear()
    actor = Cluster("actor_train", worker_cls=Engine, world_size=1)
    critic = Cluster("critic", worker_cls=Engine, world_size=1)
    resources = PlacementGroups()
    roles = Roles(actor, BrokenCluster(), None, critic, resources, [actor, BrokenCluster(), critic])
    with pytest.raises(RuntimeError, match="ray.kill failed"):
        roles.shutdown()
    assert closed == [("actor_train", 0), ("critic", 0)]
    assert resources.released


def build(out: Path):
    pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
    from tests.trainer.test_cli import QUICKSTART, TINY
    from trainer.config import load_config
    from trainer.pipeline import AgenticPipeline

    overrides = ["train.steps=1", "sft.epochs=0", "eval.episodes=2", f"output_dir={out}"]
    return AgenticPipeline(load_config(QUICKSTART, [*TINY, *overrides]))


def test_a_failing_shutdown_does_not_replace_the_error_that_stopped_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The user sees the run's own error (with its fix), every worker is stopped anyway, the
    shutdown failure is in the log, and the folder is free for the next run."""
    from trainer.errors import TrainerError

    pipeline = build(tmp_path / "run")

    def stopped(*args: object) -> None:
        raise TrainerError("the run's own error; fix: this")

    def sink_close() -> None:
        raise OSError("the metric sink failed to close")

    pipeline.rollouts.next_batch = stopped
    pipeline.log.close = sink_close
    with pytest.raises(TrainerError, match="the run's own error"):
        pipeline.fit()
    assert all(cluster._closed for cluster in pipeline.roles.clusters), "workers left running"
    assert "the metric sink failed to close" in caplog.text
    assert_released(tmp_path / "run")


def assert_released(out: Path) -> None:
    """The next run may take the run folder and its checkpoint folder (their locks are free)."""
    from trainer.checkpoint import CheckpointManager
    from trainer.folder_lock import FolderLock
    from trainer.resume import RUN_LOCK

    FolderLock(out, name=RUN_LOCK, setting="output_dir").release()
    CheckpointManager(out / "checkpoints").close()


def test_a_failing_shutdown_after_a_good_run_is_raised_once_everything_stopped(
    tmp_path: Path,
) -> None:
    pipeline = build(tmp_path / "run")

    def sink_close() -> None:
        raise OSError("the metric sink failed to close")

    pipeline.log.close = sink_close
    with pytest.raises(OSError, match="the metric sink failed to close"):
        pipeline.close()
    assert all(cluster._closed for cluster in pipeline.roles.clusters), "workers left running"
    assert_released(tmp_path / "run")
