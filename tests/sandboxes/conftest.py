"""Fixtures for sandbox tests: real backends only.

- ``make_sandbox_for``: parametrised over ``local-bwrap``, ``local-warm`` (bwrap + the warm
  executor pools use), ``local-fork`` (the same, with every ``python3 -c`` run as
  ``python3 -I -c``, which the zygote runs in its forked interpreter instead of exec'ing one),
  ``local-unshare`` and ``docker``; each param skips with the reason when its tool is missing
  on this host.
- ``docker_engine``: a private ``dockerd`` (``sandboxes.dockerd.private_dockerd``: own
  data/exec roots and socket, no iptables, no bridge) started once per test session and
  stopped by pid at the end; docker tests skip with its reason when it cannot start.
- ``docker_image``: ``envhub-sandbox-test:1``, ``docker import``-ed from a tiny rootfs;
  containers bind the host's ``/usr`` read-only, so no registry is needed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandboxes import ExecResult, Limits, Sandbox, SandboxUnavailableError
from sandboxes.dockerd import HOST_USR_RO as USR_RO

TEST_IMAGE = "envhub-sandbox-test:1"
BACKENDS = [
    pytest.param("bwrap", id="local-bwrap"),
    pytest.param("warm", id="local-warm"),
    pytest.param("fork", id="local-fork"),
    pytest.param("unshare", id="local-unshare"),
    pytest.param("docker", id="docker", marks=pytest.mark.docker),
]


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[str]:
    """``unix://...`` of a dockerd started for this test session (stopped by pid at the end)."""
    pytest.importorskip("docker", reason="docker SDK missing: pip install 'envhub[docker]'")
    from sandboxes.dockerd import private_dockerd

    engine = private_dockerd()
    try:
        url = engine.__enter__()
    except SandboxUnavailableError as e:
        pytest.skip(f"no Docker engine for the docker tests: {e}")
    try:
        yield url
    finally:
        engine.__exit__(None, None, None)


@pytest.fixture(scope="session")
def docker_image(docker_engine: str) -> str:
    from sandboxes.dockerd import import_host_image

    return import_host_image(docker_engine, TEST_IMAGE)


def _local_skip_reason(kind: str) -> str | None:
    from sandboxes import _host
    from sandboxes._isolation import probe

    return probe(kind, _host.UID_BASE - 1 if _host.is_root() and kind == "bwrap" else None)


@pytest.fixture(params=BACKENDS)
def make_sandbox_for(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sandbox]]:
    """``factory(**limit_fields)`` -> a started sandbox of this param's backend (stopped after)."""
    kind = request.param
    isolation = "bwrap" if kind in ("warm", "fork") else kind
    if kind in ("warm", "fork") and os.geteuid() != 0:
        pytest.skip("the warm executor needs root (cgroups)")
    if kind != "docker" and (reason := _local_skip_reason(isolation)):
        pytest.skip(f"local isolation {kind!r} unavailable: {reason}")
    created: list[Sandbox] = []

    def factory(**fields: object) -> Sandbox:
        limits = Limits(**{"wall_time_s": 5.0, **fields})  # type: ignore[arg-type]
        if kind == "docker":
            from sandboxes.docker import DockerSandbox

            sandbox: Sandbox = DockerSandbox(
                limits=limits,
                image=request.getfixturevalue("docker_image"),
                base_url=request.getfixturevalue("docker_engine"),
                volumes=USR_RO,
            )
        elif kind == "fork":
            sandbox = _fork_path_sandbox()(limits=limits, isolation=isolation, warm_exec=True)
        else:
            from sandboxes.local import LocalSandbox

            sandbox = LocalSandbox(limits=limits, isolation=isolation, warm_exec=kind == "warm")
        created.append(sandbox)
        return sandbox.start()

    factory.kind = kind  # type: ignore[attr-defined]
    yield factory
    for sandbox in created:
        sandbox.stop()


def _fork_path_sandbox() -> type[Sandbox]:
    from sandboxes._wire import in_process
    from sandboxes.local import LocalSandbox

    class ForkPathSandbox(LocalSandbox):
        """A warm local sandbox whose ``python3 -c CODE`` runs take the zygote's in-process
        path (as ``python3 -I -c CODE``): the adversarial suite then attacks that path too."""

        def _exec(self, argv: list[str], **kwargs: Any) -> ExecResult:
            if argv[:2] == ["python3", "-c"]:
                argv = ["python3", "-I", *argv[1:]]
                executor = self._executor
                if executor is None or not in_process(argv, kwargs["env"], executor.env):
                    raise AssertionError(f"{argv[:3]} would not run in the zygote's fork")
            return super()._exec(argv, **kwargs)

    return ForkPathSandbox


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The unshare fallback runs the adversarial suite in the default tier; its copy of the
    contract tests (same code paths as bwrap above the launcher) is in the slow tier. A test
    marked ``backends(kind, ...)`` exists only for those kinds: the other parametrisations are
    deselected (a property that does not apply to a backend is not a skipped check)."""
    keep, dropped = [], []
    for item in items:
        if "test_contract.py" in item.nodeid and "[local-unshare]" in item.nodeid:
            item.add_marker(pytest.mark.slow)
        marker = item.get_closest_marker("backends")
        callspec = getattr(item, "callspec", None)
        kind = callspec.params.get("make_sandbox_for") if callspec is not None else None
        (dropped if marker and kind is not None and kind not in marker.args else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
