"""Where plugins come from, and how one that fails is recorded.

A plugin is a ``"module[:func]"`` target: importing it (and calling ``func``) registers ids. The
registry (``envhub.registry.Registry.load_plugins``) loads, in order, envhub's own packages,
the ``envhub.envs`` entry points of installed distributions (``installed_entry_points``) and
the modules named in ``ENVHUB_PLUGINS`` (``variable_plugins``; ``import_plugins`` adds to it,
for the CLI's ``--import``). A plugin that fails, or an id of one that collides, becomes a
``PluginFailure``; the others load regardless.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "PLUGINS_VARIABLE",
    "PYTHON_IDS_HINT",
    "SLOW_PLUGIN_SECONDS",
    "PluginFailure",
    "import_plugins",
    "installed_entry_points",
    "say_slow",
    "search_current_folder",
    "variable_plugins",
]

PLUGINS_VARIABLE = "ENVHUB_PLUGINS"
"""Names more plugins: ``MODULE`` (importing it registers its ids) or ``MODULE:FUNC`` (called),
comma-separated, looked up on ``sys.path`` and then in the current folder. Every process that
reads the registry loads them, so the CLI's ``--import`` (which adds to it) reaches check, pool
and hub workers too."""

PYTHON_IDS_HINT = (
    "Ids registered with envhub.register() in Python code exist only in the process that ran "
    "it: load that module with --import MODULE (or ENVHUB_PLUGINS=MODULE in the environment), "
    "or ship it in a package with an `envhub.envs` entry point (envhub init NAME)."
)
"""Added to an unknown id's error when no plugin registers or failed in its namespace."""

SLOW_PLUGIN_SECONDS = 5.0
"""A plugin still loading after this long is named on stderr (it may hang every command)."""


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded, or an id of it that was refused, and why."""

    name: str
    target: str
    error: str
    ids: tuple[str, ...] = ()
    """The ids this failure keeps out: a collision's id, or those a plugin had registered
    before it raised (all dropped with it)."""
    collision: bool = False
    """The plugin loaded, but ``ids`` collide with another registration (its other ids stand)."""

    def concerns(self, namespace: str) -> bool:
        """Whether this failure may explain a missing or surprising id of ``namespace``: it
        keeps out an id there, or it is a failed plugin named like the namespace."""
        named = self.name == namespace and not self.collision
        return named or any(i.split("/", 1)[0] == namespace for i in self.ids)


def installed_entry_points(
    group: str, on_failure: Callable[[PluginFailure], None]
) -> list[importlib.metadata.EntryPoint]:
    """The ``group`` entry points of the installed distributions. If some package's
    ``entry_points.txt`` is malformed, each distribution is read in turn (the first of a name
    on the path, as ``entry_points`` takes): the broken one is a failure naming it, and the
    others still count."""
    try:
        return list(importlib.metadata.entry_points(group=group))
    except Exception:  # noqa: BLE001, S110 - some package's entry_points.txt is malformed
        pass
    found: list[importlib.metadata.EntryPoint] = []
    seen: set[str] = set()
    for distribution in importlib.metadata.distributions():
        where = name = str(getattr(distribution, "_path", distribution))
        try:
            name = distribution.metadata["Name"] or where
            key = re.sub(r"[-_.]+", "-", name).lower()
            if key in seen:
                continue
            seen.add(key)
            found += [e for e in distribution.entry_points if e.group == group]
        except Exception as exc:  # noqa: BLE001 - one broken package must not hide the rest
            error = f"its entry_points.txt cannot be read ({type(exc).__name__}: {exc})"
            on_failure(PluginFailure(name=name, target=where, error=error))
    return found


def import_plugins(targets: Sequence[str]) -> list[PluginFailure]:
    """Load ``MODULE`` / ``MODULE:FUNC`` plugins now (the CLI's ``--import``) and name them in
    ``ENVHUB_PLUGINS``, so processes started from here load them too; return their failures."""
    from envhub import registry  # (the registry imports this module)

    named = [target for _, target in variable_plugins()]
    os.environ[PLUGINS_VARIABLE] = ",".join(dict.fromkeys([*named, *targets]))
    loading = [(target.partition(":")[0], target) for target in targets]
    return registry.registry.load_more(loading)


def variable_plugins() -> list[tuple[str, str]]:
    """``(name, target)`` of each ``MODULE[:FUNC]`` named in ``ENVHUB_PLUGINS``."""
    targets = re.split(r"[,\s]+", os.environ.get(PLUGINS_VARIABLE, ""))
    return [(target.partition(":")[0], target) for target in targets if target]


def search_current_folder() -> None:
    """Let ``ENVHUB_PLUGINS`` name a module in the current folder, as ``python -m`` would (the
    ``envhub`` script's own folder is on ``sys.path`` instead); searched last."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.append(here)


def say_slow(name: str, target: str) -> None:
    """Name a plugin still loading after ``SLOW_PLUGIN_SECONDS`` on stderr."""
    print(
        f"envhub: loading plugin {name!r} ({target}) is taking long (over "
        f"{SLOW_PLUGIN_SECONDS:g} s); if it hangs, fix or uninstall the package that provides it",
        file=sys.stderr,
        flush=True,
    )
