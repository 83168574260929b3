"""Atomic checkpoints: model and optimizer states, RNG states, seeds, step, extra state.

A checkpoint is a folder written in full under a temporary name, every file fsync'ed, then
renamed into place (the commit); a ``latest`` file naming it is then replaced atomically.

1. **A kill never loses a committed checkpoint.** The next :class:`CheckpointManager` removes
   half-written folders, puts back a checkpoint a kill caught between the two renames of a
   re-save of its step, and repairs ``latest``.
2. **One writer per folder.** A manager holds an exclusive ``fcntl.flock`` on ``root/.lock``
   until :meth:`CheckpointManager.close` or its process ends; a second one is refused naming
   the pid, so it can neither delete a live writer's temporary folder nor prune its
   checkpoints. ``CheckpointManager(root, lock=False)`` only reads.
3. **Complete or invisible.** ``meta.json`` is written last, once every state it lists is on
   disk. A ``meta.json`` without its keys, or a state file that cannot be read, is refused
   naming the file and the older complete checkpoint to continue from.
4. **One run per folder.** A manager's ``run_id`` goes into ``meta.json``; :meth:`load`
   refuses a checkpoint of another run. :meth:`latest` follows ``latest`` when it names a
   complete checkpoint (else the highest step).
5. **Loading runs no code.** ``.pt`` files are read with ``torch.load(weights_only=True)``
   (tensors, containers, numbers, strings, numpy RNG arrays); a file needing any other type is
   refused naming it, since unpickling it could run code from whoever wrote it.

After a save the newest ``keep`` complete checkpoints are kept. Layout under ``root``::

    .lock  latest              the writer's lock (its pid); "step_00000042"
    step_00000042/
        meta.json              format, step, time, run id, state names, seeds (written last)
        config.json            the run's config, if given (for humans and for --resume)
        rng.pt / extra.pt      the saving process's RNG states / plain extra data
        states/<name>.pt       one torch.save'd object per name ("actor", "engine", ...)
        <your files>           written by callables (e.g. model.save_pretrained) or by workers

Workers on other processes save their own RNG with :func:`capture_rng` and hand it over as a
state, or write into ``writer.path`` inside :meth:`CheckpointManager.writing` (all writers
must see the same filesystem).
"""

from __future__ import annotations

import json
import os
import pickle
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

from envhub.runs.store import sync_folder
from trainer.errors import CheckpointError
from trainer.folder_lock import FolderLock

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointWriter", "capture_rng", "restore_rng"]

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_PARTIAL = re.compile(r"^\.(tmp|trash)-(step_\d{8,})-")
_PARTIAL_PREFIXES = (".tmp-", ".trash-")
_META_KEYS = {"format": int, "step": int, "states": list}


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


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        sync_folder(Path(dirpath))


