"""A source's list of env names, computed once per installed version and kept on disk.

Listing TextArena's games or reasoning-gym's datasets means importing the package (0.6 to
1.5 s each), and the registry lists every plugin's ids on first use in every process. So an
adapter computes its entries once (``compute()`` imports the source) and this module keeps
them in ``$ENVHUB_CACHE_DIR`` (default ``~/.cache/envhub``), in a file named by the source
distribution's version: upgrading the source recomputes it, and nothing is ever stale. A
cache that cannot be read or written is recomputed, never an error.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CATALOG_FORMAT", "cache_dir", "catalog", "register_source"]

CATALOG_FORMAT = 4
"""Bumped when an adapter changes what it stores (the file name includes it)."""


def cache_dir() -> Path:
    """Where catalogs live: ``$ENVHUB_CACHE_DIR`` or ``~/.cache/envhub``."""
    root = os.environ.get("ENVHUB_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "envhub"


def catalog(
    source: str, distribution: str, compute: Callable[[], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """``compute()``'s entries for the installed version of ``distribution``, from disk if
    they were computed before."""
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return compute()
    path = cache_dir() / "catalogs" / f"{source}-{version}-f{CATALOG_FORMAT}.json"
    try:
        entries = json.loads(path.read_text())
        if isinstance(entries, list):
            return entries
    except (OSError, ValueError):
        pass
    entries = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as handle:
            json.dump(entries, handle)
        os.replace(handle.name, path)
    except OSError:
        pass
    return entries


def register_source(
    source: str, entry_point: str, compute: Callable[[], list[dict[str, Any]]]
) -> int:
    """Register ``source``'s catalog entries (``id``, ``kwargs`` and optionally ``max_turns``,
    ``description``, ``variants``) under ``entry_point``; return how many.

    A plugin's ``register()`` calls this. When the source's package is missing, nothing is
    registered and the namespace gets a note naming the extra to install.
    """
    from envhub.adapters import SOURCES, installed
    from envhub.registry import note_namespace, register

    spec = SOURCES[source]
    if not installed(source):
        note_namespace(source, spec.missing_note)
        return 0
    entries = catalog(source, spec.distribution, compute)
    for entry in entries:
        register(
            entry["id"],
            entry_point,
            kwargs=entry.get("kwargs", {}),
            max_turns=entry.get("max_turns"),
            description=entry.get("description", ""),
            variants=entry.get("variants"),
        )
    return len(entries)
