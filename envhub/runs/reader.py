"""Reading a run folder: metrics, the trajectory store, ``envhub eval`` results.

``envhub.runs.open(path)`` returns a ``Run``. It reads while the run writes: parts appear whole
(``store``'s atomic renames), a torn last metrics line is skipped, and a part that cannot be
read (truncated, corrupted) is left out and named in ``Run.problems`` instead of failing the
read. ``Run.episodes`` filters, sorts and pages with Arrow over the small columns only
(``LIGHT_COLUMNS``), so a store of a million episodes is never loaded whole; ``Run.episode``
reads one episode's tokens and messages.

An ``envhub eval --out`` folder written before the store existed (``episodes.jsonl`` only) is
read from its JSONL.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envhub.errors import EnvhubError
from envhub.runs.store import COLUMNS, LIGHT_COLUMNS, PART, schema

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
    """Parts or lines that could not be read (named, left out)."""
    _checked: dict[Path, tuple[int, int, bool]] = field(default_factory=dict, repr=False)
    _jsonl: tuple[float, Any] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> list[dict[str, Any]]:
        """``metrics.jsonl``'s rows (a line being written, or torn by a kill, is skipped)."""
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def summary(self) -> list[dict[str, Any]]:
        """An ``envhub eval`` run's ``summary.json`` rows (empty for a training run)."""
        path = self.path / "summary.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return []
        return data if isinstance(data, list) else []

    def env_kwargs(self, env_id: str) -> dict[str, Any]:
        """The constructor kwargs the run gave ``env_id`` (its config's ``env.kwargs``, or the
        mix entry's), read from the newest checkpoint's ``config.json``; {} when unknown."""
        checkpoints = self.path / "checkpoints"
        try:  # ``latest`` names the newest checkpoint folder, whose config.json is the run's
            latest = checkpoints / (checkpoints / "latest").read_text().strip()
            env = json.loads((latest / "config.json").read_text()).get("env", {})
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
        for path in sorted(folder.glob("*.parquet")) if folder.is_dir() else []:
            if not PART.match(path.name):
                continue
            stat = path.stat()
            seen = self._checked.get(path)
            if seen is None or seen[:2] != (stat.st_size, stat.st_mtime_ns):
                try:
                    pq.read_metadata(path)
                    ok = True
                except Exception as error:  # noqa: BLE001 - any unreadable file is a problem
                    ok = False
                    problem = f"{path.name}: unreadable ({type(error).__name__}: {error})"
                    if problem not in self.problems:
                        self.problems.append(problem)
                self._checked[path] = (stat.st_size, stat.st_mtime_ns, ok)
            if self._checked[path][2]:
                good.append(path)
        return good

    def _table(self, columns: Sequence[str], where: Any = None) -> Any:
        import pyarrow as pa
        import pyarrow.dataset as ds

        parts = self.parts()
        if parts:
            dataset = ds.dataset([str(p) for p in parts], format="parquet", schema=schema())
            return dataset.to_table(columns=list(columns), filter=where)
        jsonl = self._from_jsonl()
        if jsonl is None:
            return pa.Table.from_pylist([], schema=schema()).select(list(columns))
        return (jsonl.filter(where) if where is not None else jsonl).select(list(columns))

    def _from_jsonl(self) -> Any:
        """An ``envhub eval`` folder without a store: its ``episodes.jsonl`` as a table."""
        import pyarrow as pa

        path = self.path / "episodes.jsonl"
        if not path.exists():
            return None
        mtime = path.stat().st_mtime
        if self._jsonl is not None and self._jsonl[0] == mtime:
            return self._jsonl[1]
        rows = []
        for i, line in enumerate(path.read_text(errors="replace").splitlines()):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            rows.append(eval_record(record, i))
        table = pa.Table.from_pylist(rows, schema=schema())
        self._jsonl = (mtime, table)
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
        row["messages"] = json.loads(row["messages"] or "[]")
        row["info"] = json.loads(row["info"] or "{}")
        return row

    def steps(self, kind: str = "train") -> list[int]:
        """The steps with stored episodes of ``kind``."""
        return sorted(
            int(m["step"]) for p in self.parts() if (m := PART.match(p.name)) and m["kind"] == kind
        )


def _and(where: Any, clause: Any) -> Any:
    return clause if where is None else where & clause


def eval_record(record: dict[str, Any], index: int) -> dict[str, Any]:
    """An ``envhub eval`` episode (``EpisodeStats.as_record``) as a store row."""
    rewards = [float(r) for r in record.get("rewards") or []]
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
        "return": float(record.get("episode_return", sum(rewards))),
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
