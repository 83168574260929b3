"""Adapters: other ecosystems' environments as envhub ids, with the same contract as built-ins.

Each adapter is an ordinary envhub plugin: envhub's own ``pyproject.toml`` names its
``register`` function in the ``envhub.envs`` entry-point group, exactly as a third-party
package would, and each needs its source's package, installed by an extra:

=============  ==============================  =========================  =====================
source         ids                             extra                      what an id plays
=============  ==============================  =========================  =====================
textarena      ``textarena/TicTacToe-v0``      ``envhub[textarena]``      one TextArena game
                                                                          (1 or 2 players)
gem            ``gem/game.Sudoku-easy-v0``     ``envhub[gem]``            one GEM env (games,
                                                                          math, code, QA)
reasoning-gym  ``reasoning-gym/leg_counting``  ``envhub[reasoning-gym]``  one reasoning-gym
               ``-v0``                                                    dataset as tasks
openenv        ``openenv/remote-v0``           ``envhub[openenv]``        an OpenEnv server
=============  ==============================  =========================  =====================

``envhub list --source NAME`` lists one source's ids. Nothing here imports a source package
until an env is built (``require``), and the ids themselves come from a per-version catalog
(``envhub.adapters.catalog``), so installing the extras does not slow down ``import envhub``
or ``envhub list``. When a source's package is missing, its namespace carries a note naming the
extra, which unknown-id errors repeat.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

from envhub.errors import SourceNotInstalledError

__all__ = ["SOURCES", "Source", "did_you_mean", "installed", "require"]


@dataclass(frozen=True)
class Source:
    """One adapted ecosystem: its namespace, the module it needs and the extra providing it."""

    name: str
    module: str
    """The import name of the source's package."""
    distribution: str
    """Its PyPI name (the catalog is keyed by this distribution's version)."""
    extra: str

    @property
    def install_hint(self) -> str:
        return f"pip install 'envhub[{self.extra}]'"

    @property
    def missing_note(self) -> str:
        return (
            f"The {self.name} adapter needs the {self.distribution!r} package, which is not "
            f"installed: {self.install_hint}."
        )


SOURCES: dict[str, Source] = {
    source.name: source
    for source in (
        Source("textarena", "textarena", "textarena", "textarena"),
        Source("gem", "gem", "gem-llm", "gem"),
        Source("reasoning-gym", "reasoning_gym", "reasoning-gym", "reasoning-gym"),
        Source("openenv", "openenv", "openenv-core", "openenv"),
    )
}
"""The adapted ecosystems, by source name (= envhub namespace = entry-point name)."""


def installed(source: str) -> bool:
    """Whether ``source``'s package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(SOURCES[source].module) is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as missing
        return False


def require(source: str, module: str | None = None) -> ModuleType:
    """Import ``module`` (default: the source's package) or raise ``SourceNotInstalledError``
    naming the extra to install."""
    spec = SOURCES[source]
    try:
        return importlib.import_module(module or spec.module)
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] != spec.module.split(".")[0]:
            raise SourceNotInstalledError(
                f"{spec.name}: importing {module or spec.module!r} needs the module "
                f"{error.name!r}, which is not installed; {spec.install_hint} installs what "
                f"the adapter uses"
            ) from error
        raise SourceNotInstalledError(spec.missing_note) from error


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """`` Did you mean 'x' or 'y'?`` for the closest of ``options``, or ``""``."""
    close = difflib.get_close_matches(word, list(options), n=3, cutoff=0.6)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
