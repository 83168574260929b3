"""Reading one part of the trajectory store: its small columns (for the episode table) or one
episode's every column (for a transcript).

A part that exists but cannot be read raises ``UnreadablePartError``, naming the file and why:
a damaged data page or footer, columns of other types (another tool's file), or a file that
is not a regular file (a FIFO would block the reader forever; it is never opened). A part that
is gone raises ``FileNotFoundError``: ``keep_last`` pruned it, which is no problem.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from envhub.runs.store import COLUMNS, LIGHT_COLUMNS, schema

__all__ = ["UnreadablePartError", "read_episode", "read_light", "reason"]


class UnreadablePartError(Exception):
    """A part that exists and cannot be read; ``why`` says what failed."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path.name} is unreadable ({why})")
        self.name, self.why = path.name, why


def reason(error: BaseException) -> str:
    """An error as one short line: its type and the first line of its text."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def read_light(path: Path) -> Any:
    """One part's ``LIGHT_COLUMNS`` as a table of the store's types (any error of the read is
    raised as it is: the caller names the part)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    full = schema()
    light = pa.schema([full.field(name) for name in LIGHT_COLUMNS])
    with pq.ParquetFile(path) as part:  # (cheaper than pq.read_table, which builds a dataset)
        if set(LIGHT_COLUMNS) <= set(part.schema_arrow.names):
            return part.read(columns=list(LIGHT_COLUMNS), use_threads=False).cast(light)
    return pq.read_table(path, columns=list(LIGHT_COLUMNS), schema=full)  # an older part


def read_episode(path: Path, kind: str, step: int, index: int) -> dict[str, Any] | None:
    """Every column (``COLUMNS``) of episode ``index`` of the part ``path``, None when the
    part has no such row (columns an older part lacks are null)."""
    import pyarrow.dataset as ds

    if not stat.S_ISREG(path.stat().st_mode):  # FileNotFoundError: no such part
        raise UnreadablePartError(path, "not a regular file")
    try:
        dataset = ds.dataset([str(path)], format="parquet", schema=schema())
        match = (
            (ds.field("kind") == kind) & (ds.field("step") == step) & (ds.field("index") == index)
        )
        rows = dataset.to_table(columns=list(COLUMNS), filter=match).to_pylist()
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - any failed read: the part is unreadable
        raise UnreadablePartError(path, reason(error)) from None
    return rows[0] if rows else None
