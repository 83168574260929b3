"""The adapters as plugins: entry points, `envhub list --source`, the catalog, missing sources.

The adapters are registered by envhub's own pyproject through the `envhub.envs` entry-point
group, as a third-party package would be; these tests read that mechanism (installed metadata)
rather than calling the adapters' register functions directly.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

pytest.importorskip(
    "textarena", reason="needs the textarena extra: pip install 'envhub[textarena]'"
)
pytest.importorskip("gem", reason="needs the gem extra: pip install 'envhub[gem]'")
pytest.importorskip(
    "reasoning_gym", reason="needs the reasoning-gym extra: pip install 'envhub[reasoning-gym]'"
)
pytest.importorskip("openenv", reason="needs the openenv extra: pip install 'envhub[openenv]'")

import envhub
from envhub.adapters import SOURCES
from envhub.adapters.catalog import catalog
from envhub.registry import ENTRY_POINT_GROUP

ROOT = Path(__file__).resolve().parents[3]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "envhub.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        check=False,
    )


def test_each_source_is_an_installed_entry_point_and_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"][ENTRY_POINT_GROUP]
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    for name, source in SOURCES.items():
        assert declared[name] == installed[name], f"reinstall envhub (pip install -e .): {name}"
        assert source.extra in project["optional-dependencies"]
        assert f"envhub[{source.extra}]" in source.install_hint


@pytest.mark.parametrize(
    ("source", "example"),
    [
        ("textarena", "textarena/TicTacToe-v0"),
        ("gem", "gem/game.Sudoku-easy-v0"),
        ("reasoning-gym", "reasoning-gym/leg_counting-v0"),
        ("openenv", "openenv/remote-v0"),
    ],
)
def test_every_source_lists_its_ids_under_its_namespace(source, example):
    ids = {spec.id for spec in envhub.list_envs() if spec.source == source}
    assert example in ids
    assert all(env_id.startswith(f"{source}/") for env_id in ids)


def test_envhub_list_source_shows_one_source_and_names_the_known_ones():
    listed = cli("list", "--source", "reasoning-gym", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["envs"]
    # reasoning-gym 0.1.x's 104 datasets but propositional_logic (refused), each with -retry
    assert len(rows) == 2 * 103 and {row["source"] for row in rows} == {"reasoning-gym"}
    wrong = cli("list", "--source", "reasoning_gym")
    assert wrong.returncode == 2
    assert "Did you mean 'reasoning-gym'?" in wrong.stderr and "textarena" in wrong.stderr


BLOCK_TEXTARENA = textwrap.dedent(
    """
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "textarena":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Block())
    from envhub.cli import main
    main()
    """
)


def test_a_missing_source_package_is_named_with_its_extra():
    """As if textarena were not installed: its ids are absent, and every way to reach them
    says which extra to install."""
    env = {**os.environ, "COLUMNS": "200"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", BLOCK_TEXTARENA, *args],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env=env,
            check=False,
        )

    listed = run("list", "--source", "textarena")
    assert listed.returncode == 2
    assert "pip install 'envhub[textarena]'" in listed.stderr
    info = run("info", "textarena/TicTacToe-v0")
    assert info.returncode == 2
    assert "no environment registered under 'textarena/TicTacToe-v0'" in info.stderr
    assert "pip install 'envhub[textarena]'" in info.stderr
    others = run("list", "--source", "reasoning-gym", "--json")
    assert others.returncode == 0 and json.loads(others.stdout)["envs"]


def test_the_catalog_is_computed_once_per_source_version(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVHUB_CACHE_DIR", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return [{"id": "reasoning-gym/x-v0", "kwargs": {}}]

    first = catalog("reasoning-gym", "reasoning-gym", compute)
    again = catalog("reasoning-gym", "reasoning-gym", compute)
    assert first == again == [{"id": "reasoning-gym/x-v0", "kwargs": {}}] and len(calls) == 1
    (stored,) = (tmp_path / "catalogs").iterdir()
    assert importlib.metadata.version("reasoning-gym") in stored.name
    stored.write_text("{torn")  # a damaged file is recomputed, never an error
    assert catalog("reasoning-gym", "reasoning-gym", compute) == first and len(calls) == 2
