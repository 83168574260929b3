"""Filtering and sorting the episode table (``Run.episodes``): Arrow expressions over the
store's small columns, built from the filters a user gives.

Two things a user would otherwise trip on are settled here once:

- **A filter value its column cannot hold is refused by name.** The whole-number columns are
  int64; a seed of 2**64 (many envs draw uint64 seeds) raises ``ValueError("seed=... is not a
  whole number in int64 range")`` instead of an ``OverflowError`` from Arrow.
- **NaN and infinity sort after every number, in both directions.** Sorting by return, best
  first, shows the best episode that has a return, not one whose return is +inf or NaN
  (a diverged reward); those come after the numbers, and null after them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["INT64_MAX", "INT64_MIN", "sort_table", "where", "whole"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The range of the store's whole-number columns (``step``, ``index``, ``seed``, ``tokens`` ...)."""

_EXACT = ("kind", "step", "env_id", "seed", "success", "failed", "agent")
"""Filters that match a column's value exactly (``Run.episodes``'s keyword of the same name)."""

_WHOLE = frozenset({"step", "seed", "min_tokens", "max_tokens"})
"""Filters on int64 columns: their values are checked by ``whole``."""


def whole(name: str, value: Any) -> int:
    """``value`` (an int, or its text) as an int64, else ``ValueError`` naming ``name``."""
    number = None
    if not isinstance(value, bool | float):  # (int(2.5) and int(True) would pass)
        try:
            number = int(value)
        except (TypeError, ValueError):
            pass
    if number is None or not INT64_MIN <= number <= INT64_MAX:
        raise ValueError(f"{name}={value!r} is not a whole number in int64 range")
    return number


def where(filters: dict[str, Any]) -> Any:
    """The Arrow filter expression of ``filters`` (``Run.episodes``'s keywords; None values are
    no filter), or None when nothing is filtered.

    ``env_contains`` matches env ids that contain its text (any case); ``min_``/``max_`` bound
    ``return`` and ``tokens`` (inclusive)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    given = {name: value for name, value in filters.items() if value is not None}
    for name in _WHOLE & set(given):
        given[name] = whole(name, given[name])
    clauses = [ds.field(name) == given[name] for name in _EXACT if name in given]
    for column, low, high in (
        ("return", "min_return", "max_return"),
        ("tokens", "min_tokens", "max_tokens"),
    ):
        if low in given:
            clauses.append(ds.field(column) >= given[low])
        if high in given:
            clauses.append(ds.field(column) <= given[high])
    if "env_contains" in given:
        clauses.append(
            pc.match_substring(ds.field("env_id"), str(given["env_contains"]), ignore_case=True)
        )
    expression = None
    for clause in clauses:
        expression = clause if expression is None else expression & clause
    return expression


def sort_table(table: Any, sort: str, descending: bool) -> Any:
    """``table`` sorted by ``sort`` (ties by step, then index); in a float column NaN and
    infinity come after every number and null last, whichever the direction."""
    import pyarrow as pa
    import pyarrow.compute as pc

    order = "descending" if descending else "ascending"
    keys = [(sort, order), ("step", "ascending"), ("index", "ascending")]
    if not pa.types.is_floating(table.schema.field(sort).type):
        return table.sort_by(keys)
    nonfinite = pc.invert(pc.is_finite(table[sort]))  # False for numbers, null for null
    marked = table.append_column("__nonfinite", nonfinite)
    return marked.sort_by([("__nonfinite", "ascending"), *keys]).drop_columns(["__nonfinite"])
