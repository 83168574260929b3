"""What each backend says it protects against is true to the test suite: every property names
tests that exist, the backend's docstring names them too, and ``envhub sandbox info`` shows it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sandboxes import BACKENDS, Limits, backend_class

PROJECT = Path(__file__).resolve().parents[2]


def _defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def _documented_backends() -> list[str]:
    names = []
    for name in BACKENDS:
        try:
            if backend_class(name).PROTECTS:
                names.append(name)
        except ImportError:
            continue
    return names


@pytest.mark.parametrize("backend", _documented_backends())
def test_every_protected_property_names_tests_that_exist_and_are_documented(backend):
    cls = backend_class(backend)
    doc = sys.modules[cls.__module__].__doc__ or ""
    assert cls.NOT_PROTECTED, f"{backend}: say what is not protected"
    for protection in cls.PROTECTS:
        assert protection.tests, f"{backend}: {protection.name!r} names no test"
        for ref in protection.tests:
            file, _, name = ref.partition("::")
            assert name in _defined_tests(PROJECT / file), f"{backend}: {ref} does not exist"
            assert name in doc, f"{backend}: the module docstring does not name {name}"


def test_local_is_documented():
    assert "local" in _documented_backends()


def test_sandbox_info_lists_properties_their_tests_and_what_is_not_protected():
    from envhub.cli import main

    result = CliRunner().invoke(main, ["sandbox", "info", "--backend", "local"])
    assert result.exit_code == 0, result.output
    cls = backend_class("local")
    for protection in cls.PROTECTS:
        assert f"- {protection.name}:" in result.output
        assert protection.tests[0].rsplit("::", 1)[-1] in result.output
    assert result.output.count("not protected:") == len(cls.NOT_PROTECTED)


def test_network_mode_says_what_it_exposes():
    from sandboxes.local import LocalSandbox

    with LocalSandbox(limits=Limits(network=True)) as sb:
        assert "abstract UNIX sockets" in sb.protections["network"]
