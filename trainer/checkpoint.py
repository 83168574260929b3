"""Atomic checkpoints: model and optimizer states, RNG states, seeds, step, extra state.

A checkpoint is a folder written in full under a temporary name, every file fsync'ed, then
renamed into place: the rename is the commit. A ``latest`` file naming the newest one is then
replaced atomically, for people and tools. A process killed at any moment (``kill -9``
mid-write) therefore leaves every committed checkpoint intact; the half-written folder is
ignored and removed by the next :class:`CheckpointManager`, which also repairs ``latest`` if
the kill came between the rename and the pointer update. After a successful save only the
newest ``keep`` are kept.

Layout under ``root``::

    latest                     "step_00000042" (replaced atomically)
    step_00000042/
        meta.json              step, time, state names, seeds (written last: completeness mark)
        config.json            the run's config, if given (for humans and for --resume)
        rng.pt                 python / numpy / torch (/ cuda) RNG states of the saving process
        extra.pt               anything else picklable (data-loader position, metrics so far)
        states/<name>.pt       one torch.save'd object per name ("actor", "actor_optim", ...)
        <your files>           written by callables (e.g. model.save_pretrained) or by workers

Workers on other processes save their own RNG with :func:`capture_rng` and hand it over as a
state, or write into ``writer.path`` inside :meth:`CheckpointManager.writing` (all writers
must see the same filesystem). Checkpoints are pickles: load only ones you trust.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import CheckpointError

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointWriter", "capture_rng", "restore_rng"]

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_PARTIAL_PREFIXES = (".tmp-", ".trash-")


# --------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """The RNG states of this process: ``python``, ``numpy``, ``torch`` (and ``torch_cuda``)."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` returned (missing entries are left alone)."""
    import numpy as np
    import torch

    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


# --------------------------------------------------------------------------- fsync helpers


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def _torch_save(obj: Any, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: Path, map_location: Any) -> Any:
    import torch

    return torch.load(path, map_location=map_location, weights_only=False)


# --------------------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """One complete checkpoint on disk. States are loaded on demand."""

    path: Path
    step: int
    state_names: list[str]
    seeds: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    def load_state(self, name: str, map_location: Any = "cpu") -> Any:
        """The object saved under ``name`` (e.g. a model or optimizer state dict)."""
        if name not in self.state_names:
            raise CheckpointError(
                f"checkpoint {self.path} has no state {name!r}; it has {self.state_names}"
            )
        return _torch_load(self.path / "states" / f"{name}.pt", map_location)

    def states(self, map_location: Any = "cpu") -> dict[str, Any]:
        """Every saved state, by name."""
        return {name: self.load_state(name, map_location) for name in self.state_names}

    @property
    def rng(self) -> dict[str, Any]:
        """The saving process's RNG states (pass to :func:`restore_rng`)."""
        path = self.path / "rng.pt"
        return _torch_load(path, "cpu") if path.exists() else {}

    @property
    def extra(self) -> dict[str, Any]:
        """The extra state saved with it."""
        path = self.path / "extra.pt"
        return _torch_load(path, "cpu") if path.exists() else {}

    @property
    def config(self) -> dict[str, Any] | None:
        """The run config saved with it, if any."""
        path = self.path / "config.json"
        return json.loads(path.read_text()) if path.exists() else None


# --------------------------------------------------------------------------- writing


