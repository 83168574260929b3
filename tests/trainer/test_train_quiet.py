"""``envhub train`` prints its own lines, not the libraries' chatter a new user reads first:
Ray's "Started a local Ray instance" and token-authentication notice, the workers' per-load
"Loading weights" bars, vLLM's "Triton is installed, but doesn't include CPU backend" (real
errors still show: only these messages' sources are quieted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.killed_runs import REPO
from tests.trainer.test_cli import QUICKSTART, TINY

CHATTER = (
    "Started a local Ray instance",
    "Token authentication is",
    "Loading weights",
    "Triton is installed",
)


@pytest.mark.timeout(300)
def test_a_ray_run_prints_no_library_chatter(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # as a user has it
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HOME=str(tmp_path))  # (Ray's token)
    out = tmp_path / "run"
    args = [*TINY, "sft.epochs=1", "train.steps=1", "eval.every=0", "cluster.backend=ray"]
    done = subprocess.run(
        [sys.executable, "-m", "envhub.cli", "train", str(QUICKSTART), *args, f"output_dir={out}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "done: eval/success" in done.stdout
    assert not [line for line in log.splitlines() if any(c in line for c in CHATTER)], log


def test_the_driver_quiets_tritons_cpu_notice_only() -> None:
    """vLLM's tool parsers (imported where a run renders tools) announce on import that Triton
    has no CPU backend; the module saying it is quieted below ERROR, the rest of vLLM is not."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    code = (
        "import logging\n"
        "from trainer.pipeline import _quiet_libraries\n"
        "_quiet_libraries()\n"
        "import vllm.triton_utils.importing\n"
        "print(logging.getLogger('vllm').getEffectiveLevel() <= logging.WARNING)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Triton is installed" not in done.stdout + done.stderr
    assert done.stdout.strip() == "True"  # vLLM's other warnings still show
