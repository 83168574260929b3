"""``envhub sandbox``: the commands a person uses to try a backend by hand."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from envhub.cli import main
from tests.helpers import host_processes_with
from tests.sandboxes.conftest import _local_skip_reason

needs_local = pytest.mark.skipif(
    bool(_local_skip_reason("bwrap") and _local_skip_reason("unshare")),
    reason="no local isolation here (needs bubblewrap or root)",
)


def invoke(*args: str):
    return CliRunner().invoke(main, ["sandbox", *args], catch_exceptions=False)


@needs_local
def test_network_attempt_is_reported_as_a_contained_failure():
    result = invoke(
        "run",
        "--backend",
        "local",
        "--",
        "python3",
        "-c",
        "import socket; socket.create_connection(('127.0.0.1', 22))",
    )
    assert result.exit_code == 1
    assert "ConnectionRefusedError" in result.output or "Network is unreachable" in result.output
    assert "network off] exit 1" in result.output


@needs_local
def test_fork_bomb_returns_and_leaves_nothing_behind():  # a hang would hit the test timeout
    result = invoke(
        "run",
        "--timeout",
        "3",
        "--max-processes",
        "32",
        "--",
        "sh",
        "-c",
        "b() { b | b & }; b; wait",
    )
    # The top shell may hit the process cap ("Cannot fork"), run into the deadline, or return at
    # once while its detached children keep forking; whichever happens, none may outlive the run.
    assert (
        "Cannot fork" in result.output
        or "wall time limit" in result.output
        or "exit 0" in result.output
    ), result.output
    # the kill is sent when the run returns; the kernel reaps them just after
    deadline = time.monotonic() + 5
    while (left := host_processes_with("b() { b | b & }")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "fork-bomb processes outlived the sandbox"


@needs_local
def test_json_output_and_limits_flags():
    result = invoke("run", "--json", "--timeout", "1", "--", "sh", "-c", "echo hi; sleep 5")
    data = json.loads(result.output)
    assert data["stdout"] == "hi\n" and data["timed_out"] is True and data["ok"] is False
    assert data["backend"].startswith("local/")
    assert result.exit_code == 137


def test_bad_limit_is_a_clear_error():
    result = invoke("run", "--memory-mb", "0", "--", "true")
    assert result.exit_code == 2 and "Limits.memory_mb must be a positive int" in result.output


def test_help_is_fast_and_imports_no_backend_sdk():
    code = (
        "import sys; from click.testing import CliRunner; from envhub.cli import main; "
        "r = CliRunner().invoke(main, ['sandbox', '--help']); assert r.exit_code == 0, r.output; "
        "assert 'run' in r.output and 'info' in r.output; "
        "bad = [m for m in ('docker', 'e2b', 'sandboxes.local') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
