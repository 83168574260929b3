"""``cluster_method_problems``: does a role cluster's every method agree with its worker's?

``Cluster.__init_subclass__`` runs it when a role cluster class is defined, so a cluster whose
``remote(...)`` methods drift from the worker (a renamed method, another parameter list, a
missing ``per_rank=True``) is refused at import, not at the first call in a long run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainer.controller.cluster import RemoteMethod
from trainer.controller.dispatch import Collect, method_spec, registered_methods
from trainer.controller.worker import Worker
from trainer.errors import DispatchError

if TYPE_CHECKING:
    from trainer.controller.cluster import Cluster

__all__ = ["cluster_method_problems"]


def cluster_method_problems(cluster_cls: type[Cluster]) -> list[str]:
    """Every way ``cluster_cls`` disagrees with its ``worker_cls`` (empty: none).

    Each :func:`remote` method must name a registered worker method, declare ``per_rank``
    exactly when that method collects ``Collect.ALL``, and take the parameters the cluster's
    worker class gives the method (a subclass may override it). A hand-written public method
    named like a registered worker method must take the same parameters as well.
    """
    worker_cls = cluster_cls.worker_cls
    registered = registered_methods(worker_cls)
    problems: list[str] = []
    seen: set[str] = set()
    for klass in cluster_cls.__mro__:
        for name, attr in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            where = f"{cluster_cls.__name__}.{name}"
            if isinstance(attr, RemoteMethod):
                problems += _remote_problems(where, attr, worker_cls)
            elif inspect.isfunction(attr) and not name.startswith("_") and name in registered:
                problems += _parameter_problems(where, attr, getattr(worker_cls, name))
    return problems


def _remote_problems(
    where: str, attr: RemoteMethod[Any, Any], worker_cls: type[Worker]
) -> list[str]:
    try:
        spec = method_spec(worker_cls, attr.method)
    except DispatchError as error:
        return [f"{where}: {error}"]
    target = f"{worker_cls.__name__}.{attr.method}"
    if attr.per_rank and spec.collect is not Collect.ALL:
        return [
            (
                f"{where} is declared per_rank=True but {target} collects "
                f"Collect.{spec.collect.name} (one result, not a list per rank); drop per_rank=True"
            )
        ]
    if not attr.per_rank and spec.collect is Collect.ALL:
        return [
            (
                f"{where} returns a list, one result per rank ({target} collects Collect.ALL); "
                "declare it remote(..., per_rank=True)"
            )
        ]
    return _parameter_problems(where, attr.__wrapped__, getattr(worker_cls, attr.method))


def _parameter_problems(
    where: str, ours: Callable[..., Any], worker_method: Callable[..., Any]
) -> list[str]:
    mine = _parameters(ours)
    theirs = _parameters(worker_method)
    if mine == theirs:
        return []
    return [
        (
            f"{where} takes {inspect.Signature(mine)} but {worker_method.__qualname__} takes "
            f"{inspect.Signature(theirs)}; give both the same parameters"
        )
    ]


RAY_TRACE_PARAMETER = "_ray_trace_ctx"
"""What ``ray.remote(cls)`` adds to every method of an actor class, in place (Ray's tracing
hook): a worker class once made a Ray actor in this process carries it from then on."""


def _parameters(method: Callable[..., Any]) -> list[inspect.Parameter]:
    """A method's parameters without ``self`` and without Ray's tracing parameter."""
    parameters = list(inspect.signature(method).parameters.values())[1:]
    return [p for p in parameters if p.name != RAY_TRACE_PARAMETER]
