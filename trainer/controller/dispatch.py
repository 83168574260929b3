"""How a cluster call is spread over a role's workers and how their answers are combined.

A worker method declares its distribution with ``@register``::

    class ActorWorker(Worker):
        @register(Dispatch.DP_SPLIT, collect=Collect.MEAN)
        def train_step(self, batch: Batch) -> dict[str, float]: ...

        @register(Dispatch.ONE_TO_ALL)
        def load_weights(self, path: str) -> None: ...

Dispatch modes (what each rank receives):

- ``ONE_TO_ALL``: every rank is called with the same arguments (default collect: ``ALL``,
  the list of per-rank results).
- ``DP_SPLIT``: every :class:`~trainer.controller.batch.Batch` argument is cut into
  ``world_size`` equal contiguous parts, rank ``r`` gets part ``r``; other arguments are
  passed to all (default collect: ``CONCAT``, the parts glued back in rank order). A batch
  whose rows ``world_size`` does not divide is refused.
- ``DP_SPLIT_RAGGED``: like ``DP_SPLIT``, but a batch of any size is cut into near-equal
  parts (the first ``len % world_size`` ranks get one row more): a rollout whose failed
  episodes were dropped rarely has a multiple of the rank count. The sharded strategies pad
  a short rank with zero-weight micro-batches, so every rank still runs the same collectives.
- ``RANK_ZERO``: only rank 0 is called (default collect: ``FIRST``, its result). For work
  that needs every rank (a collective), use ``ONE_TO_ALL`` with ``collect=Collect.FIRST``.

Collect modes: ``ALL`` (list, one per rank), ``CONCAT`` (``Batch.concat`` or list
flattening), ``FIRST`` (rank 0's result), ``MEAN`` (per-key mean of dicts of numbers, for
metrics from data-parallel ranks), ``NONE`` (discard; returns None).

Everything here is plain Python: :class:`~trainer.controller.cluster.Cluster` uses these
functions for both its in-process and its Ray backend, and tests exercise them without Ray.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from trainer.controller.batch import Batch
from trainer.errors import DispatchError

__all__ = [
    "Collect",
    "Dispatch",
    "MethodSpec",
    "RankCall",
    "collect_results",
    "dispatch_call",
    "method_spec",
    "register",
    "registered_methods",
]

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__envhub_dispatch__"


class Dispatch(enum.Enum):
    """Which ranks a call reaches, with which arguments."""

    ONE_TO_ALL = "one_to_all"
    DP_SPLIT = "dp_split"
    DP_SPLIT_RAGGED = "dp_split_ragged"
    RANK_ZERO = "rank_zero"


class Collect(enum.Enum):
    """How the ranks' results become the call's result."""

    ALL = "all"
    CONCAT = "concat"
    FIRST = "first"
    MEAN = "mean"
    NONE = "none"


DEFAULT_COLLECT: dict[Dispatch, Collect] = {
    Dispatch.ONE_TO_ALL: Collect.ALL,
    Dispatch.DP_SPLIT: Collect.CONCAT,
    Dispatch.DP_SPLIT_RAGGED: Collect.CONCAT,
    Dispatch.RANK_ZERO: Collect.FIRST,
}


@dataclass(frozen=True)
class MethodSpec:
    """The recorded distribution of one worker method."""

    name: str
    dispatch: Dispatch
    collect: Collect


def register(
    dispatch: Dispatch = Dispatch.ONE_TO_ALL, collect: Collect | None = None
) -> Callable[[F], F]:
    """Mark a worker method as callable through a cluster, with its dispatch and collect modes.

    The function is returned unchanged (calling it directly on a worker still works); the
    modes are stored on it. An override in a subclass without ``@register`` inherits the
    base method's modes.
    """
    if not isinstance(dispatch, Dispatch):
        raise DispatchError(f"register(dispatch=...) takes a Dispatch member, not {dispatch!r}")
    if collect is not None and not isinstance(collect, Collect):
        raise DispatchError(f"register(collect=...) takes a Collect member, not {collect!r}")
    chosen = collect or DEFAULT_COLLECT[dispatch]

    def mark(fn: F) -> F:
        setattr(fn, _ATTR, MethodSpec(fn.__name__, dispatch, chosen))
        return fn

    return mark


def method_spec(worker_cls: type, name: str) -> MethodSpec:
    """The modes of ``worker_cls.name``, looked up through the class hierarchy."""
    for klass in worker_cls.__mro__:
        fn = klass.__dict__.get(name)
        spec = getattr(fn, _ATTR, None)
        if spec is not None:
            return spec
    if not callable(getattr(worker_cls, name, None)):
        raise DispatchError(f"{worker_cls.__name__} has no method {name!r}")
    raise DispatchError(
        f"{worker_cls.__name__}.{name} is not registered for cluster calls; "
        f"decorate it with @register(Dispatch...) in {worker_cls.__name__}"
    )


def registered_methods(worker_cls: type) -> dict[str, MethodSpec]:
    """Every registered method of ``worker_cls`` (including inherited ones)."""
    found: dict[str, MethodSpec] = {}
    for klass in reversed(worker_cls.__mro__):
        for name in klass.__dict__:
            spec = getattr(klass.__dict__[name], _ATTR, None)
            if spec is not None:  # an undecorated override keeps the base's modes
                found[name] = spec
    return found


@dataclass(frozen=True)
class RankCall:
    """One rank's share of a call."""

    rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def dispatch_call(
    spec: MethodSpec, world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[RankCall]:
    """Turn one cluster call into the per-rank calls to make."""
    if spec.dispatch is Dispatch.RANK_ZERO:
        return [RankCall(0, args, kwargs)]
    if spec.dispatch is Dispatch.ONE_TO_ALL:
        return [RankCall(rank, args, kwargs) for rank in range(world_size)]
    even = spec.dispatch is Dispatch.DP_SPLIT
    split_args = [a.split(world_size, even=even) if isinstance(a, Batch) else None for a in args]
    split_kwargs = {
        k: v.split(world_size, even=even) for k, v in kwargs.items() if isinstance(v, Batch)
    }
    if not any(s is not None for s in split_args) and not split_kwargs:
        raise DispatchError(
            f"{spec.name} is registered with Dispatch.{spec.dispatch.name} but got no Batch "
            "argument to split; pass a trainer.controller.Batch or register it with "
            "Dispatch.ONE_TO_ALL"
        )
    return [
        RankCall(
            rank,
            tuple(parts[rank] if parts is not None else a for a, parts in zip(args, split_args)),
            {k: split_kwargs[k][rank] if k in split_kwargs else v for k, v in kwargs.items()},
        )
        for rank in range(world_size)
    ]


def collect_results(spec: MethodSpec, results: list[Any]) -> Any:
    """Combine per-rank results (in rank order) as ``spec.collect`` says."""
    mode = spec.collect
    if mode is Collect.NONE:
        return None
    if mode is Collect.ALL:
        return list(results)
    if mode is Collect.FIRST:
        return results[0] if results else None
    if mode is Collect.CONCAT:
        if all(isinstance(r, Batch) for r in results):
            return Batch.concat(results)
        if all(isinstance(r, list) for r in results):
            return [item for r in results for item in r]
        kinds = sorted({type(r).__name__ for r in results})
        raise DispatchError(
            f"{spec.name}: Collect.CONCAT needs every rank to return a Batch or a list, got {kinds}"
        )
    return _mean(spec.name, results)


def _mean(name: str, results: list[Any]) -> dict[str, float]:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for rank, result in enumerate(results):
        if not isinstance(result, dict):
            raise DispatchError(
                f"{name}: Collect.MEAN needs dicts of numbers, rank {rank} returned "
                f"{type(result).__name__}"
            )
        for key, value in result.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise DispatchError(
                    f"{name}: Collect.MEAN cannot average {key!r}={value!r} from rank {rank}; "
                    "return numbers"
                ) from None
            sums[key] = sums.get(key, 0.0) + number
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
