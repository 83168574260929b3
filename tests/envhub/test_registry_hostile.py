"""Plugin discovery against installed packages that misbehave.

Each test installs a plugin as pip would leave it (a module and a ``.dist-info`` folder with
its ``entry_points.txt``) into a folder put on the path, and checks what a user notices: every
command still works, the built-in ids are still there, and the broken package is named.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

import envhub.cli
import envhub.registry
from envhub.cli import main
from envhub.errors import UnknownEnvError
from envhub.registry import Registry


def install(site: Path, name: str, module: str | None, entry_points: str) -> Path:
    """A distribution ``name`` as pip installs it: ``name.py`` and ``name-0.1.dist-info``."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    if module is not None:
        (site / f"{name}.py").write_text(module)
    return site


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Install plugins into a folder on ``sys.path``; commands then see a fresh registry."""

    def install_plugin(name: str, module: str | None, entry_points: str) -> Registry:
        install(tmp_path, name, module, entry_points)
        monkeypatch.syspath_prepend(str(tmp_path))
        registry = Registry()
        monkeypatch.setattr(envhub.registry, "registry", registry)
        return registry

    return install_plugin


@pytest.fixture
def terminal(monkeypatch):
    """The CLI's consoles as on a wide terminal (so ``envhub list`` draws its table)."""
    out, err = io.StringIO(), io.StringIO()
    for name, file in (("console", out), ("err_console", err)):
        console = Console(file=file, force_terminal=True, color_system=None, width=200)
        monkeypatch.setattr(envhub.cli, name, console)
    return out, err


def test_a_plugin_that_exits_at_import_is_reported_and_every_command_still_works(fresh, terminal):
    module = 'import sys\nsys.exit("exitplugin needs xyz: pip install xyz")\ndef register(): pass\n'
    fresh("exitplugin", module, "[envhub.envs]\nexitplugin = exitplugin:register\n")
    result = CliRunner().invoke(main, ["list", "-n", "games"])
    assert result.exit_code == 0, result.output
    out, err = terminal
    assert "games/sokoban-v0" in out.getvalue()
    assert "plugin 'exitplugin' (exitplugin:register) failed to load" in err.getvalue()
    assert "SystemExit: exitplugin needs xyz: pip install xyz" in err.getvalue()


def test_a_malformed_entry_points_file_is_named_and_the_other_plugins_load(fresh):
    registry = fresh("brokendist", None, "[console_scripts]\nthis line has no equals sign\n")
    result = CliRunner().invoke(main, ["list", "--json", "-n", "games"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    assert "games/sokoban-v0" in {row["id"] for row in listing["envs"]}
    [failure] = [f for f in registry.plugin_errors() if f.name == "brokendist"]
    assert "brokendist-0.1.dist-info" in failure.target
    assert "entry_points.txt" in failure.error


BRACKETS = """\
import envhub


class Echo(envhub.TextEnv):
    def on_reset(self, options):
        return "Say something.", {}

    def on_step(self, action):
        return envhub.Turn("ok", terminated=True, success=True)


def register():
    envhub.register(
        "brackets/echo-v0",
        entry_point="bracketplug:Echo",
        max_turns=3,
        description="Quit with [/quit]. Moves: [up/down].",
    )


def register_broken():
    raise RuntimeError("config file [/etc/rev.toml] not found")
"""


def test_square_brackets_in_plugin_text_are_shown_as_written(fresh, terminal):
    fresh(
        "bracketplug",
        BRACKETS,
        "[envhub.envs]\nbrackets = bracketplug:register\n"
        "brackets_broken = bracketplug:register_broken\n",
    )
    out, err = terminal
    listed = CliRunner().invoke(main, ["list", "-n", "brackets"])
    assert listed.exit_code == 0, listed.output
    assert "Quit with [/quit]. Moves: [up/down]." in out.getvalue()
    assert "config file [/etc/rev.toml] not found" in err.getvalue()
    info = CliRunner().invoke(main, ["info", "brackets/echo-v0"])
    assert info.exit_code == 0, info.output
    assert "Quit with [/quit]. Moves: [up/down]." in out.getvalue().split("brackets/echo-v0")[-1]


@pytest.mark.timeout(120)
def test_a_plugin_that_hangs_at_import_is_named_while_it_hangs(tmp_path):
    module = "import threading\nthreading.Event().wait()\ndef register(): pass\n"
    site = install(tmp_path, "hangplugin", module, "[envhub.envs]\nhanger = hangplugin:register\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "envhub.cli", "list", "-n", "games"],
        env={**os.environ, "PYTHONPATH": str(site)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()  # the first thing it says, while the plugin still hangs
        assert "loading plugin 'hanger' (hangplugin:register) is taking long" in line
    finally:
        proc.kill()
        proc.wait()


def test_a_plugin_that_fails_halfway_leaves_none_of_its_ids(fresh):
    module = (
        "import envhub\n"
        "def register():\n"
        "    envhub.register('half/first-v0', entry_point='tests.helpers:CountdownEnv')\n"
        "    raise RuntimeError('second env needs data')\n"
    )
    registry = fresh("halfplugin", module, "[envhub.envs]\nhalf = halfplugin:register\n")
    with pytest.warns(RuntimeWarning, match="its environments are unavailable"):
        registry.load_plugins()
    [failure] = [f for f in registry.plugin_errors() if f.name == "half"]
    assert "second env needs data" in failure.error
    assert "half/first-v0" not in registry  # the warning says its environments are unavailable


def test_a_plugin_replacing_a_built_in_id_is_warned_about_naming_both(fresh):
    module = (
        "import envhub\n"
        "def register():\n"
        "    envhub.register(\n"
        "        'games/sokoban-v0', entry_point='tests.helpers:CountdownEnv', override=True\n"
        "    )\n"
    )
    registry = fresh("stealplugin", module, "[envhub.envs]\nsteal = stealplugin:register\n")
    with pytest.warns(RuntimeWarning, match=r"games/sokoban-v0") as caught:
        registry.load_plugins()
    [message] = [str(w.message) for w in caught if "games/sokoban-v0" in str(w.message)]
    assert "'steal'" in message and "envhub.games" in message


def test_a_short_id_in_two_namespaces_is_called_ambiguous_naming_both():
    registry = Registry(discover=False)
    registry.register("games/maze-v0", entry_point="tests.helpers:CountdownEnv")
    registry.register("puzzles/maze-v0", entry_point="tests.helpers:CountdownEnv")
    with pytest.raises(UnknownEnvError, match="ambiguous") as error:
        registry.spec("maze-v0")
    assert "games/maze-v0" in str(error.value) and "puzzles/maze-v0" in str(error.value)
