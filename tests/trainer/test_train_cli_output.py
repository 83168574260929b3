"""What ``envhub train`` prints while it runs, as a user reads it in a log file (nohup, sbatch,
CI: output that is not a terminal):

- plain ``step N: ...`` lines instead of a live bar (which drew nothing until the run ended):
  the warm-started step 0, every evaluated step and the last, and one at least every 30 s;
- the invalid-action rate beside success and reward;
- one warning, once, when steps in a row had no learning signal (every group's episodes got the
  same reward, so every advantage was 0): the run no longer trains to the end in silence.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
from click.testing import CliRunner

from envhub.cli import main
from tests.trainer.test_cli import QUICKSTART, TINY

SAME_REWARD = (
    "env.rewards=[{kind: function, mode: replace, "
    "function: 'tests.trainer.test_train_cli_output:same_reward'}]"
)


def same_reward(episode) -> float:
    """Every episode scores 0: no group has anything to learn from."""
    return 0.0


def test_a_run_into_a_file_prints_plain_steps_and_warns_once_of_no_learning_signal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    args = [o for o in TINY if not o.startswith("logging.progress")]
    result = CliRunner().invoke(
        main,
        [
            "train", str(QUICKSTART), *args, "sft.epochs=0", "train.steps=4", "eval.every=2",
            "eval.episodes=4", "env.num_groups=1", SAME_REWARD, f"output_dir={out}",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    numbers = [int(line.split(":")[0].removeprefix("step ")) for line in steps]
    assert {0, 2, 4} <= set(numbers), result.stdout  # warm start, evaluations, the last
    assert all("invalid " in line for line in steps), steps
    assert result.stdout.index("step 4:") < result.stdout.index("done: eval/success")
    warnings = [line for line in result.stderr.splitlines() if "no learning signal" in line]
    assert len(warnings) == 1, result.stderr
    [warning] = warnings
    assert warning.startswith("warning: no learning signal for 3 steps: ")
    assert "every group's episodes got the same reward" in warning
    assert f"envhub view {out}" in warning
    # and it still reaches logging handlers of the caller's own (pytest's, here)
    assert any("no learning signal" in r.getMessage() for r in caplog.records), caplog.records
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(row["train/zero_variance_groups"] == 1.0 for row in rows[1:])
    assert all(0.0 <= row["train/turns_at_max_new_tokens"] <= 1.0 for row in rows[1:])


def test_the_learning_signal_metrics_leave_env_workers_rows_packed() -> None:
    from trainer.metrics import learning_signal
    from trainer.rollout.trajectory import Trajectory
    from trainer.rollout.wire import trajectory_from_wire, trajectory_to_wire

    episodes = []
    for group in range(2):
        trajectory = Trajectory("x", 0, group)
        trajectory.append_context([1, 2, 3])
        trajectory.append_policy([4, 5], [0.0, 0.0])
        trajectory.end_turn(float(group))
        episodes.append(trajectory_from_wire(trajectory_to_wire(trajectory)))
    metrics = learning_signal(episodes, max_new_tokens=2)
    assert metrics["train/turns_at_max_new_tokens"] == 1.0
    assert all(e._counted() is not None for e in episodes), "a row was unpacked"
