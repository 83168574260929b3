"""`envhub check --all` as a user runs it on a fresh install: every built-in id passes.

One subprocess runs the real command, so what is checked is exactly what a user gets: every
built-in env and variant (the adapted ecosystems' ids are checked on named samples in
tests/envhub/adapters/), with the components `make test` installs (Chromium, bubblewrap, the
MCP SDK). This is the one place the default tier runs the full checker over the registry (the
per-family test files check behaviour, not the contract again).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from envhub.registry import BUILTIN_PLUGINS
from envs.web.browser_pool import chromium_path

BUILTIN = [arg for source in BUILTIN_PLUGINS for arg in ("--source", source)]


@pytest.mark.timeout(600)
def test_envhub_check_all_exits_0() -> None:
    if chromium_path() is None:
        pytest.skip(
            "Chromium is not installed (apt-get install -y chromium): web/browser-* cannot be "
            "checked"
        )
    if importlib.util.find_spec("playwright") is None:
        pytest.skip(
            "Playwright is not installed (pip install 'envhub[web]'): web/browser-* cannot be "
            "checked"
        )
    from tests.sandboxes.conftest import _local_skip_reason

    if _local_skip_reason("bwrap") and _local_skip_reason("unshare"):
        pytest.skip(
            "no local sandbox isolation (apt-get install -y bubblewrap, or run as root): code/* "
            "cannot be checked"
        )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        # two at a time, as a user with two cores would: browser and sandbox checks mostly wait
        [sys.executable, "-m", "envhub.cli", "check", "--all", "--jobs", "2", *BUILTIN],
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
        check=False,
    )
    output = proc.stdout + proc.stderr
    failed = [line.strip() for line in output.splitlines() if "✗" in line or "failed:" in line]
    assert proc.returncode == 0, (
        f"envhub check --all exited {proc.returncode}: {failed}\n{output[-3000:]}"
    )
    summary = re.search(r"all (\d+) environment\(s\) passed", output)
    assert summary, output[-2000:]
    # what a fresh process registers (this pytest process also holds ids other tests registered)
    count = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import envhub; from envhub.registry import BUILTIN_PLUGINS as B; "
                "print(sum(s.source in B for s in envhub.list_envs()))"
            ),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # every built-in id and variant was checked
    assert int(summary.group(1)) == int(count.stdout) >= 27
