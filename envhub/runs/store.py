"""The trajectory store: every episode a run plays, as Parquet parts under ``RUN/trajectories/``.

One part per ``(kind, step)``: ``train-000000012.parquet`` holds the training episodes of step
12, ``eval-000000010.parquet`` the evaluation after step 10, ``envhub-eval-000000000.parquet``
the episodes of an ``envhub eval --out`` run. Parquet (pyarrow, the kept library for columnar
files) because the viewer filters and sorts a million episodes by reading a few small columns
(step, env, return, success, ...) and fetches tokens and messages for one episode at a time.

Safety, the reasons for one file per part:

- **No torn files.** A part is written to a hidden temporary name, synced, and renamed into
  place (``os.replace``, atomic; the folder synced after): a killed run (or a power cut) leaves
  only whole parts; readers skip temporary files, and a writer that starts removes those of
  writers that were killed.
- **One bad value costs itself.** Text with lone surrogates, or an integer past int64 (a seed an
  env chose), is stored repaired or as null and logged; the step's other episodes are stored.
- **Resume without duplicates.** Writing a part that exists replaces it, and a resumed run
  first drops the parts after its checkpoint (``truncate_after``), so every (kind, step) is
  stored once.
- **Off the training thread.** ``TrajectoryWriter.write`` only queues the records; a daemon
  thread builds the table and writes it. A failing write is logged, never raised into the run.

Bounded by ``every`` (steps between stored steps), ``sample`` (a fraction of a step's episodes,
or a count) and ``keep_last`` (training parts kept; older ones are deleted).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envhub.parsing import valid_text

__all__ = [
    "COLUMNS",
    "LIGHT_COLUMNS",
    "PART",
    "TrajectoryWriter",
    "part_name",
    "remove_leftovers",
    "schema",
    "sync_folder",
    "to_table",
    "write_part",
]

_log = logging.getLogger(__name__)

PART = re.compile(r"^(?P<kind>[a-z][a-z0-9-]*)-(?P<step>\d{9})\.parquet$")
"""A complete part's file name (temporary files start with ``.``)."""

LIGHT_COLUMNS: tuple[str, ...] = (
    "kind",
    "step",
    "index",
    "env_id",
    "seed",
    "group_id",
    "sample",
    "agent",
    "success",
    "failed",
    "failure",
    "return",
    "advantage",
    "turns",
    "tokens",
    "invalid_actions",
    "terminated",
    "truncated",
    "time_s",
)
"""The columns of the episode table: what filters and sorts read (no tokens, no text)."""

COLUMNS: tuple[str, ...] = (
    *LIGHT_COLUMNS,
    "policy_versions",
    "turn_rewards",
    "messages",
    "info",
    "token_ids",
    "response_mask",
    "logprobs",
    "advantages",
    "row_starts",
)
"""Every column. ``messages`` and ``info`` are JSON text; ``token_ids``, ``response_mask``
(1 = policy token), ``logprobs`` (sampled) and ``advantages`` are per token over the episode's
training rows concatenated, ``row_starts`` where each row begins (one row unless the episode
was trained as per-turn samples)."""


def schema() -> Any:
    """The Arrow schema of a part (every part has all columns; missing values are null)."""
    import pyarrow as pa

    types = {
        "kind": pa.string(),
        "step": pa.int64(),
        "index": pa.int64(),
        "env_id": pa.string(),
        "seed": pa.int64(),
        "group_id": pa.int64(),
        "sample": pa.int64(),
        "agent": pa.string(),
        "success": pa.bool_(),
        "failed": pa.bool_(),
        "failure": pa.string(),
        "return": pa.float64(),
        "advantage": pa.float64(),
        "turns": pa.int64(),
        "tokens": pa.int64(),
        "invalid_actions": pa.int64(),
        "terminated": pa.bool_(),
        "truncated": pa.bool_(),
        "time_s": pa.float64(),
        "policy_versions": pa.list_(pa.int64()),
        "turn_rewards": pa.list_(pa.float64()),
        "messages": pa.string(),
        "info": pa.string(),
        "token_ids": pa.list_(pa.int32()),
        "response_mask": pa.list_(pa.int8()),
        "logprobs": pa.list_(pa.float32()),
        "advantages": pa.list_(pa.float32()),
        "row_starts": pa.list_(pa.int32()),
    }
    return pa.schema([(name, types[name]) for name in COLUMNS])


def part_name(kind: str, step: int) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9-]*", kind):
        raise ValueError(f"part kind {kind!r} must be lower-case letters, digits and '-'")
    return f"{kind}-{int(step):09d}.parquet"


def write_part(folder: Path, kind: str, step: int, records: Sequence[Mapping[str, Any]]) -> Path:
    """Write one part atomically and durably; returns its path.

    The table goes to a hidden temporary file, which is synced, renamed into place, and the
    folder synced: a crash or power cut leaves the old part or the new one, never a torn or
    empty file under a part's name. A value that does not fit its column (see ``to_table``)
    is stored as null and logged; the rest of the step is stored."""
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {"kind": kind, "step": int(step), "index": i, **{k: r.get(k) for k in COLUMNS[3:]}}
        for i, r in enumerate(records)
    ]
    table, problems = to_table(rows, [f"{kind}:{int(step)}:{i}" for i in range(len(rows))])
    for problem in problems:
        _log.warning("trajectory store: %s", problem)
    final = folder / part_name(kind, step)
    temporary = folder / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(temporary, "wb") as sink:
            pq.write_table(table, sink, compression="zstd", row_group_size=4096)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)  # only left when the write failed
    sync_folder(folder)
    return final


