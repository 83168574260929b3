"""Two installed packages that register the same id, and what a user then sees.

Each package is installed as pip leaves it (a module and a ``.dist-info`` folder with its
``entry_points.txt``) into a folder of its own on the path. Neither may take the other's id,
whichever is first on ``sys.path``: the contested id is refused for both, naming both
packages; every other id of both stays usable; and commands that use an id of the namespace
warn on stderr.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

import envhub.registry
from envhub.cli import main
from envhub.errors import UnknownEnvError
from envhub.registry import Registry

BUGS = "tests.envhub.author_bugs"

ACME = f"""\
import envhub

def register():
    envhub.register("acme/guess-v0", "{BUGS}:Win", max_turns=5)
    envhub.register("acme/guess-hard-v0", "{BUGS}:Win", max_turns=3)
"""

CLASH = f"""\
import envhub

def register():
    envhub.register("clash/ok-v0", "{BUGS}:Win", max_turns=3)
    # its own take on a guessing game, under an id another package already uses
    envhub.register("acme/guess-v0", "{BUGS}:LeaksAcrossEpisodes", max_turns=3)
"""


def install(site: Path, dist: str, module_name: str, module: str, entry_points: str) -> Path:
    """Distribution ``dist`` as pip installs it: ``module_name.py`` and its ``.dist-info``."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[envhub.envs]\n{entry_points}\n")
    (site / f"{module_name}.py").write_text(module)
    return site


@pytest.fixture(params=["acme first", "clash first"])
def both(request, monkeypatch, tmp_path) -> Registry:
    """acme-envs and clash-envs installed in separate folders, in both path orders; commands
    see a fresh registry."""
    acme = install(tmp_path / "a", "acme-envs", "acme_envs", ACME, "acme = acme_envs:register")
    clash = install(
        tmp_path / "c", "clash-envs", "clash_envs", CLASH, "clash = clash_envs:register"
    )
    for site in (acme, clash) if request.param == "clash first" else (clash, acme):
        monkeypatch.syspath_prepend(str(site))  # (the last one prepended is first on the path)
    registry = Registry()
    monkeypatch.setattr(envhub.registry, "registry", registry)
    return registry


def test_an_id_two_packages_register_is_refused_for_both_naming_both(both):
    with pytest.warns(RuntimeWarning, match="acme/guess-v0 is registered by 2 plugins"):
        both.load_plugins()
    with pytest.raises(UnknownEnvError) as caught:
        both.make("acme/guess-v0")
    message = str(caught.value)
    assert "'acme' (package acme-envs" in message and "'clash' (package clash-envs" in message
    assert "refuses it for all of them rather than let the install order pick one" in message
    assert "Keep one (uninstall the package" in message


def test_the_other_ids_of_both_packages_stay_usable(both):
    with pytest.warns(RuntimeWarning):
        both.load_plugins()
    with pytest.warns(RuntimeWarning, match="acme/guess-hard-v0 is in namespace 'acme'"):
        assert both.spec("acme/guess-hard-v0").source == "acme"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is wrong in namespace clash, whatever the order
        assert both.spec("clash/ok-v0").source == "clash"
        made = both.make("clash/ok-v0")
    assert made.reset(seed=0)[0][0]["content"] == "Say <answer>win</answer>."


def test_the_collision_is_recorded_in_plugin_errors(both):
    with pytest.warns(RuntimeWarning):
        [failure] = both.plugin_errors()
    assert failure.collision and failure.ids == ("acme/guess-v0",)
    assert "'acme'" in failure.error and "'clash'" in failure.error


def test_commands_refuse_the_contested_id_and_warn_on_the_namespaces_other_ids(both):
    runner = CliRunner()
    checked = runner.invoke(main, ["check", "acme/guess-v0"])
    assert checked.exit_code == 2
    assert "acme/guess-v0 is registered by 2 plugins" in checked.stderr
    played = runner.invoke(main, ["play", "acme/guess-hard-v0", "--seed", "0"], input=":quit\n")
    assert played.exit_code == 0, played.output
    assert "Say <answer>win</answer>." in played.stdout
    [warning] = [line for line in played.stderr.splitlines() if line.startswith("warning:")]
    assert "acme/guess-hard-v0 is in namespace 'acme', where a plugin failed or collided" in warning
    assert "acme/guess-v0 is registered by 2 plugins" in warning


def test_envhub_list_names_the_collision(both):
    listed = CliRunner().invoke(main, ["list", "-n", "acme"])
    assert listed.exit_code == 0
    assert "acme/guess-hard-v0" in listed.stdout and "acme/guess-v0" not in listed.stdout
    assert "acme/guess-v0 is registered by 2 plugins" in listed.stderr


SQUAT = f"""\
import envhub

def register():
    envhub.register("squat/mine-v0", "{BUGS}:Win", max_turns=3)
    envhub.register("games/sokoban-v0", "{BUGS}:Win", max_turns=3)
"""


def test_a_plugin_colliding_with_a_built_in_id_loses_that_id_only(monkeypatch, tmp_path):
    site = install(tmp_path, "squat-envs", "squat_envs", SQUAT, "squat = squat_envs:register")
    monkeypatch.syspath_prepend(str(site))
    registry = Registry()
    with pytest.warns(RuntimeWarning, match="games/sokoban-v0 is already registered"):
        registry.load_plugins()
    with pytest.warns(RuntimeWarning, match="games/sokoban-v0 is in namespace 'games'"):
        assert registry.spec("games/sokoban-v0").source == "envhub.games"
    assert registry.spec("squat/mine-v0").source == "squat"
    [failure] = registry.plugin_errors()
    assert failure.collision and failure.name == "squat"
    assert "'envhub.games' (envhub's own" in failure.error


BROKEN = """\
raise ImportError("zeta_envs needs the zeta-data package: pip install zeta-data")

def register():
    pass
"""


def test_an_unknown_id_names_the_plugin_of_its_namespace_that_failed_and_why(monkeypatch, tmp_path):
    site = install(tmp_path, "zeta-envs", "zeta_envs", BROKEN, "zeta = zeta_envs:register")
    monkeypatch.syspath_prepend(str(site))
    registry = Registry()
    with pytest.warns(RuntimeWarning), pytest.raises(UnknownEnvError) as caught:
        registry.spec("zeta/maze-v0")
    assert (
        "The plugin 'zeta' (zeta_envs:register) failed to load: ImportError: zeta_envs needs the "
        "zeta-data package: pip install zeta-data."
    ) in str(caught.value)


def test_an_unknown_id_in_a_namespace_no_plugin_knows_says_python_ids_stay_in_their_process():
    registry = Registry()
    with pytest.raises(UnknownEnvError) as caught:
        registry.spec("acme/echo-v0")
    message = str(caught.value)
    assert "registered with envhub.register() in Python code exist only in the process" in message
    assert "--import MODULE (or ENVHUB_PLUGINS=MODULE in the environment)" in message
    assert "`envhub.envs` entry point (envhub init NAME)" in message
    assert message.endswith("Run `envhub list` to see every id.")
