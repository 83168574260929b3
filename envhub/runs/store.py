"""The trajectory store: every episode a run plays, as Parquet parts under ``RUN/trajectories/``.

One part per ``(kind, step)``: ``train-000000012.parquet`` holds the training episodes of step
12, ``eval-000000010.parquet`` the evaluation after step 10, ``envhub-eval-000000000.parquet``
the episodes of an ``envhub eval --out`` run. Parquet (pyarrow, the kept library for columnar
files) because the viewer filters and sorts a million episodes by reading a few small columns
(step, env, return, success, ...) and fetches tokens and messages for one episode at a time.

Safety, the reasons for one file per part:

- **No torn files.** A part is written to a hidden temporary name and renamed into place
  (``os.replace``, atomic): a killed run leaves only whole parts; readers skip temporary files.
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

__all__ = [
    "COLUMNS",
    "LIGHT_COLUMNS",
    "PART",
    "TrajectoryWriter",
    "part_name",
    "schema",
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
    """Write one part atomically (temporary file, then rename); returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {"kind": kind, "step": int(step), "index": i, **{k: r.get(k) for k in COLUMNS[3:]}}
        for i, r in enumerate(records)
    ]
    table = pa.Table.from_pylist(rows, schema=schema())
    final = folder / part_name(kind, step)
    temporary = folder / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    pq.write_table(table, temporary, compression="zstd", row_group_size=4096)
    os.replace(temporary, final)
    return final


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