class CheckpointWriter:
    """Collects one checkpoint in a temporary folder; :meth:`CheckpointManager.writing` commits
    it."""

    def __init__(self, path: Path, step: int) -> None:
        self.path = path
        """The temporary folder; workers may write their own files here before commit."""
        self.step = step
        self.state_names: list[str] = []
        self.seeds: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.rng: dict[str, Any] | None = None
        self.config: dict[str, Any] | None = None

    def save_state(self, name: str, obj: Any) -> None:
        """``torch.save`` ``obj`` as ``states/<name>.pt`` (fsync'ed)."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise CheckpointError(
                f"state name {name!r} must use only letters, digits, '_', '.', '-'"
            )
        _torch_save(obj, self.path / "states" / f"{name}.pt")
        if name not in self.state_names:
            self.state_names.append(name)

    def write_files(self, subdir: str, write: Callable[[Path], None]) -> None:
        """Let ``write(folder)`` fill ``<checkpoint>/<subdir>`` (e.g. ``model.save_pretrained``)."""
        target = self.path / subdir
        target.mkdir(parents=True, exist_ok=True)
        write(target)

    def _finish(self) -> None:
        if self.rng is not None:
            _torch_save(self.rng, self.path / "rng.pt")
        _torch_save(self.extra, self.path / "extra.pt")
        if self.config is not None:
            (self.path / "config.json").write_text(json.dumps(self.config, indent=2, default=str))
        _fsync_tree(self.path)
        meta = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "time": time.time(),
            "states": self.state_names,
            "seeds": self.seeds,
        }
        with open(self.path / "meta.json", "w") as f:  # last: marks the folder complete
            json.dump(meta, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.path)


class CheckpointManager:
    """Writes, lists, loads and prunes the checkpoints under ``root``."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise CheckpointError(f"keep={keep}: must keep at least 1 checkpoint")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        self.removed_partial = self._remove_partial()
        newest = self.latest()
        pointer = self.root / "latest"
        if newest is not None and (
            not pointer.is_file() or pointer.read_text().strip() != newest.name
        ):
            self._write_pointer(newest.name)

    # -- writing ----------------------------------------------------------------------

    @contextmanager
    def writing(self, step: int) -> Iterator[CheckpointWriter]:
        """Write one checkpoint; it becomes visible (and ``latest``) only if the block succeeds."""
        tmp = self.root / f".tmp-{_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        writer = CheckpointWriter(tmp, step)
        try:
            yield writer
            writer._finish()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._commit(tmp, step)

    def save(
        self,
        step: int,
        *,
        states: Mapping[str, Any] | None = None,
        seeds: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        rng: Mapping[str, Any] | None | bool = True,
        files: Mapping[str, Callable[[Path], None]] | None = None,
    ) -> Path:
        """Write a checkpoint of ``step`` and return its folder.

        ``states``: name -> picklable (state dicts); ``seeds``: JSON-able data/env seeds;
        ``extra``: anything picklable; ``config``: JSON-able run config; ``rng``: True captures
        this process's RNG, a mapping is saved as given, False/None saves none; ``files``:
        subfolder -> callable that writes into it.
        """
        with self.writing(step) as w:
            for name, obj in (states or {}).items():
                w.save_state(name, obj)
            w.seeds = dict(seeds or {})
            w.extra = dict(extra or {})
            w.config = dict(config) if config is not None else None
            w.rng = capture_rng() if rng is True else (dict(rng) if rng else None)
            for subdir, write in (files or {}).items():
                w.write_files(subdir, write)
        return self.root / _name(step)

    def _commit(self, tmp: Path, step: int) -> None:
        final = self.root / _name(step)
        if final.exists():  # re-saving a step: move the old one aside first
            aside = self.root / f".trash-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)  # committed
        self._write_pointer(final.name)
        self._prune(keep_name=final.name)

    def _write_pointer(self, name: str) -> None:
        tmp = self.root / f".tmp-latest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "latest")
        _fsync_dir(self.root)

    def _prune(self, keep_name: str) -> None:
        complete = self.list()
        for path in complete[: max(0, len(complete) - self.keep)]:
            if path.name == keep_name:
                continue
            aside = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, aside)  # never leave a half-deleted folder under a step_ name
            shutil.rmtree(aside, ignore_errors=True)

    def _remove_partial(self) -> list[Path]:
        removed = []
        for path in self.root.iterdir():
            if path.name.startswith(_PARTIAL_PREFIXES):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    # -- reading ----------------------------------------------------------------------

    def list(self) -> list[Path]:
        """Complete checkpoints (those with ``meta.json``), oldest first."""
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / "meta.json").is_file():
                found.append((int(match[1]), path))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest committed checkpoint (highest step with ``meta.json``); None if there is none.

        The ``latest`` file names the same folder once a save has finished; it is not read here,
        so a kill between commit and pointer update loses nothing.
        """
        complete = self.list()
        return complete[-1] if complete else None

    def load(self, path: str | Path | None = None) -> Checkpoint:
        """Open ``path`` (default: :meth:`latest`). Raises CheckpointError if there is none."""
        target = Path(path) if path is not None else self.latest()
        if target is None:
            raise CheckpointError(
                f"no checkpoint in {self.root}; run without --resume to start fresh"
            )
        try:
            meta = json.loads((target / "meta.json").read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{target} is not a complete checkpoint (no meta.json)") from None
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{target}/meta.json is unreadable: {err}") from None
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"{target} has checkpoint format {meta.get('format')!r}; this trainer reads "
                f"format {FORMAT_VERSION}"
            )
        return Checkpoint(
            path=target,
            step=int(meta["step"]),
            state_names=list(meta.get("states", [])),
            seeds=dict(meta.get("seeds", {})),
            meta=meta,
        )


def _name(step: int) -> str:
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"
