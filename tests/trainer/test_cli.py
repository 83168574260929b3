"""`envhub train` end to end: a real short run, clear errors, NaN stop, and resume after kill -9
(the ``hf`` run; vLLM, FSDP2 and async mode are in ``test_resume.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
from click.testing import CliRunner

from envhub.cli import main
from tests.trainer.killed_runs import comparable, envhub_train, rows

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
TINY = [
    "sft.episodes=16",
    "sft.epochs=4",  # (the quickstart's 16 passes are for learning, not for tests)
    "sft.batch_size=8",
    "eval.episodes=8",
    "env.num_groups=2",
    "env.group_size=4",
    "logging.progress=false",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
]


KILL_DIR = "ENVHUB_TEST_KILL_AFTER_STEP_3"


def kill_after_step_3(episode) -> float:
    """Reward 0; the first time it scores an episode after step 3 was logged (step 4's rollout,
    so step 3 is logged but not checkpointed), it SIGKILLs the training process it runs in (the
    local backend's reward worker is a thread of it). A marker file makes that happen once."""
    out = Path(os.environ[KILL_DIR])
    if (
        not (out / "killed").exists()
        and (out / "metrics.jsonl").exists()
        and any(r["step"] == 3 for r in rows(out))
    ):
        (out / "killed").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


@contextlib.contextmanager
def envhub_view(*run_dirs: Path) -> Iterator[str]:
    """``envhub view RUN_DIR ... --port 0`` in a child process; yields the URL it prints."""
    env = {**os.environ, "PYTHONPATH": str(QUICKSTART.parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "envhub.cli", "view", *map(str, run_dirs), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed once the socket is bound
        match = re.search(r"at (http://\S+/)", first)
        assert match, first + proc.stdout.read()
        yield match[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


CHATTER = (
    "Started a local Ray instance",
    "Token authentication is",
    "Loading weights",
    "Triton is installed",
)
"""Libraries' lines ``envhub train`` quiets: Ray's start and token notices, the workers'
per-load bars, vLLM's Triton notice (their sources only: real errors still show)."""


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_sigterm_stops_a_run_in_order_and_says_so(tmp_path: Path, backend: str) -> None:
    """A scheduler's preemption (SIGTERM) stops the run as Ctrl-C does: the run shuts its
    workers down and says how it ended (Ray's own handler, installed by ``ray.init``, aborted
    the process with a C++ stack dump and skipped the shutdown)."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    proc = envhub_train(
        str(QUICKSTART),
        *TINY,
        "train.steps=50",
        "eval.every=0",
        f"cluster.backend={backend}",
        f"output_dir={out}",
        cwd=tmp_path,
        HOME=str(tmp_path),  # (a first Ray start here writes its token: its notice shows)
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # RL under way: every worker is up
        seen.append(line)
        if line.startswith("step 1:"):
            break
    workers = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    log = "".join(seen) + rest
    assert proc.returncode == 143, log
    assert "stopped by SIGTERM" in log and "SIGTERM received" not in log, log
    assert f"continue from {out / 'checkpoints' / 'step_00000000'} with --resume" in log
    _, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive, [p.info for p in alive]
    # and it printed its own lines, not the libraries' chatter a new user reads first
    assert not [line for line in log.splitlines() if any(c in line for c in CHATTER)], log


def test_short_run_writes_metrics_curve_checkpoints_store_and_policy(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = envhub_train(
        str(QUICKSTART), *TINY, "train.steps=2", "eval.every=0", f"output_dir={out}", cwd=tmp_path
    )
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, log
    assert log.splitlines()[0] == f"output: {out.resolve()}"
    # how to serve the policy, and (CPU, head size 8) the retraining vLLM's CPU build needs
    serve = f"serve    python -m vllm.entrypoints.openai.api_server --model {out / 'final_policy'}"
    assert serve in log and "train with model.tiny.num_heads=1 to serve it here" in log
    metrics = rows(out)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    # evaluated before any RL update
    assert metrics[0]["eval/success"] is not None and "sft/nll" in metrics[0]
    # each progress line is one line whatever its length (a log file is no 80-column terminal)
    steps = [line for line in log.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(line.endswith(")") for line in steps), steps
    # the warm start says where it is: a line per epoch here (logging.progress=false)
    epochs = [line for line in log.splitlines() if line.startswith("warm start: epoch")]
    assert [line.split(",")[0] for line in epochs] == [
        f"warm start: epoch {k}/4" for k in (1, 2, 3, 4)
    ]
    assert "SFT step 8/8" in epochs[-1] and "nll" in epochs[-1], epochs
    assert metrics[-1]["eval/success"] is not None  # and at the end
    for key in (
        "time_s",
        "train/success",
        "train/reward",
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "timing/rollout_s",
        "timing/train_s",
    ):
        assert key in metrics[1], key
    assert (out / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    # the run's trajectory store, served by the command the summary names
    assert f"view     envhub view {out}" in log
    with envhub_view(out) as url:
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert "<title>envhub view</title>" in page
        query = urllib.parse.urlencode({"kind": "train", "step": 2, "limit": 500})
        episodes = json.load(urllib.request.urlopen(f"{url}api/episodes?{query}", timeout=30))
        assert episodes["total"] == 8  # 2 groups x 4 episodes, every one stored
        assert {r["env_id"] for r in episodes["rows"]} == {"games/frozen-lake-v0"}
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final_policy") is not None


@pytest.mark.parametrize(
    ("text", "override", "expected"),
    [
        ("model: [unclosed", (), "broken YAML"),
        ("env:\n  group_sise: 4\n", (), "env.group_sise: unknown key"),
        (
            "model:\n  path: /nonexistent/qwen\n",
            (),
            "model.path: '/nonexistent/qwen' does not exist",
        ),
    ],
)
def test_bad_configs_fail_clearly(
    tmp_path: Path, text: str, override: tuple[str, ...], expected: str
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    result = CliRunner().invoke(
        main, ["train", str(config), f"output_dir={tmp_path / 'o'}", *override]
    )
    assert result.exit_code in (1, 2) and expected in result.output, result.output


def test_a_nan_update_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    """A learning rate that blows the weights up after step 0: step 1's gradient is NaN, the
    run stops before applying it and names the last good checkpoint (a NaN reward no longer
    gets this far: the reward function's episodes fail, ``test_env_output``)."""
    out = tmp_path / "nan"
    result = CliRunner().invoke(
        main,
        [
            "train",
            str(QUICKSTART),
            *TINY,
            "train.steps=3",
            "sft.epochs=0",
            "train.lr=1e30",
            f"output_dir={out}",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "step 1: the" in result.output and "became nan" in result.output, result.output
    assert "last good checkpoint is" in result.output
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000000"


def test_resume_after_kill_9_gives_identical_next_step_metrics(tmp_path: Path) -> None:
    out = tmp_path / "resume"
    killer = "{kind: function, function: 'tests.trainer.test_cli:kill_after_step_3'}"
    args = [
        str(QUICKSTART),
        *TINY,
        "train.steps=4",
        "checkpoint.every=2",
        "eval.every=0",
        f"output_dir={out}",
        f"env.rewards=[{killer}]",
    ]
    proc = envhub_train(*args, cwd=tmp_path, **{KILL_DIR: str(out)})
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, (
        f"the run was to be killed after step 3, it exited {proc.returncode}:\n{log}"
    )
    killed = {r["step"]: r for r in rows(out)}
    assert sorted(killed) == [0, 1, 2, 3]  # step 3 was logged, then the process died in step 4
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    resumed = envhub_train(*args, "--resume", cwd=tmp_path, **{KILL_DIR: str(out)})
    log, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, log
    after = {r["step"]: r for r in rows(out)}
    assert sorted(after) == [0, 1, 2, 3, 4]
    # the step after the checkpoint, replayed identically
    assert comparable(after[3]) == comparable(killed[3])
    assert after[3]["time_s"] >= after[2]["time_s"]


def test_resume_lists_settings_that_differ_from_the_saved_config(tmp_path: Path) -> None:
    from trainer.checkpoint import CheckpointManager
    from trainer.cli import config_drift
    from trainer.config import load_config

    saved = load_config(QUICKSTART, [f"output_dir={tmp_path}"])
    CheckpointManager(saved.checkpoint_dir).save(2, config=saved.model_dump(mode="json"), rng=False)
    assert config_drift(load_config(QUICKSTART, [f"output_dir={tmp_path}"])) == []
    edited = load_config(QUICKSTART, [f"output_dir={tmp_path}", "train.lr=0.5", "env.group_size=3"])
    lines = config_drift(edited)
    assert "2 setting(s)" in lines[0]
    assert any(line.startswith("train.lr: ") and "-> 0.5 now" in line for line in lines)
    assert any(line.startswith("env.group_size: ") and "step_00000002" in line for line in lines)
    # no checkpoint yet
    assert config_drift(load_config(QUICKSTART, [f"output_dir={tmp_path / 'fresh'}"])) == []
