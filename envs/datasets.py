"""Binding a dataset of tasks to a task-driven environment: one mechanism for every env.

A *task* is a JSON object (a ``dict``) the env knows how to play: a maths word problem, a
SQL question, a coding problem with tests, a shopping instruction. Every task env in
``envs/`` takes its tasks the same three ways, in this order of precedence:

1. ``env.reset(options={"task": {...}})`` plays exactly that task;
2. ``env.reset(options={"task_id": "..."})`` or ``{"task_index": i}`` picks one from the
   bound dataset;
3. otherwise ``reset(seed=s)`` draws a task from the bound dataset with the env's seeded
   RNG, so a seed always selects the same task.

The dataset is bound at construction: ``envhub.make("code/humaneval-v0", dataset="my.jsonl",
split="eval")``. ``dataset`` may be a JSONL path, a list/iterable of dicts or a
``TaskSet``; ``None`` means the env's built-in tasks.

Splits and seeds
----------------
Each task gets a stable ``id`` (its ``id``/``task_id`` field, else its position) and a
``split``: the record's own ``split`` field if it has one, else ``"eval"`` for a fixed
fraction (``eval_fraction``) of ids chosen by a hash of the id and ``split_seed`` — stable
when tasks are added or reordered. Each task also gets a per-task ``seed`` (the record's
``seed`` field, else a hash of its id): envs that generate content around a task (a
database, a catalogue) draw it from that seed, so a task looks the same whichever episode
seed selected it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = ["Split", "Task", "TaskSet", "TaskSetError", "as_taskset", "stable_hash"]

Task = dict[str, Any]
Split = Literal["train", "eval", "all"]
_SPLITS = ("train", "eval", "all")


class TaskSetError(ValueError):
    """A dataset could not be read or a task could not be found; the message names the fix."""


def stable_hash(*parts: Any) -> int:
    """A 63-bit hash of ``parts`` that is the same in every process (unlike ``hash``)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _read_jsonl(path: Path) -> list[Task]:
    if not path.exists():
        raise TaskSetError(
            f"dataset file {str(path)!r} does not exist; pass a JSONL path or a list of dicts"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    tasks: list[Task] = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskSetError(
                    f"{path}:{number} is not valid JSON ({exc}); each line must be one JSON object"
                ) from None
            if not isinstance(record, dict):
                raise TaskSetError(
                    f"{path}:{number} is a {type(record).__name__}, not a JSON object"
                )
            tasks.append(record)
    return tasks


class TaskSet(Sequence[Task]):
    """An ordered, immutable set of tasks with stable ids, splits and per-task seeds."""

    def __init__(
        self,
        tasks: Iterable[Mapping[str, Any]],
        *,
        name: str = "tasks",
        eval_fraction: float = 0.0,
        split_seed: int = 0,
        required: Sequence[str] = (),
    ) -> None:
        if not 0.0 <= eval_fraction <= 1.0:
            raise TaskSetError(f"eval_fraction must be in [0, 1], got {eval_fraction!r}")
        self.name = name
        self.eval_fraction = eval_fraction
        self.split_seed = split_seed
        self._tasks: list[Task] = []
        seen: set[str] = set()
        for index, record in enumerate(tasks):
            if not isinstance(record, Mapping):
                raise TaskSetError(f"{name}: task {index} is a {type(record).__name__}, not a dict")
            missing = [key for key in required if key not in record]
            if missing:
                raise TaskSetError(
                    f"{name}: task {index} lacks the field(s) {missing}; "
                    f"every task needs {list(required)} "
                    f"(got keys {sorted(record)})"
                )
            task = dict(record)
            task_id = str(task.get("id", task.get("task_id", index)))
            if task_id in seen:
                raise TaskSetError(
                    f"{name}: duplicate task id {task_id!r}; give every task a unique 'id'"
                )
            seen.add(task_id)
            task["id"] = task_id
            task.setdefault("seed", stable_hash(name, task_id) % (2**31))
            if "split" not in task:
                fraction = stable_hash(split_seed, task_id) / 2**63
                task["split"] = "eval" if fraction < eval_fraction else "train"
            self._tasks.append(task)
        self._by_id = {task["id"]: i for i, task in enumerate(self._tasks)}

    @classmethod
    def from_jsonl(cls, path: str | Path, **options: Any) -> TaskSet:
        """Read one task per line from a JSONL file (``.jsonl`` or ``.jsonl.gz``)."""
        path = Path(path)
        options.setdefault("name", path.name)
        return cls(_read_jsonl(path), **options)

    def split(self, which: Split) -> TaskSet:
        """The tasks of one split (``"all"`` returns ``self``); refuses an empty result."""
        if which not in _SPLITS:
            raise TaskSetError(f"unknown split {which!r}; use one of {_SPLITS}")
        if which == "all":
            return self
        chosen = [task for task in self._tasks if task["split"] == which]
        if not chosen:
            raise TaskSetError(
                f"{self.name}: the {which!r} split is empty "
                f"({len(self)} tasks, eval_fraction={self.eval_fraction}); "
                "set eval_fraction, add 'split' fields to the records, or use split='all'"
            )
        subset = TaskSet.__new__(TaskSet)
        subset.name, subset.eval_fraction, subset.split_seed = (
            f"{self.name}[{which}]",
            self.eval_fraction,
            self.split_seed,
        )
        subset._tasks = chosen
        subset._by_id = {task["id"]: i for i, task in enumerate(chosen)}
        return subset

    def get(self, task_id: str) -> Task:
        """The task with this id; unknown ids name a few known ones."""
        index = self._by_id.get(str(task_id))
        if index is None:
            known = ", ".join(list(self._by_id)[:5])
            raise TaskSetError(
                f"{self.name} has no task with id {task_id!r} (ids look like: {known}, ...)"
            )
        return dict(self._tasks[index])

    def sample(self, rng: np.random.Generator) -> Task:
        """A task drawn with ``rng`` (the env's seeded ``np_random``)."""
        return dict(self._tasks[int(rng.integers(len(self._tasks)))])

    def select(
        self,
        options: Mapping[str, Any],
        rng: np.random.Generator,
        *,
        required: Sequence[str] = (),
        generated: Sequence[str] = (),
    ) -> Task:
        """The task for ``reset(options=...)``, by the precedence in the module docstring.

        A custom ``options["task"]`` must have every field of ``required`` (what a dataset's
        record needs) or, where the env generates tasks from a seed, every field of
        ``generated`` (the built-in tasks' own form, e.g. ``("kind",)``); else ``TaskSetError``
        names the missing fields and what a task needs, before the env reads any of them."""
        if options.get("task") is not None:
            task = options["task"]
            if not isinstance(task, Mapping):
                raise TaskSetError(f"options['task'] must be a dict, got {type(task).__name__}")
            self._check_custom(task, required, generated)
            task = dict(task)
            task.setdefault("id", "custom")
            task.setdefault(
                "seed",
                stable_hash(self.name, json.dumps(task, sort_keys=True, default=str)) % (2**31),
            )
            return task
        if options.get("task_id") is not None:
            return self.get(options["task_id"])
        if options.get("task_index") is not None:
            index = options["task_index"]
            if not isinstance(index, int) or not -len(self) <= index < len(self):
                raise TaskSetError(f"task_index {index!r} is out of range for {len(self)} tasks")
            return dict(self._tasks[index])
        return self.sample(rng)

    def _check_custom(
        self, task: Mapping[str, Any], required: Sequence[str], generated: Sequence[str]
    ) -> None:
        """Refuse a custom task that has neither every ``required`` field nor every
        ``generated`` one, naming what it lacks."""
        missing = [key for key in required if key not in task]
        if not missing or (generated and all(key in task for key in generated)):
            return
        alternative = f", or {list(generated)} to draw one from its seed" if generated else ""
        raise TaskSetError(
            f"{self.name}: options['task'] lacks the field(s) {missing}; a task needs "
            f"{list(required)}{alternative} (got keys {sorted(map(str, task))})"
        )

    @property
    def ids(self) -> list[str]:
        return list(self._by_id)

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, index: int) -> Task:  # type: ignore[override]
        return dict(self._tasks[index])

    def __iter__(self) -> Iterator[Task]:
        return (dict(task) for task in self._tasks)

    def __repr__(self) -> str:
        return f"TaskSet({self.name!r}, {len(self)} tasks)"


def as_taskset(
    dataset: str | Path | TaskSet | Iterable[Mapping[str, Any]] | None,
    *,
    default: TaskSet | Iterable[Mapping[str, Any]],
    split: Split = "all",
    eval_fraction: float = 0.0,
    required: Sequence[str] = (),
    name: str = "tasks",
) -> TaskSet:
    """Resolve an env's ``dataset=`` argument to the ``TaskSet`` of one split."""
    if dataset is None:
        dataset = default
    if isinstance(dataset, TaskSet):
        tasks = dataset
    elif isinstance(dataset, (str, Path)):
        tasks = TaskSet.from_jsonl(dataset, eval_fraction=eval_fraction, required=required)
    elif isinstance(dataset, Iterable):
        tasks = TaskSet(dataset, name=name, eval_fraction=eval_fraction, required=required)
    else:
        raise TaskSetError(
            "dataset must be a JSONL path, a list of dicts or a TaskSet, "
            f"got {type(dataset).__name__}"
        )
    if len(tasks) == 0:
        raise TaskSetError(f"{tasks.name} holds no tasks; give a non-empty dataset")
    return tasks.split(split)
