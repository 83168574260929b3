"""Reading one checkpoint folder that ``trainer.checkpoint`` wrote: what counts as complete, and
what is refused (the guarantees are listed in ``trainer.checkpoint``'s docstring).

1. **Complete means a readable ``meta.json`` in a real folder.** ``step_N`` must be a folder,
   not a symbolic link (one could point anywhere: such a link is ignored and named by
   :func:`symlinked_steps`); its ``meta.json`` must have the keys every checkpoint has.
2. **Every file the checkpoint was saved with is there.** ``meta.json`` lists them
   (``files``: ``extra.pt``, and ``rng.pt`` / ``config.json`` when they were saved); a listed
   file that is missing is refused naming it, as a missing state is. A checkpoint written
   before that list existed is refused without its ``extra.pt`` (always written), and loads
   without its ``rng.pt`` with a line in :attr:`Checkpoint.warnings`.
3. **Data of the wrong shape is refused naming the file**: an ``rng.pt`` whose states no
   generator accepts, an ``extra.pt`` that is not a dict (instead of a traceback later).
4. **Loading runs no code** (``torch.load(weights_only=True)``, :func:`torch_load`).

Each refusal names the older complete checkpoint to continue from (:func:`fallback`).
"""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import CheckpointError

__all__ = [
    "Checkpoint",
    "complete_steps",
    "fallback",
    "open_checkpoint",
    "read_meta",
    "readable_meta",
    "symlinked_steps",
    "torch_load",
]

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d{8,})$")
_META_KEYS = {"format": int, "step": int, "states": list}
ALWAYS_WRITTEN = "extra.pt"
"""The one file beside ``meta.json`` that every checkpoint has (a checkpoint's other files are
listed in its ``meta.json``)."""


def torch_load(path: Path, map_location: Any, fallback: str = "") -> Any:
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


@dataclass
class Checkpoint:
    """One complete checkpoint on disk. States are loaded on demand."""

    path: Path
    step: int
    state_names: list[str]
    seeds: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """What this checkpoint lacks that a resume can do without (rule 2), one line each."""

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
        """The saving process's RNG states (pass to ``trainer.checkpoint.restore_rng``)."""
        path = self.path / "rng.pt"
        if not path.exists():
            return {}
        state = self._load(path, "cpu")
        problem = _rng_problem(state)
        if problem:
            raise CheckpointError(
                f"{path} holds {problem}, not the RNG states this trainer saves "
                f"(edited, or written by something else).{fallback(self.path)}"
            )
        return dict(state)

    @property
    def extra(self) -> dict[str, Any]:
        """The extra state saved with it."""
        path = self.path / "extra.pt"
        if not path.exists():
            return {}
        extra = self._load(path, "cpu")
        if not isinstance(extra, dict):
            raise CheckpointError(
                f"{path} holds a {type(extra).__name__}, not the dict of extra state this trainer "
                f"saves (edited, or written by something else).{fallback(self.path)}"
            )
        return extra

    @property
    def config(self) -> dict[str, Any] | None:
        """The run config saved with it, if any."""
        path = self.path / "config.json"
        if not path.exists():
            return None
        try:
            return dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path} is unreadable ({err}).{fallback(self.path)}") from None

    def _load(self, path: Path, map_location: Any) -> Any:
        return torch_load(path, map_location, fallback(self.path))


def _rng_problem(state: Any) -> str | None:
    """What is wrong with a loaded ``rng.pt`` (None: each state is accepted by a fresh generator
    of its kind, so restoring it cannot fail half-way)."""
    import random

    import numpy as np
    import torch

    if not isinstance(state, dict):
        return f"a {type(state).__name__}"
    checks = {
        "python": lambda value: random.Random().setstate(value),
        "numpy": lambda value: np.random.RandomState().set_state(value),
        "torch": lambda value: torch.Generator().set_state(value),
        "torch_cuda": _check_cuda_states,  # (restored only where CUDA is: checked by type)
    }
    for key, check in checks.items():
        if key in state:
            try:
                check(state[key])
            except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as err:
                return f"a {key!r} state that cannot be restored ({err})"
    return None