def to_table(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> tuple[Any, list[str]]:
    """``rows`` (dicts of ``COLUMNS``) as an Arrow table of ``schema()``, and its problems.

    One bad value costs only itself: text with lone surrogates (an env's exception message
    decoded with ``surrogateescape``) keeps its text with U+FFFD in their place, and a value its
    column cannot hold (an integer past int64, text where a number belongs) is stored as null
    and named in the problems as ``"{names[i]}: {column} {value!r} ..."``."""
    import pyarrow as pa

    try:
        return pa.Table.from_pylist(list(rows), schema=schema()), []
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass  # some row holds a bad value: find it, row by row (the slow path is the rare one)
    types = schema()
    problems: list[str] = []
    clean = [_fitting(row, name, types, problems) for row, name in zip(rows, names, strict=True)]
    return pa.Table.from_pylist(clean, schema=types), problems


def _fitting(row: Mapping[str, Any], name: str, types: Any, problems: list[str]) -> dict[str, Any]:
    """``row`` with each value its column cannot hold replaced (see ``to_table``)."""
    import pyarrow as pa

    try:
        pa.Table.from_pylist([dict(row)], schema=types)
        return dict(row)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    out: dict[str, Any] = {}
    for column, value in row.items():
        if column not in types.names:
            continue
        value = valid_text(value)
        try:
            pa.array([value], type=types.field(column).type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            wanted = types.field(column).type
            problems.append(f"{name}: {column} {shown} does not fit {wanted} (stored as null)")
            value = None
        out[column] = value
    return out


def sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (its directory entry is on disk); the run's
    checkpoints (``trainer.checkpoint``) use it too."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


_TEMPORARY = re.compile(r"^\.(?P<part>.+\.parquet)\.(?P<pid>\d+)\.(?P<thread>\d+)\.tmp$")
"""A part being written by process ``pid`` (``write_part``'s temporary name)."""


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete the temporary files of writers that were killed mid-write (their process is
    gone); a live writer's are kept. Returns the files removed."""
    removed = []
    for path in folder.glob(".*.tmp") if folder.is_dir() else []:
        match = _TEMPORARY.match(path.name)
        if match and not _alive(int(match["pid"])):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user's process
    except (OverflowError, OSError):
        return False  # not a pid this system can have
    return True


class TrajectoryWriter:
    """Writes a run's parts from a background thread (see the module docstring)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        every: int = 1,
        sample: float = 1.0,
        keep_last: int | None = None,
        seed: int = 0,
    ) -> None:
        if every < 0:
            raise ValueError(f"every must be >= 0 (0 stores nothing), got {every}")
        if sample <= 0:
            raise ValueError(f"sample must be a fraction in (0, 1] or a count >= 1, got {sample}")
        self.folder = Path(run_dir) / "trajectories"
        self.every, self.sample, self.keep_last, self.seed = every, sample, keep_last, seed
        self.errors: list[str] = []
        """Writes that failed (also logged); the run goes on without them."""
        self.busy_s = 0.0
        """Seconds the writer thread has spent writing parts (the store's cost off the caller's
        thread)."""
        for path in remove_leftovers(self.folder):
            _log.info("trajectory store: removed %s, left by a writer that was killed", path.name)
        self._queue: queue.Queue[tuple[str, int, list[Mapping[str, Any]]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="trajectory-store", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        """Whether ``step``'s episodes are stored (``every`` steps; step 0 and eval always)."""
        return self.every > 0 and step % self.every == 0

    def write(self, kind: str, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Queue ``records`` (episodes as ``COLUMNS`` dicts) as part ``(kind, step)``,
        thinned by ``sample``; returns at once."""
        if self.every == 0 or not records:
            return
        chosen = list(records)
        if self.sample <= 1:  # a fraction
            count = max(1, round(self.sample * len(chosen)))
        else:  # a count
            count = min(int(self.sample), len(chosen))
        if count < len(chosen):
            picked = random.Random(f"{self.seed}/{kind}/{step}").sample(range(len(chosen)), count)
            chosen = [chosen[i] for i in sorted(picked)]
        self._queue.put((kind, step, chosen))

    def truncate_after(self, step: int) -> None:
        """Drop the parts of steps after ``step`` (a resumed run plays them again)."""
        self.flush()
        for path in self.folder.glob("*.parquet"):
            match = PART.match(path.name)
            if match and match["kind"] in ("train", "eval") and int(match["step"]) > step:
                path.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued part is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued and stop the thread."""
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                kind, step, records = item
                started = time.perf_counter()
                write_part(self.folder, kind, step, records)
                if kind == "train" and self.keep_last is not None:
                    self._prune()
                self.busy_s += time.perf_counter() - started
            except Exception as error:  # noqa: BLE001 - a failed write must not stop the run
                message = f"trajectory store: {type(error).__name__}: {error}"
                self.errors.append(message)
                _log.warning(message)
            finally:
                self._queue.task_done()

    def _prune(self) -> None:
        parts = sorted(
            (int(m["step"]), p)
            for p in self.folder.glob("train-*.parquet")
            if (m := PART.match(p.name))
        )
        for _, path in parts[: max(0, len(parts) - int(self.keep_last or 0))]:
            path.unlink(missing_ok=True)
