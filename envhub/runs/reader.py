"""Reading a run folder: metrics, the trajectory store, ``envhub eval`` results.

``envhub.runs.open(path)`` returns a ``Run``. It reads while the run writes: parts appear whole
(``store``'s atomic renames), a torn last metrics line is skipped, a part deleted while it is
read (``keep_last`` pruning) is read around, and what cannot be read is left out and named in
``Run.problems`` instead of failing the read: a truncated or corrupted part, an
``episodes.jsonl`` line that is no episode, and anything that is not a regular file (a FIFO or
a device under a run's file name would block a reader forever; it is never opened).

A part is checked twice: its footer when it is listed, its data when its columns are read
(``envhub.runs.parts``). A part whose footer is whole but whose data is not (bit rot, a copy cut
short, another tool's file with other column types) is left out and named when the read fails;
the other parts still read.

``Run.episodes`` filters, sorts and pages with Arrow over the small columns only
(``LIGHT_COLUMNS``, ``envhub.runs.query``), so a store of a million episodes is never loaded
whole; those columns are kept per part (keyed by its size and mtime), so a poll after a new step
reads only the new part. ``Run.episode`` reads one episode's tokens and messages from the one
part its key names (``kind:step:index`` -> ``trajectories/kind-step.parquet``), never listing the
store. ``Run.version`` changes whenever the set of parts or their files does (a poll compares
it; the total alone stays the same when ``keep_last`` adds one part and prunes one). A ``Run``
may be read from several threads at once (the viewer's requests).

An ``envhub eval --out`` folder written before the store existed (``episodes.jsonl`` only) is
read from its JSONL.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envhub.errors import EnvhubError
from envhub.runs.parts import UnreadablePartError, read_episode, read_light, reason
from envhub.runs.query import sort_table, where, whole
from envhub.runs.store import LIGHT_COLUMNS, PART, part_name, schema, to_table

__all__ = ["EpisodePage", "NotARunError", "Run", "find_runs", "open_run"]

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


def parse_key(key: str) -> tuple[str, int, int]:
    """``(kind, step, index)`` of an episode key; KeyError when ``key`` is none (a kind that
    cannot name a part, a step or index that is no int64)."""
    try:
        kind, step, index = key.rsplit(":", 2)
        part_name(kind, 0)
        return kind, whole("step", step), whole("index", index)
    except ValueError:
        raise KeyError(f"{key!r} is not an episode key (kind:step:index)") from None


@dataclass
class Run:
    """A run folder (see the module docstring); build with ``open_run``."""

    path: Path
    problems: list[str] = field(default_factory=list)
    """Parts, files or lines that could not be read (named, left out)."""
    _checked: dict[Path, tuple[int, int, bool]] = field(default_factory=dict, repr=False)
    _light: dict[Path, tuple[tuple[int, int], Any]] = field(default_factory=dict, repr=False)
    _jsonl: tuple[tuple[int, int], Any] | None = field(default=None, repr=False)
    _metrics: tuple[tuple[int, ...], list[dict[str, Any]]] | None = field(default=None, repr=False)
    _values: dict[str, tuple[str, list[Any]]] = field(default_factory=dict, repr=False)
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
        """``metrics.jsonl``'s rows (a line being written, or torn by a kill, is skipped).

        Parsed once per version of the file (its size and mtime): a page that polls every few
        seconds re-reads it only after the run wrote a row."""
        path = self.path / "metrics.jsonl"
        try:
            status = path.stat()
        except OSError:
            return []
        version = (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
        with self._lock:
            if self._metrics is not None and self._metrics[0] == version:
                return list(self._metrics[1])
        text = self.read_text(path)
        rows = []
        for line in (text or "").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        with self._lock:
            self._metrics = (version, rows)
        return list(rows)

    def metrics_file(self) -> str | None:
        """Which ``metrics.jsonl`` the run has (its device and inode), or None: a resumed run
        rewrites the file under a new one, so a reader that kept rows knows to read it all."""
        try:
            status = (self.path / "metrics.jsonl").stat()
        except OSError:
            return None
        return f"{status.st_dev}:{status.st_ino}"

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

    def version(self) -> str:
        """A short hash of the store's parts (name, size, mtime) and ``episodes.jsonl``: it
        changes whenever an episode may have been added, replaced or pruned (a poll compares
        it; the total alone misses a ``keep_last`` step that adds one part and prunes one)."""
        folder = self.path / "trajectories"
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            names = []
        entries = []
        files = [folder / n for n in names if PART.match(n)] + [self.path / "episodes.jsonl"]
        for path in files:
            try:
                status = path.stat()
            except OSError:
                continue  # pruned since the listing, or no such file
            entries.append((path.name, status.st_size, status.st_mtime_ns))
        return hashlib.sha1(repr(entries).encode()).hexdigest()[:16]

    def values(self, column: str, *, version: str | None = None) -> list[Any]:
        """The distinct values of one of the table's columns over the whole run, sorted (what
        a filter can choose from: env ids, agents); kept until the store changes. ``version``:
        the run's ``version()`` when the caller has it (saves listing the store again)."""
        import pyarrow.compute as pc

        if column not in LIGHT_COLUMNS:
            raise ValueError(f"no column {column!r}; the table has {', '.join(LIGHT_COLUMNS)}")
        version = version or self.version()
        with self._lock:
            kept = self._values.get(column)
        if kept is not None and kept[0] == version:
            return list(kept[1])
        found = sorted(pc.unique(self._light_table()[column]).drop_null().to_pylist())
        with self._lock:
            self._values[column] = (version, found)
        return list(found)

    def _light_table(self) -> Any:
        """``LIGHT_COLUMNS`` of every episode, from the store or ``episodes.jsonl``.

        A part pruned since the listing (``keep_last``) is read around; one whose data cannot
        be read is left out and named. With no part read, an ``envhub eval`` folder's
        ``episodes.jsonl`` is the table."""
        import pyarrow as pa

        tables = []
        for path in self.parts():
            try:
                tables.append(self._light_part(path))
            except FileNotFoundError:
                continue  # pruned between the listing and the read
            except Exception as error:  # noqa: BLE001 - any unreadable part is a problem
                self._unreadable(path, error)
        if tables:
            return pa.concat_tables(tables)
        jsonl = self._from_jsonl()
        if jsonl is None:
            return pa.Table.from_pylist([], schema=schema()).select(list(LIGHT_COLUMNS))
        return jsonl.select(list(LIGHT_COLUMNS))

    def _unreadable(self, path: Path, error: BaseException) -> None:
        """Name ``path`` as unreadable and leave it out until its file changes."""
        self.problem(f"{path.name}: unreadable ({reason(error)})")
        with self._lock:
            try:
                status = path.stat()
                self._checked[path] = (status.st_size, status.st_mtime_ns, False)
            except OSError:
                self._checked.pop(path, None)
            self._light.pop(path, None)

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
        env_contains: str | None = None,
        seed: int | None = None,
        agent: str | None = None,
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

        ``env_contains`` matches env ids that contain its text and ``failure`` failure reasons
        that do (any case); ``env_id`` and the rest match exactly. NaN and infinity sort after
        every number in either direction, null last (``envhub.runs.query``); rows hold them as
        they are stored. ``ValueError`` names a filter whose value its column cannot hold."""
        import pyarrow.compute as pc

        if sort not in SORTABLE:
            raise ValueError(f"cannot sort by {sort!r}; sortable: {', '.join(sorted(SORTABLE))}")
        expression = where(
            {
                "kind": kind,
                "step": step,
                "env_id": env_id,
                "env_contains": env_contains,
                "seed": seed,
                "agent": agent,
                "success": success,
                "failed": failed,
                "min_return": min_return,
                "max_return": max_return,
                "min_tokens": min_tokens,
                "max_tokens": max_tokens,
            }
        )
        table = self._light_table()
        if expression is not None:
            table = table.filter(expression)
        if failure:
            reasons = pc.fill_null(table["failure"], "")
            table = table.filter(pc.match_substring(reasons, failure, ignore_case=True))
        total = table.num_rows
        table = sort_table(table, sort, descending)
        rows = table.slice(max(0, offset), limit if limit is not None else total).to_pylist()
        for row in rows:
            row["key"] = episode_key(row["kind"], row["step"], row["index"])
        return EpisodePage(total, rows)

    def episode(self, key: str) -> dict[str, Any]:
        """Every column of the episode ``key`` (``kind:step:index``), read from the one part
        the key names (an ``envhub eval`` folder without it: from ``episodes.jsonl``).

        KeyError when there is no such episode, or its part cannot be read (the reason, also
        named in ``problems``)."""
        kind, step, index = parse_key(key)
        row, unreadable = None, None
        try:
            row = self._episode_from_part(kind, step, index)
        except UnreadablePartError as error:
            unreadable = str(error)
        if row is None and kind == "envhub-eval" and step == 0:
            row = self._episode_from_jsonl(index)
        if row is None:
            if unreadable is not None:
                raise KeyError(f"{key}: {unreadable}")
            raise KeyError(f"no episode {key!r} in {self.path}")
        row["key"] = key
        row["messages"] = _json_or_text(row["messages"], [])
        row["info"] = _json_or_text(row["info"], {})
        return row

    def _episode_from_part(self, kind: str, step: int, index: int) -> dict[str, Any] | None:
        """The episode's row from ``trajectories/kind-step.parquet``; None when the part or
        the row is not there; ``UnreadablePartError`` (also named in ``problems``) when the
        part cannot be read."""
        path = self.path / "trajectories" / part_name(kind, step)
        try:
            return read_episode(path, kind, step, index)
        except FileNotFoundError:
            return None  # no such part, or pruned by keep_last
        except UnreadablePartError as error:
            self.problem(f"{error.name}: unreadable ({error.why})")
            raise

    def _episode_from_jsonl(self, index: int) -> dict[str, Any] | None:
        import pyarrow.dataset as ds

        jsonl = self._from_jsonl()
        if jsonl is None:
            return None
        rows = jsonl.filter(ds.field("index") == index).to_pylist()
        return rows[0] if rows else None

    def steps(self, kind: str = "train") -> list[int]:
        """The steps with stored episodes of ``kind``."""
        return sorted(
            int(m["step"]) for p in self.parts() if (m := PART.match(p.name)) and m["kind"] == kind
        )


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


_MARKERS = ("metrics.jsonl", "trajectories", "episodes.jsonl", "summary.json")
"""What a run folder holds (any of them)."""


def _not_a_run(folder: Path) -> str:
    return (
        f"{folder} is not a run: it has none of {', '.join(_MARKERS)} (an envhub train "
        "output_dir or an envhub eval --out folder)"
    )


def open_run(path: str | Path) -> Run:
    """The run in ``path`` (``NotARunError`` naming what a run folder holds otherwise)."""
    folder = Path(path)
    if not folder.is_dir():
        raise NotARunError(f"{folder} is not a folder; pass a run folder (output_dir of a run)")
    if not any((folder / m).exists() for m in _MARKERS):
        raise NotARunError(_not_a_run(folder))
    return Run(folder)


def find_runs(path: str | Path) -> list[Path]:
    """``[path]`` when it is a run, else the runs in its sub-folders (sorted by name; a
    sub-folder that is no run, notes or logs beside the runs, is skipped): ``envhub view
    runs/`` shows every run under ``runs/``. ``NotARunError`` when there is none."""
    folder = Path(path)
    try:
        open_run(folder)
        return [folder]
    except NotARunError:
        if not folder.is_dir():
            raise
    runs = sorted(
        child
        for child in folder.iterdir()
        if child.is_dir() and any((child / m).exists() for m in _MARKERS)
    )
    if not runs:
        raise NotARunError(_not_a_run(folder) + ", and no folder in it is a run")
    return runs
