"""Reading a run folder: metrics, the trajectory store, ``envhub eval`` results.

``envhub.runs.open(path)`` returns a ``Run``. It reads while the run writes: parts appear whole
(``store``'s atomic renames), a torn last metrics line is skipped, a part deleted while it is
read (``keep_last`` pruning) is read around, and what cannot be read is left out and named in
``Run.problems`` instead of failing the read: a truncated or corrupted part, an
``episodes.jsonl`` line that is no episode, and anything that is not a regular file (a FIFO or
a device under a run's file name would block a reader forever; it is never opened).

``Run.episodes`` filters, sorts and pages with Arrow over the small columns only
(``LIGHT_COLUMNS``), so a store of a million episodes is never loaded whole; those columns are
kept per part (keyed by its size and mtime), so a poll after a new step reads only the new part.
``Run.episode`` reads one episode's tokens and messages. A ``Run`` may be read from several
threads at once (the viewer's requests).

An ``envhub eval --out`` folder written before the store existed (``episodes.jsonl`` only) is
read from its JSONL.
"""

from __future__ import annotations

import json
import math
import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envhub.errors import EnvhubError
from envhub.runs.store import COLUMNS, LIGHT_COLUMNS, PART, schema, to_table

__all__ = ["EpisodePage", "NotARunError", "Run", "open_run"]

SORTABLE = frozenset(LIGHT_COLUMNS)


class NotARunError(EnvhubError):
    """The folder holds no run (no metrics, no trajectory store, no eval episodes)."""


@dataclass(frozen=True)
class EpisodePage:
    """One page of a filtered, sorted episode table."""

    total: int
    """Episodes that match the filter (all pages)."""
    rows: list[dict[str, Any]]
    """This page's episodes (``LIGHT_COLUMNS`` and ``key``)."""


def episode_key(kind: str, step: int, index: int) -> str:
    """The id of an episode within its run: ``kind:step:index``."""
    return f"{kind}:{int(step)}:{int(index)}"


