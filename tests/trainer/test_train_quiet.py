"""``envhub train`` prints its own lines, not the libraries' chatter a new user reads first
(``test_cli.CHATTER``, checked on a Ray run by ``test_cli.py::test_sigterm_stops_a_run...``):
here, vLLM's "Triton is installed, but doesn't include CPU backend" alone is quieted, not the
rest of vLLM."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.killed_runs import REPO


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
