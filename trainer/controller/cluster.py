"""``Cluster``: the driver's handle on all workers of one role, in-process or as Ray actors.

A cluster creates ``world_size`` workers of one class and forwards calls to them as the
method's ``@register`` modes say (see :mod:`trainer.controller.dispatch`). A role's cluster
*derives* its methods from the worker's with :func:`remote`, so the signature, docstring and
return type are the worker method's, and readers, IDEs and mypy follow every call::

    class ActorCluster(Cluster):
        worker_cls = ActorWorker

        train_step = remote(ActorWorker.train_step)  # (batch, epochs=1) -> dict[str, float]
        train_step_async = remote(ActorWorker.train_step, future=True)  # -> CallFuture[dict]
        residency = remote(ActorWorker.residency, per_rank=True)  # Collect.ALL: list per rank

``remote(...)`` blocks until every reached rank answered and returns the collected result;
``future=True`` returns a :class:`CallFuture` at once (``.result(timeout)``, ``.done()``, or
``await`` it). ``per_rank=True`` says the method collects ``Collect.ALL`` (a list, one item per
rank); building the class checks that against the worker's declaration, and that every cluster
method named like a worker method takes the worker method's parameters. Write a method by hand only
where it does more than forward (merging per-rank results, routing to one rank), and say why. Calls
to one worker run in submission order on both backends; different workers run concurrently.

Backends:

- ``local``: workers are objects in this process, each with its own single thread (so the
  ordering and concurrency match Ray's). No Ray needed: unit tests and small CPU runs.
- ``ray``: each worker is a named Ray actor placed by a
  :class:`~trainer.controller.resources.ResourceManager` into the placement-group bundle of
  its first device (``ENVHUB_DEVICES``: its node-local device ids; on GPU clusters
  ``CUDA_VISIBLE_DEVICES`` lists the GPUs of all its devices). Ray is imported only here, only
  when this backend is used.

A worker that raises surfaces as :class:`~trainer.errors.WorkerCallError` naming the role, rank
and method, with the worker's exception chained.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import logging
import re
import time
import types
from collections.abc import Callable, Generator, Mapping
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Concatenate,
    Generic,
    Literal,
    ParamSpec,
    Self,
    TypeVar,
    overload,
)

from trainer.controller.dispatch import (
    MethodSpec,
    collect_results,
    dispatch_call,
    method_spec,
)
from trainer.controller.rank_thread import RankThread
from trainer.controller.worker import Worker, WorkerContext
from trainer.devices import AutoDeviceMapping, RolePlacement, WorkerSlot
from trainer.errors import DispatchError, WorkerCallError

if TYPE_CHECKING:
    from trainer.controller.resources import ResourceManager

__all__ = ["Backend", "CallFuture", "Cluster", "RemoteMethod", "remote"]

_log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")
Backend = Literal["local", "ray"]


class CallFuture(Generic[T]):
    """The pending result of one cluster call: ``.result()``, ``.done()``, or ``await`` it."""

    def __init__(
        self, cluster: Cluster, spec: MethodSpec, ranks: list[int], handles: list[Any]
    ) -> None:
        self._cluster = cluster
        self._spec = spec
        self._ranks = ranks
        self._handles = handles
        self._value: Any = None
        self._resolved = False

    def done(self) -> bool:
        """True when every reached rank has answered (or failed)."""
        return self._resolved or self._cluster._backend_done(self._handles)

    def result(self, timeout: float | None = None) -> T:
        """Wait at most ``timeout`` seconds (else ``TimeoutError``); return the collected result."""
        if not self._resolved:
            results = self._cluster._backend_wait(
                self._spec.name, self._ranks, self._handles, timeout
            )
            self._value = collect_results(self._spec, results)
            self._resolved = True
        return self._value

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait_async().__await__()

    async def _wait_async(self) -> T:
        if not self._resolved:
            results = await self._cluster._backend_wait_async(
                self._spec.name, self._ranks, self._handles
            )
            self._value = collect_results(self._spec, results)
            self._resolved = True
        return self._value


class RemoteMethod(Generic[P, T]):
    """A cluster method derived from a worker method; build it with :func:`remote`.

    Read from a cluster, it is a bound method taking the worker method's parameters ``P`` and
    returning ``T``. Read from the class, it is this object: ``inspect.signature`` gives the
    worker method's parameters with the derived return type, ``__doc__`` the worker's docstring.
    """

    def __init__(self, fn: Callable[..., Any], *, per_rank: bool, future: bool) -> None:
        self.method: str = fn.__name__
        """The worker method it calls (the cluster attribute may be named otherwise, e.g.
        ``score_async``)."""
        self.per_rank = per_rank
        self.future = future
        self.__wrapped__ = fn
        self.__name__ = self.__qualname__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.__signature__ = _derived_signature(fn, per_rank=per_rank, future=future)

    def __set_name__(self, owner: type, name: str) -> None:
        self.__name__, self.__qualname__ = name, f"{owner.__qualname__}.{name}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> RemoteMethod[P, T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Callable[P, T]: ...

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, cluster: Cluster, /, *args: Any, **kwargs: Any) -> Any:
        call = cluster._call_async(self.method, *args, **kwargs)
        return call if self.future else call.result()

    def __repr__(self) -> str:
        return f"<remote {self.__qualname__} -> {self.__wrapped__.__qualname__}>"


@overload
def remote(
    fn: Callable[Concatenate[Any, P], R],
    *,
    per_rank: Literal[False] = False,
    future: Literal[False] = False,
) -> RemoteMethod[P, R]: ...


@overload
def remote(
    fn: Callable[Concatenate[Any, P], R], *, per_rank: Literal[True], future: Literal[False] = False
) -> RemoteMethod[P, list[R]]: ...


@overload
def remote(
    fn: Callable[Concatenate[Any, P], R], *, per_rank: Literal[False] = False, future: Literal[True]
) -> RemoteMethod[P, CallFuture[R]]: ...


@overload
def remote(
    fn: Callable[Concatenate[Any, P], R], *, per_rank: Literal[True], future: Literal[True]
) -> RemoteMethod[P, CallFuture[list[R]]]: ...


def remote(
    fn: Callable[..., Any], *, per_rank: bool = False, future: bool = False
) -> RemoteMethod[Any, Any]:
    """A cluster method that calls worker method ``fn`` as its ``@register`` modes say.

    ``train_step = remote(ActorWorker.train_step)`` in a cluster class gives
    ``cluster.train_step(batch, epochs=1) -> dict[str, float]``: the worker's parameters and
    docstring, and its return type, which is the collected result for ``Collect.FIRST``,
    ``CONCAT``, ``MEAN`` and ``NONE``. ``per_rank=True`` declares ``Collect.ALL``: the call returns
    a list, one result per rank. ``future=True`` returns a :class:`CallFuture` of that at once.
    The cluster class is checked against its ``worker_cls`` when it is built
    (:func:`~trainer.controller.method_checks.cluster_method_problems`).
    """
    return RemoteMethod(fn, per_rank=per_rank, future=future)


def _derived_signature(
    fn: Callable[..., Any], *, per_rank: bool, future: bool
) -> inspect.Signature:
    """``fn``'s signature, its return type wrapped in ``list[...]`` / ``CallFuture[...]`` as
    declared."""
    signature = inspect.signature(fn)
    returns = signature.return_annotation
    if returns is inspect.Signature.empty:
        return signature
    text = returns if isinstance(returns, str) else inspect.formatannotation(returns)
    text = f"list[{text}]" if per_rank else text
    return signature.replace(return_annotation=f"CallFuture[{text}]" if future else text)


class Cluster:
    """All workers of one role. Subclass per role; derive its methods with :func:`remote`.

    ``config`` is handed to every worker (and read for ``device_mapping`` when no placement
    is given). ``placement`` (a :class:`~trainer.devices.RolePlacement`) or ``resources``
    (a bound :class:`~trainer.controller.resources.ResourceManager`, required by the Ray
    backend for roles with devices) decide the workers and their devices; without either,
    the role's own ``config.device_mapping`` is used, or ``world_size`` device-less workers.
    ``env_vars`` are set in Ray workers' environment (e.g. ``OMP_NUM_THREADS``);
    ``extra`` reaches every worker as ``ctx.extra``.
    """

    worker_cls: type[Worker] = Worker
    """The worker class this cluster builds; role subclasses set it, and the ``worker_cls``
    argument overrides it for one cluster (so it is not a ``ClassVar``)."""
    ray_concurrency_groups: ClassVar[dict[str, int]] = {}
    """Ray backend: extra concurrency groups of each worker actor (name -> threads). Calls in
    the default group run one at a time in order; a method in another group runs alongside
    them (e.g. an abort while a generation is in flight). The local backend has no groups:
    a role that needs this calls the worker object directly (see ``InferCluster.abort_on``)."""
    ray_method_groups: ClassVar[dict[str, str]] = {}
    """Method name -> the concurrency group (of ``ray_concurrency_groups``) its calls run in."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a role cluster whose methods disagree with its worker
        (:func:`~trainer.controller.method_checks.cluster_method_problems`)."""
        from trainer.controller.method_checks import cluster_method_problems

        super().__init_subclass__(**kwargs)
        problems = cluster_method_problems(cls)
        if problems:
            raise DispatchError(
                f"{cls.__name__} does not match its worker_cls {cls.worker_cls.__name__}:\n  "
                + "\n  ".join(problems)
            )

    def __init__(
        self,
        role: str,
        config: Any = None,
        *,
        worker_cls: type[Worker] | None = None,
        backend: Backend = "local",
        placement: RolePlacement | None = None,
        resources: ResourceManager | None = None,
        world_size: int | None = None,
        worker_kwargs: Mapping[str, Any] | None = None,
        env_vars: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if backend not in ("local", "ray"):
            raise DispatchError(f"unknown cluster backend {backend!r}; use 'local' or 'ray'")
        self.role = role
        self.config = config
        self.backend: Backend = backend
        if worker_cls is not None:
            self.worker_cls = worker_cls
        self.resources = resources
        self.slots = self._resolve_slots(role, config, placement, resources, world_size)
        self._env_vars = dict(env_vars or {})
        self._closed = False
        self.actor_names: list[str] = []  # Ray: each rank's actor (InferCluster.worker_engines)
        contexts = self._contexts(dict(extra or {}))
        kwargs = dict(worker_kwargs or {})
        if backend == "local":
            self._workers: list[Any] = [self.worker_cls(ctx, config, **kwargs) for ctx in contexts]
            self._threads = [RankThread(f"{role}-{r}") for r in range(len(contexts))]
        else:
            self._workers = self._spawn_ray(contexts, config, kwargs)
            if self.world_size > 1:
                address, port = self._rendezvous_address()
                self._set_distributed_env(address, port)

    # -- public -------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return len(self.slots)

    offload = remote(Worker.offload)
    reload = remote(Worker.reload)
    node_info = remote(Worker.node_info, per_rank=True)
    _rendezvous_address = remote(Worker._rendezvous_address)
    _set_distributed_env = remote(Worker._set_distributed_env)

    shutdown_calls: ClassVar[tuple[str, ...]] = ()
    """Methods every rank runs before the workers stop (``ActorCluster``: free shared memory)."""
    shutdown_timeout_s: float = 10.0
    """How long shutdown waits for a rank to answer a ``shutdown_calls`` method, or (local) to end
    the call it is running, before it gives the rank up (and, on Ray, kills it)."""

    def shutdown(self) -> None:
        """Stop the workers (kill the Ray actors / end the local threads). Safe to call twice.

        Bounded, so that a failure or a Ctrl-C always ends the run: a rank stuck in a call (a
        collective whose peer died, a reward function that never returns) does not take the
        ``shutdown_calls`` queued behind it; it is given up after ``shutdown_timeout_s`` with a
        warning naming what it was running."""
        if self._closed:
            return
        for method in self.shutdown_calls:
            try:
                self._call_async(method).result(timeout=self.shutdown_timeout_s)
            except WorkerCallError:
                pass  # a worker that died or failed here has nothing left to free
            except TimeoutError:
                _log.warning(
                    "%s: not every rank answered %s() within %s s; stopping them anyway",
                    self.role,
                    method,
                    self.shutdown_timeout_s,
                )
        self._closed = True
        if self.backend == "local":
            self._stop_local()
        else:
            import ray

            for handle in self._workers:
                try:
                    ray.kill(handle)
                except ray.exceptions.RayError:
                    pass  # the actor is gone already, or Ray was shut down: nothing to stop

    def _stop_local(self) -> None:
        """End each rank's thread (waiting ``shutdown_timeout_s`` in all), then close the idle
        workers; a rank still running is named and left to its daemon thread. A ``close`` that
        fails (an engine already dead) is logged naming the rank, and the other ranks still close:
        shutdown runs on the error path, where raising would leak them and hide the run's error."""
        deadline = time.monotonic() + self.shutdown_timeout_s
        for rank, (worker, thread) in enumerate(zip(self._workers, self._threads, strict=True)):
            running = thread.close(max(0.0, deadline - time.monotonic()))
            if running is not None:
                _log.warning(
                    "%s worker rank %d is still running %s(); exiting anyway",
                    self.role,
                    rank,
                    running,
                )
                continue
            close = getattr(worker, "close", None)  # engines with threads and memory
            if not callable(close):
                continue
            try:
                close()
            except Exception:  # noqa: BLE001 - the other ranks still close
                _log.exception("%s worker rank %d failed to close", self.role, rank)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(role={self.role!r}, world_size={self.world_size}, "
            f"backend={self.backend!r})"
        )

    # -- calls (what remote() methods and hand-written ones use) ---------------------------

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the workers as registered; block; return the collected result.
        Role clusters declare :func:`remote` methods instead; this is for hand-written ones."""
        return self._call_async(method, *args, **kwargs).result()

    def _call_async(self, method: str, *args: Any, **kwargs: Any) -> CallFuture[Any]:
        """Like :meth:`_call` but return a :class:`CallFuture` immediately."""
        if self._closed:
            raise DispatchError(f"{self!r} is shut down; create a new cluster")
        spec = method_spec(self.worker_cls, method)
        calls = dispatch_call(spec, self.world_size, args, kwargs)
        handles = [self._submit(call.rank, method, call.args, call.kwargs) for call in calls]
        return CallFuture(self, spec, [call.rank for call in calls], handles)

    # -- placement ----------------------------------------------------------------------

    @staticmethod
    def _resolve_slots(
        role: str,
        config: Any,
        placement: RolePlacement | None,
        resources: ResourceManager | None,
        world_size: int | None,
    ) -> list[WorkerSlot]:
        if resources is not None:
            if role not in resources.plan.roles:
                raise DispatchError(
                    f"the resource manager has no placement for role {role!r}; "
                    f"it knows {sorted(resources.plan.roles)}"
                )
            return list(resources.plan.roles[role].workers)
        if placement is not None:
            return list(placement.workers)
        if config is not None and hasattr(config, "device_mapping") and world_size is None:
            return list(AutoDeviceMapping({role: config}).plan().roles[role].workers)
        return [WorkerSlot(role, rank, ()) for rank in range(world_size or 1)]

    def _contexts(self, extra: dict[str, Any]) -> list[WorkerContext]:
        contexts: list[WorkerContext] = []
        seen_on_node: dict[int | None, int] = {}
        for slot in self.slots:
            local_rank = seen_on_node.get(slot.node, 0)
            seen_on_node[slot.node] = local_rank + 1
            contexts.append(
                WorkerContext(
                    role=self.role,
                    rank=slot.rank,
                    world_size=len(self.slots),
                    devices=slot.devices,
                    local_devices=slot.local_devices,
                    node=slot.node,
                    gpu_ids=None if self.resources is None else self.resources.gpu_ids(slot),
                    local_rank=local_rank,
                    backend=self.backend,
                    extra=extra,
                )
            )
        return contexts

    def _spawn_ray(
        self, contexts: list[WorkerContext], config: Any, kwargs: dict[str, Any]
    ) -> list[Any]:
        import ray

        if self.ray_concurrency_groups:
            groups = dict(self.ray_concurrency_groups)
            # ray.remote takes concurrency_groups for actor classes (Ray's "concurrency groups"
            # guide), but its typed overloads leave the option out
            decorate = ray.remote(concurrency_groups=groups)  # type: ignore[call-overload]
            remote_cls = decorate(self.worker_cls)
        else:
            remote_cls = ray.remote(self.worker_cls)
        handles = []
        for slot, ctx in zip(self.slots, contexts):
            if slot.devices and self.resources is None:
                raise DispatchError(
                    f"role {self.role!r} maps devices {list(slot.devices)}, so the ray backend "
                    "needs resources=ResourceManager(...) to place it; or give the role an empty "
                    "device_mapping"
                )
            options: dict[str, Any] = (
                self.resources.actor_options(slot)
                if self.resources is not None
                else {"num_cpus": 0}
            )
            if self._env_vars:  # a runtime env of its own costs a fresh worker process
                options["runtime_env"] = {"env_vars": dict(self._env_vars)}
            options["name"] = name = f"{self.role}-{ctx.rank}-{time.time_ns():x}"
            self.actor_names.append(name)
            handles.append(remote_cls.options(**options).remote(ctx, config, **kwargs))
        return handles

    # -- backend plumbing (used by CallFuture) -------------------------------------------

    def _submit(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.backend == "local":
            bound: Callable[..., Any] = getattr(self._workers[rank], method)
            return self._threads[rank].submit(bound, *args, **kwargs)
        remote = getattr(self._workers[rank], method)
        group = self.ray_method_groups.get(method)
        if group is not None:
            remote = remote.options(concurrency_group=group)
        return remote.remote(*args, **kwargs)

    def _backend_done(self, handles: list[Any]) -> bool:
        if self.backend == "local":
            return all(h.done() for h in handles)
        import ray

        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        return len(ready) == len(handles)

    def _fail(self, method: str, rank: int, err: BaseException) -> WorkerCallError:
        cause = getattr(err, "cause", None) or err  # RayTaskError wraps the worker's exception
        text = f"{type(cause).__name__}: {cause}"
        if getattr(cause, "actor_init_failed", False):  # Ray's text: the whole remote traceback
            text = f"it failed while starting: {_last_line(str(cause))}"
        error = WorkerCallError(self.role, rank, method, text)
        error.__cause__ = cause
        return error

    def _backend_wait(
        self, method: str, ranks: list[int], handles: list[Any], timeout: float | None
    ) -> list[Any]:
        """Results in rank order; the first failure (in completion order) raises at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rank_of = {id(h): r for h, r in zip(handles, ranks)}
        if self.backend == "local":
            results = self._wait_local(method, rank_of, handles, deadline, timeout)
        else:
            results = self._wait_ray(method, rank_of, handles, deadline, timeout)
        return [results[r] for r in ranks]

    def _wait_local(
        self,
        method: str,
        rank_of: dict[int, int],
        futures: list[cf.Future[Any]],
        deadline: float | None,
        timeout: float | None,
    ) -> dict[int, Any]:
        results: dict[int, Any] = {}
        pending = list(futures)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, not_done = cf.wait(pending, timeout=left, return_when=cf.FIRST_EXCEPTION)
            for future in done:
                failure = future.exception()
                if failure is not None:
                    raise self._fail(method, rank_of[id(future)], failure)
                results[rank_of[id(future)]] = future.result()
            if not_done and not done:
                raise TimeoutError(f"{self.role}.{method} did not finish within {timeout} s")
            pending = list(not_done)
        return results

    def _wait_ray(
        self,
        method: str,
        rank_of: dict[int, int],
        refs: list[Any],
        deadline: float | None,
        timeout: float | None,
    ) -> dict[int, Any]:
        import ray

        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(f"{self.role}.{method} did not finish within {timeout} s")
            for ref in ready:
                try:
                    results[rank_of[id(ref)]] = ray.get(ref)
                except ray.exceptions.RayError as err:
                    raise self._fail(method, rank_of[id(ref)], err)
        return results

    async def _backend_wait_async(
        self, method: str, ranks: list[int], handles: list[Any]
    ) -> list[Any]:
        async def one_local(rank: int, handle: cf.Future[Any]) -> Any:
            future = asyncio.wrap_future(handle)
            await asyncio.wait([future])  # a failure is read below, as _wait_local does
            failure = future.exception()
            if failure is not None:
                raise self._fail(method, rank, failure)
            return future.result()

        async def one_ray(rank: int, ref: Any) -> Any:
            import ray

            try:
                return await ref
            except ray.exceptions.RayError as err:
                raise self._fail(method, rank, err)

        one = one_local if self.backend == "local" else one_ray
        return list(await asyncio.gather(*(one(r, h) for r, h in zip(ranks, handles))))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _last_line(text: str) -> str:
    """The last non-empty line of ``text`` without terminal colours: the exception's own line at
    the end of a formatted traceback (what the worker raised, e.g. ``ValueError: ...``)."""
    lines = [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()]
    return lines[-1] if lines else text
