"""``Batch``: the unit of data a cluster call splits across data-parallel ranks.

A batch is a set of named *columns* with one row per sample (torch tensors and numpy
arrays split along their first dimension; Python lists split by item) plus ``meta``, a dict
that is not split (the step number, a temperature, ...). ``split(n)`` cuts the rows into
``n`` contiguous chunks and ``Batch.concat`` glues chunks back in order, so
``Batch.concat(b.split(n))`` equals ``b``. Torch is imported only when a torch column is
concatenated, so this module stays light enough for the Ray-free controller core.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from trainer.errors import DispatchError

__all__ = ["Batch"]


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "shape")


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "shape")


def _rows(value: Any) -> int:
    if _is_torch(value) or _is_numpy(value):
        if len(value.shape) == 0:
            raise DispatchError(
                "a batch column cannot be a 0-d tensor/array; put scalars in Batch.meta"
            )
        return int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    raise DispatchError(
        "a batch column must be a torch tensor, a numpy array or a list, not "
        f"{type(value).__name__}; put other values in Batch.meta"
    )


class Batch:
    """Named columns of equal length (rows are samples) plus unsplit ``meta``.

    >>> b = Batch({"ids": [1, 2, 3, 4], "reward": [0.0, 1.0, 1.0, 0.0]}, meta={"step": 3})
    >>> [len(part) for part in b.split(2)]
    [2, 2]
    """

    __slots__ = ("columns", "meta")

    def __init__(
        self, columns: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None
    ) -> None:
        self.columns: dict[str, Any] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        for key, value in (columns or {}).items():
            self[key] = value

    # -- mapping-like access -------------------------------------------------------------

    def __len__(self) -> int:
        """Number of rows (0 for a batch without columns)."""
        for value in self.columns.values():
            return _rows(value)
        return 0

    def __getitem__(self, key: str) -> Any:
        try:
            return self.columns[key]
        except KeyError:
            raise KeyError(
                f"batch has no column {key!r}; columns: {sorted(self.columns)}"
            ) from None

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, tuple):
            value = list(value)
        rows = _rows(value)
        if (
            self.columns
            and rows != len(self)
            and not (len(self.columns) == 1 and key in self.columns)
        ):
            raise DispatchError(
                f"column {key!r} has {rows} rows but the batch has {len(self)}; columns must align"
            )
        self.columns[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.columns

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def keys(self) -> list[str]:
        return list(self.columns)

    def get(self, key: str, default: Any = None) -> Any:
        """The column ``key``, or ``default`` when the batch has none (like ``dict.get``)."""
        return self.columns.get(key, default)

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}:{_describe(v)}" for k, v in self.columns.items())
        return f"Batch(rows={len(self)}, columns=[{cols}], meta={sorted(self.meta)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch) or self.keys() != other.keys() or self.meta != other.meta:
            return False
        for key in self.columns:
            a, b = self.columns[key], other.columns[key]
            if _is_torch(a) or _is_numpy(a):
                if (
                    type(a) is not type(b)
                    or tuple(a.shape) != tuple(b.shape)
                    or not bool((a == b).all())
                ):
                    return False
            elif a != b:
                return False
        return True

    # -- row operations --------------------------------------------------------------------

    def select(self, *keys: str) -> Batch:
        """A batch with only ``keys`` (same rows, same meta)."""
        return Batch({k: self[k] for k in keys}, self.meta)

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` of every column."""
        return Batch({k: v[start:stop] for k, v in self.columns.items()}, self.meta)

    def split(self, n: int, *, even: bool = True) -> list[Batch]:
        """``n`` contiguous chunks in order. ``even=True`` requires ``n`` to divide the rows;
        otherwise the first ``len % n`` chunks get one row more."""
        if n <= 0:
            raise DispatchError(f"cannot split a batch into {n} parts; n must be >= 1")
        rows = len(self)
        if even and rows % n:
            raise DispatchError(
                f"a batch of {rows} rows does not split evenly over {n} ranks; "
                f"make the batch a multiple of {n} (or call split(n, even=False))"
            )
        base, extra = divmod(rows, n)
        parts, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            parts.append(self.slice(start, stop))
            start = stop
        return parts

    def take(self, rows: Sequence[int]) -> Batch:
        """The rows at ``rows``, in that order (tensors, arrays and lists alike)."""
        return Batch({k: _take(v, rows) for k, v in self.columns.items()}, self.meta)

    def balanced(self, n: int, weights: Sequence[float]) -> Batch:
        """The same rows reordered so that ``split(n, even=False)`` gives each part about the same
        total ``weights`` (e.g. tokens per row): heaviest row first, each to the lightest part
        that still has room for the rows ``split`` gives it. For calls whose result does not
        depend on row order (a train step's metrics)."""
        counts = [len(part) for part in self.split(n, even=False)]
        load = [0.0] * n
        members: list[list[int]] = [[] for _ in range(n)]
        for row in sorted(range(len(self)), key=lambda r: (-weights[r], r)):
            part = min(
                (p for p in range(n) if len(members[p]) < counts[p]), key=lambda p: (load[p], p)
            )
            members[part].append(row)
            load[part] += weights[row]
        return self.take([row for part in members for row in sorted(part)])

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Rows of ``batches`` in order; columns must match; meta is the first batch's."""
        if not batches:
            return cls()
        keys = batches[0].keys()
        for i, b in enumerate(batches[1:], 1):
            if b.keys() != keys:
                raise DispatchError(
                    f"cannot concat batches with different columns: {keys} vs {b.keys()} (part {i})"
                )
        return cls({k: _cat([b.columns[k] for b in batches]) for k in keys}, batches[0].meta)

    def to_dict(self) -> dict[str, Any]:
        """The columns as a plain dict (meta dropped)."""
        return dict(self.columns)


def _take(value: Any, rows: Sequence[int]) -> Any:
    if _is_torch(value):
        import torch

        return value[torch.as_tensor(list(rows), dtype=torch.long)]
    if _is_numpy(value):
        return value[list(rows)]
    return [value[r] for r in rows]


def _cat(values: list[Any]) -> Any:
    first = values[0]
    if _is_torch(first):
        import torch

        return torch.cat(values, dim=0)
    if _is_numpy(first):
        import numpy as np

        return np.concatenate(values, axis=0)
    return [item for value in values for item in value]


def _describe(value: Any) -> str:
    if _is_torch(value) or _is_numpy(value):
        return f"{type(value).__name__}{tuple(value.shape)}"
    return f"list[{len(value)}]"
