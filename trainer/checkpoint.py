"""Atomic checkpoints: model and optimizer states, RNG states, seeds, step, extra state.

A checkpoint is a folder written in full under a temporary name, every file fsync'ed, then
renamed into place (the commit); a ``latest`` file naming it is then replaced atomically.

1. **A kill never loses a committed checkpoint, nor brings a deleted one back.** The next
   :class:`CheckpointManager` removes half-written folders (``.tmp-``) and half-deleted ones
   (pruned: ``.pruned-``, never put back), puts back a checkpoint a kill caught between the two
   renames of a save (``.tmp-``, or a re-save's old copy in ``.trash-``), and repairs
   ``latest``. A save that fails (a full disk) is a :class:`CheckpointError` naming the
   checkpoint to continue from (:func:`resume_hint`); one that fails after its commit (the
   ``latest`` rewrite, pruning) says that the step was saved.
2. **One writer per folder.** A manager holds an exclusive ``fcntl.flock`` on ``root/.lock``
   until :meth:`CheckpointManager.close` or its process ends; a second one is refused naming
   the pid, so it can neither delete a live writer's temporary folder nor prune its
   checkpoints. ``CheckpointManager(root, lock=False)`` only reads.
3. **Complete or invisible.** ``meta.json`` is written last, once every state and file it
   lists is on disk. A ``meta.json`` without its keys, a listed file that is missing, or a state
   file that cannot be read (or holds the wrong kind of data) is refused naming the file and the
   older complete checkpoint to continue from (``trainer.checkpoint_read``). A ``step_N`` that
   is a symbolic link is not a checkpoint.
4. **One run per folder.** A manager's ``run_id`` goes into ``meta.json``; :meth:`load`
   refuses a checkpoint of another run. :meth:`latest` is the highest complete step
   unless ``latest`` names a complete checkpoint of another run: the one rule the run, the CLI
   and its messages use.
5. **Loading runs no code.** ``.pt`` files are read with ``torch.load(weights_only=True)``
   (tensors, containers, numbers, strings, numpy RNG arrays); a file needing any other type is
   refused naming it, since unpickling it could run code from whoever wrote it.

After a save the newest ``keep`` complete checkpoints are kept. Layout under ``root``::

    .lock  latest              the writer's lock (its pid); "step_00000042"
    step_00000042/
        meta.json              format, step, time, run id, states, files, seeds (written last)
        config.json            the run's config, if given (for humans and for --resume)
        rng.pt / extra.pt      the saving process's RNG states / plain extra data
        states/<name>.pt       one torch.save'd object per name ("actor", "engine", ...)
        <your files>           written by callables (e.g. model.save_pretrained) or by workers

Workers on other processes save their own RNG with :func:`capture_rng` and hand it over as a
state, or write into ``writer.path`` inside :meth:`CheckpointManager.writing` (all writers
must see the same filesystem).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from envhub.runs.store import sync_folder
from trainer.checkpoint_read import (
    ALWAYS_WRITTEN,
    FORMAT_VERSION,
    STEP_DIR,
    Checkpoint,
    complete_steps,
    open_checkpoint,
    read_meta,
    readable_meta,
    symlinked_steps,
)
from trainer.errors import CheckpointError
from trainer.folder_lock import FolderLock

__all__ = ["CheckpointManager", "CheckpointWriter", "capture_rng", "restore_rng", "resume_hint"]

_PARTIAL = re.compile(r"^\.(tmp|trash)-(step_\d{8,})-")
"""A save not yet renamed in (``.tmp-``) or a re-saved step's old copy moved aside (``.trash-``):
put back at start-up when complete (:meth:`CheckpointManager._restore_interrupted`)."""
_PRUNED = ".pruned-"
"""A checkpoint being deleted (pruned): never put back, removed at start-up."""
_PARTIAL_PREFIXES = (".tmp-", ".trash-", _PRUNED)


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
        files = [ALWAYS_WRITTEN]
        if self.rng is not None:
            _torch_save(self.rng, self.path / "rng.pt")
            files.append("rng.pt")
        _torch_save(self.extra, self.path / ALWAYS_WRITTEN)
        if self.config is not None:
            (self.path / "config.json").write_text(json.dumps(self.config, indent=2, default=str))
            files.append("config.json")
        _fsync_tree(self.path)
        meta = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "time": time.time(),
            "run_id": self.run_id,
            "states": self.state_names,
            "seeds": self.seeds,
            "files": files,  # a checkpoint lacking one of them is refused (checkpoint_read)
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
        try:
            tmp.mkdir(parents=True)  # (a disk that filled up since the last save fails here)
            writer = CheckpointWriter(tmp, step, self.run_id)
            yield writer
            writer._finish()
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, OSError):  # disk full, quota, permissions: say what to do
                raise CheckpointError(self._save_failed(step, err)) from err
            raise
        self._commit(tmp, step)

    def _save_failed(self, step: int, err: OSError) -> str:
        where = f" ({err.filename})" if err.filename else ""
        return (
            f"saving the checkpoint of step {step} failed: {err.strerror or err}{where}. Nothing "
            "of it was kept; the checkpoints before it are intact. " + self._what_next(err)
        )

    def _saved_but(self, step: int, final: Path, err: OSError) -> str:
        """An ``OSError`` after the commit: the checkpoint is complete, what failed is repaired
        by the next manager (``latest``) or the next save (pruning)."""
        where = f" ({err.filename})" if err.filename else ""
        return (
            f"the checkpoint of step {step} was saved ({final}), but updating "
            f"{self.root} after it failed: {err.strerror or err}{where}; the next start repairs "
            "it. " + self._what_next(err)
        )

    def _what_next(self, err: OSError) -> str:
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        return (f"Free space in {self.root}, then " if full else "Fix that, then ") + resume_hint(
            self.root
        )

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
        """Rename ``tmp`` in as the checkpoint of ``step``, then point ``latest`` at it and
        prune; an ``OSError`` is a :class:`CheckpointError` saying whether the step was saved."""
        final = self.root / _name(step)
        try:
            if final.exists():  # re-saving a step: move the old one aside first (a kill or a
                aside = self.root / f".trash-{final.name}-{uuid.uuid4().hex[:8]}"  # failure in
                os.rename(final, aside)  # between is repaired by the next manager:
                os.rename(tmp, final)  # _restore_interrupted)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self._save_failed(step, err)) from err
        try:
            sync_folder(self.root)  # committed
            self._write_pointer(final.name)
            self._prune(keep_name=final.name)
        except OSError as err:
            raise CheckpointError(self._saved_but(step, final, err)) from err

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
            aside = self.root / f"{_PRUNED}{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, aside)  # never leave a half-deleted folder under a step_ name, nor
            shutil.rmtree(aside, ignore_errors=True)  # under one start-up puts back (.trash-)

    # -- start-up repairs (under the lock) ----------------------------------------------

    def _restore_interrupted(self) -> list[Path]:
        """Put back what :meth:`interrupted` names (a kill between the renames of a save)."""
        restored = []
        for name, found in self._restorable().items():
            os.rename(found, self.root / name)
            restored.append(self.root / name)
        if restored:
            sync_folder(self.root)
        return restored

    def _restorable(self) -> dict[str, Path]:
        """``step_N`` -> the folder that puts it back: a complete ``.tmp-`` (finished, not yet
        renamed in: preferred, it is the newer save) or ``.trash-`` one (a re-save's old copy
        moved aside), when no ``step_N`` is there. Pruned folders (``.pruned-``) never are."""
        candidates: dict[str, list[tuple[int, Path]]] = {}
        for path in self.root.iterdir() if self.root.is_dir() else ():
            match = _PARTIAL.match(path.name)
            if match and not path.is_symlink() and readable_meta(path):
                order = 0 if match[1] == "tmp" else 1
                candidates.setdefault(match[2], []).append((order, path))
        return {
            name: min(found)[1]
            for name, found in sorted(candidates.items())
            if not (self.root / name).exists()
        }

    def interrupted(self) -> list[str]:
        """The checkpoints (``step_N``) a kill left half renamed, which the next writing manager
        puts back at start-up (read-only: nothing is moved)."""
        return list(self._restorable())

    def _remove_partial(self) -> list[Path]:
        removed = []
        for path in self.root.iterdir():
            if path.name.startswith(_PARTIAL_PREFIXES):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    def _repair_pointer(self) -> None:
        """Point ``latest`` at the checkpoint :meth:`latest` resolves to."""
        target = self.latest()
        if target is not None and target != self._pointed():
            self._write_pointer(target.name)

    def _require_lock(self, what: str) -> None:
        if self._lock is None or self._lock._handle is None:
            raise CheckpointError(
                f"this CheckpointManager of {self.root} cannot {what}: it was opened read-only "
                "(lock=False) or closed; open one with lock=True to write"
            )

    # -- reading ----------------------------------------------------------------------

    def symlinked(self) -> list[Path]:
        """``step_N`` entries that are symbolic links: never loaded, listed or pruned."""
        return symlinked_steps(self.root)

    def list(self) -> list[Path]:
        """Complete checkpoints (``step_N`` folders with ``meta.json``), oldest first."""
        return complete_steps(self.root)

    def _pointed(self) -> Path | None:
        pointer = self.root / "latest"
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return self.root / name if STEP_DIR.match(name) else None

    def latest(self) -> Path | None:
        """The checkpoint to continue from (the one rule for every reader and writer): the
        highest complete step, unless ``latest`` names a complete checkpoint of another run
        than that one (then the highest belongs to someone else: :meth:`load` refuses it, and
        ``latest`` is followed). A pointer naming an older checkpoint of the same run is stale (a
        kill between a commit and the pointer's rewrite). None if there is no checkpoint."""
        complete = self.list()
        if not complete:
            return None
        pointed = self._pointed()
        if pointed in complete and _run_of(pointed) != _run_of(complete[-1]):
            return pointed
        return complete[-1]

    def load(self, path: str | Path | None = None) -> Checkpoint:
        """Open ``path`` (default: :meth:`latest`). Raises CheckpointError if there is none, if
        it is a symbolic link, if its ``meta.json`` is unreadable or a state or file it lists is
        missing (``trainer.checkpoint_read``), or if it belongs to another run."""
        target = Path(path) if path is not None else self.latest()
        if target is None:
            raise CheckpointError(
                f"no checkpoint in {self.root}; run without --resume to start fresh"
            )
        found = read_meta(target).get("run_id") if not target.is_symlink() else None
        if self.run_id is not None and found is not None and found != self.run_id:
            raise CheckpointError(
                f"{target} belongs to run {found}, not to this run ({self.run_id}): checkpoint.dir "
                f"{self.root} holds another run's checkpoints. Resume that run with its own "
                "output_dir, or point checkpoint.dir at this run's checkpoints"
            )
        return open_checkpoint(target)


def resume_hint(root: str | Path) -> str:
    """How to go on after a run stopped (a signal, a failed save): the checkpoint
    :meth:`CheckpointManager.latest` resolves to, as the next ``--resume`` loads it."""
    manager = CheckpointManager(root, lock=False)
    latest = manager.latest()
    if latest is not None:
        return f"continue from {latest} with --resume"
    if manager.interrupted():
        return f"continue with --resume (it puts back {manager.interrupted()[-1]} first)"
    return "no checkpoint was saved yet (checkpoint.every): start again without --resume"


def _run_of(path: Path) -> Any:
    try:
        return read_meta(path).get("run_id")
    except CheckpointError:  # a damaged one is reported when it is loaded
        return None


def _name(step: int) -> str:
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"
