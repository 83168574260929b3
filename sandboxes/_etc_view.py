"""The ``/etc`` a bwrap sandbox sees: one prepared directory, bound read-only with one mount.

Why: bwrap mounts every entry it binds twice (a bind, then a read-only remount). The public
``/etc`` entries (``_isolation.ETC_FILES``) and the generated ``passwd`` and ``group`` were 22
mounts, about 2 ms of every sandbox start. Instead this process copies them once into a
directory of its own, ``envhub-etc-*/etc`` beside the sandboxes' directories
(``_footprint.default_base_dir``), and each launch binds it at ``/etc`` from an open fd.

What it guarantees:

1. **The same content as the binds**: each top-level entry is copied as a bind showed it (a
   symlink at the top is followed, as bwrap follows it; links inside a directory stay links,
   resolved inside the sandbox as before), keeping its mode (never readable by more users than
   on the host); ``passwd`` and ``group`` are the generated ones. What bwrap binds from the
   host on top (``NETWORK_ETC_FILES`` with the network on, a ``LocalSandbox(ro_binds=...)``
   path under ``/etc``) gets an empty placeholder of its type to be mounted on (bwrap cannot
   make one in the read-only copy).
2. **Not stale past the next launch**: :func:`etc_view` compares each source's ``stat``
   (device, inode, size, mtime) with the copy's at every call and copies afresh when one
   changed (a package install rewrites ``ld.so.cache``, an admin edits ``hosts``). Inside a
   directory only additions, removals and renames change its own mtime: an entry of
   ``ld.so.conf.d`` edited in place shows at the next copy (only ``ldconfig`` reads those).
3. **Never changed under a running sandbox**: a copy is written once and removed only at this
   process's exit; ``_footprint.collect_stale`` (``envhub sandbox gc``) removes those of
   processes that died without exiting. Sandboxes cannot write it (a read-only bind; as root it
   is owned by root, not by any sandbox uid).

Seen from inside, ``/proc/self/mountinfo`` names the copy's directory (a random name in the
base directory) as the source of ``/etc``, where the binds named the host's ``/etc`` files.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from sandboxes._isolation import etc_entries

__all__ = ["PREFIX", "etc_view"]

PREFIX = "envhub-etc-"
"""Name prefix of the copies' directories (``collect_stale`` looks for it)."""

_lock = threading.Lock()
_views: dict[tuple[object, ...], Path] = {}
"""(owner pid, base dir, generated files, sources' stat, mount points) -> the copy's ``etc``."""


def etc_view(
    *, generated: Mapping[str, bytes], base_dir: str, mount_points: Sequence[str] = ()
) -> Path:
    """The directory to bind at ``/etc`` for a sandbox (see the module docstring);
    ``mount_points``: host paths under ``/etc/`` that bwrap binds over it."""
    names = etc_entries(network=False)
    sources = tuple(_stat_key(name) for name in names)
    points = tuple(sorted((path, os.path.isdir(path)) for path in mount_points))
    key = (os.getpid(), base_dir, tuple(sorted(generated.items())), sources, points)
    with _lock:
        view = _views.get(key)
        if view is None or not view.is_dir():
            if not _views:
                atexit.register(_remove_own)
            view = _views[key] = _copy(names, generated, points, base_dir)
    return view


def _stat_key(name: str) -> tuple[object, ...]:
    try:
        st = os.stat(f"/etc/{name}")
    except OSError:
        return (name,)
    return (name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _copy(
    names: list[str],
    generated: Mapping[str, bytes],
    points: tuple[tuple[str, bool], ...],
    base_dir: str,
) -> Path:
    top = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base_dir))
    try:
        (top / "owner.json").write_text(json.dumps({"pid": os.getpid()}))
        etc = top / "etc"
        etc.mkdir()
        for name in names:
            source, target = Path("/etc", name), etc / name
            if source.is_dir():
                shutil.copytree(source, target, symlinks=True)
            else:
                shutil.copy2(source, target)
        for name, data in generated.items():
            (etc / name).write_bytes(data)
            os.chmod(etc / name, 0o644)
        for point, is_dir in points:  # what bwrap binds over the copy: a place to mount on
            target = etc / Path(point).relative_to("/etc")
            if not os.path.lexists(target):
                target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                target.mkdir(mode=0o755) if is_dir else target.touch(mode=0o644)
        for made in (etc, top):
            os.chmod(made, 0o755)
    except BaseException:
        shutil.rmtree(top, ignore_errors=True)
        raise
    return etc


def _remove_own() -> None:
    """At exit: this process's copies (a forked child's exit leaves its parent's alone)."""
    for key, view in list(_views.items()):
        if key[0] == os.getpid():
            shutil.rmtree(view.parent, ignore_errors=True)


def collect_stale(places: list[str]) -> list[str]:
    """Remove the copies in ``places`` whose owner process is gone; returns their paths."""
    removed = []
    for top in (p for place in places for p in Path(place).glob(f"{PREFIX}*")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pid = int(json.loads((top / "owner.json").read_text())["pid"])
            if not Path(f"/proc/{pid}").exists():
                shutil.rmtree(top, ignore_errors=True)
                removed.append(str(top))
    return removed