@dataclass
class Run:
    """A run folder (see the module docstring); build with ``open_run``."""

    path: Path
    problems: list[str] = field(default_factory=list)
    """Parts, files or lines that could not be read (named, left out)."""
    _checked: dict[Path, tuple[int, int, bool]] = field(default_factory=dict, repr=False)
    _light: dict[Path, tuple[tuple[int, int], Any]] = field(default_factory=dict, repr=False)
    _jsonl: tuple[tuple[int, int], Any] | None = field(default=None, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.path.name

    def problem(self, text: str) -> None:
        """Name something left out (once)."""
        with self._lock:
            if text not in self.problems:
                self.problems.append(text)

    def read_text(self, path: Path) -> str | None:
        """``path``'s text, or None when it is absent or not a regular file (named in
        ``problems``: opened without waiting, so a FIFO never blocks the reader)."""
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        with open(descriptor, "rb") as file:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                self.problem(f"{_relative(path, self.path)}: not a regular file (left out)")
                return None
            return file.read().decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> list[dict[str, Any]]:
        """``metrics.jsonl``'s rows (a line being written, or torn by a kill, is skipped)."""
        text = self.read_text(self.path / "metrics.jsonl")
        rows = []
        for line in (text or "").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def summary(self) -> list[dict[str, Any]]:
        """An ``envhub eval`` run's ``summary.json`` rows (empty for a training run)."""
        try:
            data = json.loads(self.read_text(self.path / "summary.json") or "[]")
        except ValueError:
            return []
        return [row for row in data if isinstance(row, dict)] if isinstance(data, list) else []

    def env_kwargs(self, env_id: str) -> dict[str, Any]:
        """The constructor kwargs the run gave ``env_id`` (its config's ``env.kwargs``, or the
        mix entry's), read from the newest checkpoint's ``config.json``; {} when unknown."""
        checkpoints = self.path / "checkpoints"
        try:  # ``latest`` names the newest checkpoint folder, whose config.json is the run's
            latest = checkpoints / (self.read_text(checkpoints / "latest") or "").strip()
            env = json.loads(self.read_text(latest / "config.json") or "{}").get("env", {})
            kwargs = dict(env.get("kwargs") or {})
            entries = env.get("id") if isinstance(env.get("id"), list) else []
            for entry in entries:
                if isinstance(entry, dict) and entry.get("id") == env_id:
                    kwargs.update(entry.get("kwargs") or {})
        except (OSError, ValueError, AttributeError, TypeError):
            return {}
        return kwargs

    # ------------------------------------------------------------------ the store
    def parts(self) -> list[Path]:
        """The store's complete, readable parts (unreadable ones go to ``problems``)."""
        import pyarrow.parquet as pq

        folder = self.path / "trajectories"
        good = []
        listed = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
        with self._lock:
            for path in listed:
                if not PART.match(path.name):
                    continue
                try:
                    status = path.stat()
                except FileNotFoundError:
                    continue  # deleted since the listing (keep_last pruning)
                if not stat.S_ISREG(status.st_mode):
                    self.problem(f"{path.name}: not a regular file (left out)")
                    continue
                seen = self._checked.get(path)
                if seen is None or seen[:2] != (status.st_size, status.st_mtime_ns):
                    try:
                        pq.read_metadata(path)
                        ok = True
                    except FileNotFoundError:
                        continue
                    except Exception as error:  # noqa: BLE001 - any unreadable file is a problem
                        ok = False
                        self.problem(f"{path.name}: unreadable ({type(error).__name__}: {error})")
                    self._checked[path] = (status.st_size, status.st_mtime_ns, ok)
                if self._checked[path][2]:
                    good.append(path)
            for gone in set(self._checked) - set(listed):  # pruned parts: forget them
                del self._checked[gone]
                self._light.pop(gone, None)
        return good

    def _table(self, columns: Sequence[str], where: Any = None) -> Any:
        """``columns`` of the episodes matching ``where``, from the store or ``episodes.jsonl``.

        A part deleted between listing and reading (``keep_last`` pruning) is read around: the
        parts are listed again, up to three times."""
        import pyarrow as pa

        for attempt in range(3):
            parts = self.parts()
            if not parts:
                break
            try:
                return self._read_parts(parts, columns, where)
            except OSError:
                if attempt == 2 or all(p.exists() for p in parts):
                    raise
        jsonl = self._from_jsonl()
        if jsonl is None:
            return pa.Table.from_pylist([], schema=schema()).select(list(columns))
        return (jsonl.filter(where) if where is not None else jsonl).select(list(columns))

    def _read_parts(self, parts: list[Path], columns: Sequence[str], where: Any) -> Any:
        import pyarrow as pa
        import pyarrow.dataset as ds

        if tuple(columns) != LIGHT_COLUMNS:  # one episode's every column: read, not kept
            dataset = ds.dataset([str(p) for p in parts], format="parquet", schema=schema())
            return dataset.to_table(columns=list(columns), filter=where)
        table = pa.concat_tables([self._light_part(p) for p in parts])
        return table.filter(where) if where is not None else table

    def _light_part(self, path: Path) -> Any:
        """``LIGHT_COLUMNS`` of one part, read once per version of the file."""
        status = path.stat()
        version = (status.st_size, status.st_mtime_ns)
        with self._lock:
            kept = self._light.get(path)
        if kept is not None and kept[0] == version:
            return kept[1]
        table = read_light(path)
        with self._lock:
            self._light[path] = (version, table)
        return table

    def _from_jsonl(self) -> Any:
        """An ``envhub eval`` folder without a store: its ``episodes.jsonl`` as a table (a line
        that is no episode, or a value that is not what its column holds, is named)."""
        path = self.path / "episodes.jsonl"
        try:
            status = path.stat()
        except OSError:
            return None
        version = (status.st_size, status.st_mtime_ns)
        with self._lock:
            if self._jsonl is not None and self._jsonl[0] == version:
                return self._jsonl[1]
        text = self.read_text(path)
        if text is None:
            return None
        rows: list[dict[str, Any]] = []
        names: list[str] = []
        for number, line in enumerate(text.splitlines(), start=1):
            where = f"episodes.jsonl line {number}"
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line being written, or torn by a kill
            if not isinstance(record, dict):
                self.problem(f"{where}: not an object (left out)")
                continue
            try:
                rows.append(eval_record(record, number - 1))  # key envhub-eval:0:LINE-1
            except (ValueError, TypeError) as error:
                self.problem(f"{where}: {error} (left out)")
                continue
            names.append(where)
        table, problems = to_table(rows, names)
        for problem in problems:
            self.problem(problem)
        with self._lock:
            self._jsonl = (version, table)
        return table

    @property
    def kinds(self) -> list[str]:
        """The kinds of episodes stored (``train``, ``eval``, ``envhub-eval``)."""
        kinds = {m["kind"] for p in self.parts() if (m := PART.match(p.name))}
        if not kinds and (self.path / "episodes.jsonl").exists():
            kinds = {"envhub-eval"}
        return sorted(kinds)

    def episodes(
        self,
        *,
        kind: str | None = None,
        step: int | None = None,
        env_id: str | None = None,
        seed: int | None = None,
        success: bool | None = None,
        failed: bool | None = None,
        failure: str | None = None,
        min_return: float | None = None,
        max_return: float | None = None,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
        sort: str = "step",
        descending: bool = False,
        offset: int = 0,
        limit: int | None = 50,
    ) -> EpisodePage:
        """A page of the episodes that match every given filter, sorted by ``sort``.

        ``failure`` matches failure reasons containing that text."""
        import pyarrow.compute as pc
        import pyarrow.dataset as ds

        if sort not in SORTABLE:
            raise ValueError(f"cannot sort by {sort!r}; sortable: {', '.join(sorted(SORTABLE))}")
        where = None
        for name, value in (
            ("kind", kind),
            ("step", step),
            ("env_id", env_id),
            ("seed", seed),
            ("success", success),
            ("failed", failed),
        ):
            if value is not None:
                where = _and(where, ds.field(name) == value)
        ranges = (("return", min_return, max_return), ("tokens", min_tokens, max_tokens))
        for name, low, high in ranges:
            if low is not None:
                where = _and(where, ds.field(name) >= low)
            if high is not None:
                where = _and(where, ds.field(name) <= high)
        table = self._table(LIGHT_COLUMNS, where)
        if failure:
            reasons = pc.fill_null(table["failure"], "")
            table = table.filter(pc.match_substring(reasons, failure, ignore_case=True))
        total = table.num_rows
        order = "descending" if descending else "ascending"
        table = table.sort_by([(sort, order), ("step", "ascending"), ("index", "ascending")])
        page = table.slice(max(0, offset), limit if limit is not None else total)
        rows = page.to_pylist()
        for row in rows:
            row["key"] = episode_key(row["kind"], row["step"], row["index"])
            for name in ("return", "advantage"):
                if isinstance(row[name], float) and not math.isfinite(row[name]):
                    row[name] = None
        return EpisodePage(total, rows)

    def episode(self, key: str) -> dict[str, Any]:
        """Every column of the episode ``key`` (``kind:step:index``); KeyError if absent."""
        import pyarrow.dataset as ds

        try:
            kind, step, index = key.rsplit(":", 2)
            where = (
                (ds.field("kind") == kind)
                & (ds.field("step") == int(step))
                & (ds.field("index") == int(index))
            )
        except ValueError:
            raise KeyError(f"{key!r} is not an episode key (kind:step:index)") from None
        rows = self._table(COLUMNS, where).to_pylist()
        if not rows:
            raise KeyError(f"no episode {key!r} in {self.path}")
        row = rows[0]
        row["key"] = key
        row["messages"] = _json_or_text(row["messages"], [])
        row["info"] = _json_or_text(row["info"], {})
        return row

    def steps(self, kind: str = "train") -> list[int]:
        """The steps with stored episodes of ``kind``."""
        return sorted(
            int(m["step"]) for p in self.parts() if (m := PART.match(p.name)) and m["kind"] == kind
        )


def read_light(path: Path) -> Any:
    """One part's ``LIGHT_COLUMNS`` as a table of the store's types."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    full = schema()
    light = pa.schema([full.field(name) for name in LIGHT_COLUMNS])
    with pq.ParquetFile(path) as part:  # (cheaper than pq.read_table, which builds a dataset)
        if set(LIGHT_COLUMNS) <= set(part.schema_arrow.names):
            return part.read(columns=list(LIGHT_COLUMNS), use_threads=False).cast(light)
    return pq.read_table(path, columns=list(LIGHT_COLUMNS), schema=full)  # an older part


def _and(where: Any, clause: Any) -> Any:
    return clause if where is None else where & clause


def _json_or_text(text: str | None, empty: Any) -> Any:
    """A JSON column's value, or its text as stored when it is not JSON."""
    if not text:
        return empty
    try:
        return json.loads(text)
    except ValueError:
        return text


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def eval_record(record: dict[str, Any], index: int) -> dict[str, Any]:
    """An ``envhub eval`` episode (``EpisodeStats.as_record``) as a store row."""
    try:
        rewards = [float(r) for r in record.get("rewards") or []]
        episode_return = float(record.get("episode_return", sum(rewards)))
    except (TypeError, ValueError):
        raise ValueError(f"rewards {record.get('rewards')!r} are not numbers") from None
    failure = record.get("failure")
    return {
        "kind": "envhub-eval",
        "step": 0,
        "index": index,
        "env_id": record.get("env_id"),
        "seed": record.get("seed"),
        "sample": record.get("sample"),
        "agent": record.get("agent"),
        "success": bool(record.get("success")),
        "failed": failure is not None,
        "failure": failure if failure is None else f"{failure}: {record.get('detail') or ''}",
        "return": episode_return,
        "turns": record.get("turns", len(rewards)),
        "tokens": (record.get("tokens_in") or 0) + (record.get("tokens_out") or 0),
        "invalid_actions": record.get("invalid_actions"),
        "truncated": bool(record.get("truncated")),
        "time_s": record.get("seconds"),
        "turn_rewards": rewards,
        "messages": json.dumps(record.get("messages") or []),
        "info": json.dumps(record.get("info") or {}, default=repr),
    }


def open_run(path: str | Path) -> Run:
    """The run in ``path`` (``NotARunError`` naming what a run folder holds otherwise)."""
    folder = Path(path)
    if not folder.is_dir():
        raise NotARunError(f"{folder} is not a folder; pass a run folder (output_dir of a run)")
    markers = ("metrics.jsonl", "trajectories", "episodes.jsonl", "summary.json")
    if not any((folder / m).exists() for m in markers):
        raise NotARunError(
            f"{folder} is not a run: it has none of {', '.join(markers)} (an envhub train "
            "output_dir or an envhub eval --out folder)"
        )
    return Run(folder)