def _torch_save(obj: Any, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: Path, map_location: Any, fallback: str = "") -> Any:
    """``torch.load(weights_only=True)``, numpy's RNG state (a uint32 ndarray: data, no code)
    allowed; a refused type or a damaged file is a CheckpointError naming ``path`` (and
    ``fallback``: what to do instead)."""
    import numpy as np
    import torch
    from torch.serialization import safe_globals

    reconstruct: Any = np.zeros(0, np.uint32).__reduce__()[0]  # numpy 1.x/2.x _reconstruct
    try:
        with safe_globals([reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise CheckpointError(f"{path} is damaged ({err}).{fallback}") from None
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        raise CheckpointError(
            f"{path} holds a {found[1] if found else 'Python object'}, not only tensors and plain "
            "data; refused, since loading it would run code from whoever wrote the file. Use "
            "checkpoints written by this trainer" + (f".{fallback}" if fallback else "")
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read ({err}).{fallback}") from None


# --------------------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """One complete checkpoint on disk. States are loaded on demand."""

    path: Path
    step: int
    state_names: list[str]
    seeds: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str | None:
        """The id of the run that wrote it (None in checkpoints older than run ids)."""
        return self.meta.get("run_id")

    def load_state(self, name: str, map_location: Any = "cpu") -> Any:
        """The object saved under ``name`` (e.g. a model or optimizer state dict)."""
        if name not in self.state_names:
            raise CheckpointError(
                f"checkpoint {self.path} has no state {name!r}; it has {self.state_names}"
            )
        return self._load(self.path / "states" / f"{name}.pt", map_location)

    def states(self, map_location: Any = "cpu") -> dict[str, Any]:
        """Every saved state, by name."""
        return {name: self.load_state(name, map_location) for name in self.state_names}

    @property
    def rng(self) -> dict[str, Any]:
        """The saving process's RNG states (pass to :func:`restore_rng`)."""
        path = self.path / "rng.pt"
        return self._load(path, "cpu") if path.exists() else {}

    @property
    def extra(self) -> dict[str, Any]:
        """The extra state saved with it."""
        path = self.path / "extra.pt"
        return self._load(path, "cpu") if path.exists() else {}

    @property
    def config(self) -> dict[str, Any] | None:
        """The run config saved with it, if any."""
        path = self.path / "config.json"
        if not path.exists():
            return None
        try:
            return dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path} is unreadable ({err}).{_fallback(self.path)}") from None

    def _load(self, path: Path, map_location: Any) -> Any:
        return _torch_load(path, map_location, _fallback(self.path))


def _fallback(damaged: Path) -> str:
    """What to do about a damaged checkpoint: the older complete one to continue from, and how."""
    older = [p for p in _complete(damaged.parent) if p.name < damaged.name]
    if not older:
        return (
            f" No older complete checkpoint is in {damaged.parent}; start a fresh run "
            "(without --resume)"
        )
    return (
        f" To continue from the older complete checkpoint {older[-1].name}, move the damaged one "
        f"aside (mv {damaged} {damaged}.damaged) and run with --resume again"
    )


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints (``step_N`` folders with ``meta.json``) in ``root``, oldest
    first."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(path.name)
        if match and (path / "meta.json").is_file():
            found.append((int(match[1]), path))
    return [p for _, p in sorted(found)]


def _readable_meta(target: Path) -> bool:
    """``target`` has a meta.json that ``_read_meta`` accepts (a kill may have cut an older
    trainer's meta.json short: it was written in place)."""
    try:
        _read_meta(target)
    except CheckpointError:
        return False
    return True


def _read_meta(target: Path) -> dict[str, Any]:
    """``target/meta.json``, checked for the keys every checkpoint has."""
    path = target / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{target} is not a complete checkpoint (no meta.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable ({err}).{_fallback(target)}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a JSON object.{_fallback(target)}")
    if meta.get("format", FORMAT_VERSION) != FORMAT_VERSION:
        raise CheckpointError(
            f"{target} has checkpoint format {meta.get('format')!r}; this trainer reads "
            f"format {FORMAT_VERSION}"
        )
    bad = [
        f"{key} ({kind.__name__})"
        for key, kind in _META_KEYS.items()
        if not isinstance(meta.get(key), kind)
    ]
    if bad:
        raise CheckpointError(
            f"{path} lacks {', '.join(bad)}: not a checkpoint this trainer wrote, or edited."
            f"{_fallback(target)}"
        )
    return meta


# --------------------------------------------------------------------------- writing


class CheckpointWriter:
    """Collects one checkpoint in a temporary folder; :meth:`CheckpointManager.writing` commits
    it."""

    def __init__(self, path: Path, step: int, run_id: str | None = None) -> None:
        self.path = path
        """The temporary folder; workers may write their own files here before commit."""
        self.step = step
        self.run_id = run_id
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
        missing = [n for n in self.state_names if not (self.path / "states" / f"{n}.pt").is_file()]
        if missing:  # e.g. another process removed this folder: never mark it complete
            raise CheckpointError(
                f"{self.path} lost states {missing} before its commit; the checkpoint of step "
                f"{self.step} was not written (is another process using {self.path.parent}?)"
            )
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
            "run_id": self.run_id,
            "states": self.state_names,
            "seeds": self.seeds,
        }
        written = self.path / ".meta.json.tmp"  # renamed: a meta.json is never half written
        with open(written, "w") as f:
            json.dump(meta, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(written, self.path / "meta.json")  # last: marks the folder complete
        sync_folder(self.path)


class CheckpointManager:
    """Writes, lists, loads and prunes the checkpoints under ``root`` (module docstring).

    ``lock=False`` opens the folder to read only: no lock, nothing repaired or removed.
    ``run_id`` is written into every checkpoint and checked by :meth:`load`.
    """

    def __init__(
        self,
        root: str | Path,
        keep: int = 2,
        *,
        run_id: str | None = None,
        lock: bool = True,
        setting: str = "checkpoint.dir",
    ) -> None:
        if keep < 1:
            raise CheckpointError(f"keep={keep}: must keep at least 1 checkpoint")
        self.root = Path(root)
        self.keep = keep
        self.run_id = run_id
        self._lock = FolderLock(self.root, setting=setting) if lock else None  # (makes root)
        self.restored = self._restore_interrupted() if lock else []
        """Checkpoints put back at start-up (a kill between the renames of a re-save)."""
        self.removed_partial = self._remove_partial() if lock else []
        if lock:
            self._repair_pointer()

    def close(self) -> None:
        """Release the folder's lock (idempotent); a later manager may then write here."""
        if self._lock is not None:
            self._lock.release()

    # -- writing ----------------------------------------------------------------------

    @contextmanager
    def writing(self, step: int) -> Iterator[CheckpointWriter]:
        """Write one checkpoint; it becomes visible (and ``latest``) only if the block succeeds."""
        self._require_lock("write")
        tmp = self.root / f".tmp-{_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        writer = CheckpointWriter(tmp, step, self.run_id)
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

        ``states``: name -> tensors/plain data (state dicts); ``seeds``: JSON-able data/env
        seeds; ``extra``: plain data; ``config``: JSON-able run config; ``rng``: True captures
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
        if final.exists():  # re-saving a step: move the old one aside first (a kill in between
            aside = self.root / f".trash-{final.name}-{uuid.uuid4().hex[:8]}"  # is repaired by
            os.rename(final, aside)  # the next manager: _restore_interrupted)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        sync_folder(self.root)  # committed
        self._write_pointer(final.name)
        self._prune(keep_name=final.name)

    def _write_pointer(self, name: str) -> None:
        tmp = self.root / f".tmp-latest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "latest")
        sync_folder(self.root)

    def _prune(self, keep_name: str) -> None:
        complete = self.list()
        for path in complete[: max(0, len(complete) - self.keep)]:
            if path.name == keep_name:
                continue
            aside = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, aside)  # never leave a half-deleted folder under a step_ name
            shutil.rmtree(aside, ignore_errors=True)

    # -- start-up repairs (under the lock) ----------------------------------------------

    def _restore_interrupted(self) -> list[Path]:
        """Put back ``step_N`` when a kill left it only as a complete ``.tmp-`` (finished, not yet
        renamed in: preferred, it is the newer save) or ``.trash-`` folder (moved aside)."""
        candidates: dict[str, list[tuple[int, Path]]] = {}
        for path in self.root.iterdir():
            match = _PARTIAL.match(path.name)
            if match and (path / "meta.json").is_file() and _readable_meta(path):
                order = 0 if match[1] == "tmp" else 1
                candidates.setdefault(match[2], []).append((order, path))
        restored = []
        for name, found in sorted(candidates.items()):
            final = self.root / name
            if final.exists():
                continue
            os.rename(min(found)[1], final)
            restored.append(final)
        if restored:
            sync_folder(self.root)
        return restored

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

    def _repair_pointer(self) -> None:
        """Point ``latest`` at the newest checkpoint, unless it names a complete one of another
        run (then the newest belongs to someone else: :meth:`load` refuses it)."""
        complete = self.list()
        if not complete:
            return
        pointed = self._pointed()
        if pointed == complete[-1]:
            return
        if pointed in complete and _run_of(pointed) != _run_of(complete[-1]):
            return
        self._write_pointer(complete[-1].name)

    def _require_lock(self, what: str) -> None:
        if self._lock is None or self._lock._handle is None:
            raise CheckpointError(
                f"this CheckpointManager of {self.root} cannot {what}: it was opened read-only "
                "(lock=False) or closed; open one with lock=True to write"
            )

    # -- reading ----------------------------------------------------------------------

    def list(self) -> list[Path]:
        """Complete checkpoints (those with ``meta.json``), oldest first."""
        return _complete(self.root)

    def _pointed(self) -> Path | None:
        pointer = self.root / "latest"
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return self.root / name if _STEP_DIR.match(name) else None

    def latest(self) -> Path | None:
        """The checkpoint to continue from: the one ``latest`` names when it is complete, else the
        highest step with ``meta.json``; None if there is none."""
        complete = self.list()
        pointed = self._pointed()
        if pointed in complete:
            return pointed
        return complete[-1] if complete else None

    def load(self, path: str | Path | None = None) -> Checkpoint:
        """Open ``path`` (default: :meth:`latest`). Raises CheckpointError if there is none, if
        its ``meta.json`` is unreadable or incomplete, or if it belongs to another run."""
        target = Path(path) if path is not None else self.latest()
        if target is None:
            raise CheckpointError(
                f"no checkpoint in {self.root}; run without --resume to start fresh"
            )
        meta = _read_meta(target)
        found = meta.get("run_id")
        if self.run_id is not None and found is not None and found != self.run_id:
            raise CheckpointError(
                f"{target} belongs to run {found}, not to this run ({self.run_id}): checkpoint.dir "
                f"{self.root} holds another run's checkpoints. Resume that run with its own "
                "output_dir, or point checkpoint.dir at this run's checkpoints"
            )
        missing = [n for n in meta["states"] if not (target / "states" / f"{n}.pt").is_file()]
        if missing:
            raise CheckpointError(
                f"{target} lists states {missing} that are not in {target / 'states'}."
                f"{_fallback(target)}"
            )
        return Checkpoint(
            path=target,
            step=int(meta["step"]),
            state_names=list(meta["states"]),
            seeds=dict(meta.get("seeds") or {}),
            meta=meta,
        )


def _run_of(path: Path) -> Any:
    try:
        return _read_meta(path).get("run_id")
    except CheckpointError:  # a damaged one is reported when it is loaded
        return None


def _name(step: int) -> str:
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"