def _check_cuda_states(value: Any) -> None:
    import torch

    if not isinstance(value, list | tuple) or not all(
        isinstance(one, torch.Tensor) and one.dtype == torch.uint8 for one in value
    ):
        raise TypeError("expected a list of uint8 tensors, one per CUDA device")


def fallback(damaged: Path) -> str:
    """What to do about a damaged checkpoint: the older complete one to continue from, and how."""
    older = [p for p in complete_steps(damaged.parent) if p.name < damaged.name]
    if not older:
        return (
            f" No older complete checkpoint is in {damaged.parent}; start a fresh run "
            "(without --resume)"
        )
    return (
        f" To continue from the older complete checkpoint {older[-1].name}, move the damaged one "
        f"aside (mv {damaged} {damaged}.damaged) and run with --resume again"
    )


def complete_steps(root: Path) -> list[Path]:
    """The complete checkpoints (``step_N`` folders with ``meta.json``, not symbolic links) in
    ``root``, oldest first."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = STEP_DIR.match(path.name)
        if match and not path.is_symlink() and (path / "meta.json").is_file():
            found.append((int(match[1]), path))
    return [p for _, p in sorted(found)]


def symlinked_steps(root: Path) -> list[Path]:
    """The ``step_N`` entries of ``root`` that are symbolic links (never checkpoints: rule 1)."""
    entries = sorted(root.iterdir()) if root.is_dir() else []
    return [p for p in entries if STEP_DIR.match(p.name) and p.is_symlink()]


def readable_meta(target: Path) -> bool:
    """``target`` has a meta.json that :func:`read_meta` accepts (a kill may have cut an older
    trainer's meta.json short: it was written in place)."""
    try:
        read_meta(target)
    except CheckpointError:
        return False
    return True


def read_meta(target: Path) -> dict[str, Any]:
    """``target/meta.json``, checked for the keys every checkpoint has."""
    path = target / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{target} is not a complete checkpoint (no meta.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable ({err}).{fallback(target)}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a JSON object.{fallback(target)}")
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
            f"{fallback(target)}"
        )
    return meta


def open_checkpoint(target: Path) -> Checkpoint:
    """The checkpoint in ``target``, refused when ``meta.json`` is unreadable or a state or file
    it lists is missing (rules 1-2; the run id is checked by the manager)."""
    if target.is_symlink():
        raise CheckpointError(
            f"{target} is a symbolic link (to {target.resolve()}), not a checkpoint folder: a "
            f"checkpoint must be a folder inside {target.parent}. Remove the link, or copy the "
            "checkpoint there"
        )
    meta = read_meta(target)
    missing = [n for n in meta["states"] if not (target / "states" / f"{n}.pt").is_file()]
    if missing:
        raise CheckpointError(
            f"{target} lists states {missing} that are not in {target / 'states'}."
            f"{fallback(target)}"
        )
    listed = meta.get("files")
    needed = [str(n) for n in listed] if isinstance(listed, list) else [ALWAYS_WRITTEN]
    lacking = [name for name in needed if not (target / name).is_file()]
    if lacking:
        raise CheckpointError(
            f"{target} lacks {', '.join(lacking)}, saved with it (its meta.json lists it): "
            f"resuming without it would not continue the run as saved.{fallback(target)}"
        )
    warnings = []
    if listed is None and not (target / "rng.pt").is_file():  # saved before the list existed
        warnings.append(
            f"{target} has no rng.pt: the driver's random states start afresh (the run does "
            "not continue exactly as an uninterrupted one would)"
        )
    return Checkpoint(
        path=target,
        step=int(meta["step"]),
        state_names=list(meta["states"]),
        seeds=dict(meta.get("seeds") or {}),
        meta=meta,
        warnings=warnings,
    )
