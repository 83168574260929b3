"""Routing in the env workers: each worker routes its own episodes' turns to the engines; the
driver keeps groups, batches, staleness and the weight updates.

With ``EnvWorkers`` alone every turn passes through the driver: the worker sends its request,
the driver's ``EngineRouter`` sends it on, the answer comes back the same way (tens of
microseconds of the driver's CPU per turn; benchmarks/README.md, ``rollout_scale``). At
10,000 episodes over 64 engines that bounds the whole cluster by one core. Here, as verl's
agent-loop workers and SkyRL's do, each worker process holds an ``EngineRouter`` of its own
over all the engines (least loaded by its own count, sticky per episode), and the driver only
sees episodes start and end::

    driver                                         worker k (one of ``workers``)
    scheduler --play(spec, key)--> EnvWorkers ===> play_episode(EnvManager)
    WorkerRouters --pause / resume(version)--> ==> EngineRouter(engines(link)) ---> engines
                  <--paused(counters)---------  ==
    scheduler <---done(trajectory, counters)---  ==

``WorkerRouters`` is what the driver's scheduler holds in place of an ``EngineRouter`` (the
same ``version``, ``update_weights_live``, ``abort_episode``, ``take_stats``, ``in_flight``):

- ``update_weights_live(weights)`` sends ``pause`` to every worker (its router stops new
  requests, preempts what is in flight, and answers once its engines are idle), loads the
  weights once every worker answered, then sends ``resume`` with the new version: the
  preempted turns resume under it, as with one router;
- ``abort_episode(key)`` goes to the worker playing the episode;
- counters (requests, tokens, aborts, preemptions, busy time per engine) come with every
  finished episode and every ``paused``; ``take_stats`` adds the workers' up. An engine's
  busy time is the longest any one worker saw (workers cannot see each other's requests: a
  lower bound, exact with one worker).

A worker builds its engines with ``engines(link)``: a picklable callable run in the worker
process (``link``: the worker's ``WorkerLink``, for engines that talk back through the
driver). ``RelayEngines(count)`` builds engines that live in the *driver's* process, reached
over the worker's socket and served by a ``RelayHost``: the cluster simulation's engines must
share the driver's simulated clock (``benchmarks/rollout_scale.py --route-in-workers``), and
the relay's driver side is the engines' work there, kept off the driver's clock.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import contextvars
import functools
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainer.rollout.router import starter
from trainer.rollout.router_stats import COUNTS as _COUNTS
from trainer.rollout.router_stats import RouterStats
from trainer.rollout.wire import (
    request_from_wire,
    request_to_wire,
    result_from_wire,
    result_to_wire,
)
from trainer.strategies.base import GenerationRequest, GenerationResult, Weights
from trainer.weights.versioned import PolicyVersion, SharedVersion

if TYPE_CHECKING:
    from trainer.rollout.env_workers import EnvWorkers
    from trainer.rollout.router import EngineRouter, RolloutEngine

__all__ = [
    "EngineSetup",
    "RelayEngines",
    "RelayHost",
    "WorkerLink",
    "WorkerRouters",
    "counters_from_wire",
    "counters_to_wire",
]


class WorkerLink(Protocol):
    """What an env worker offers the engines it builds: a message to its driver
    (``("relay", payload)`` reaches the driver's ``RelayHost``), and the handler of the
    driver's relay payloads."""

    def send(self, message: tuple[Any, ...]) -> None: ...

    on_relay: Callable[[bytes], None] | None


EngineSetup = Callable[[WorkerLink], "Sequence[RolloutEngine]"]
"""Builds a worker's engines (picklable: it travels to each worker process)."""


def counters_to_wire(totals: RouterStats) -> tuple[Any, ...]:
    """A router's ``totals()`` as a tuple (what a worker reports)."""
    return (*(getattr(totals, name) for name in _COUNTS), totals.busy_s)


def counters_from_wire(wire: tuple[Any, ...]) -> RouterStats:
    *counts, busy = wire
    return RouterStats(busy_s=list(busy), **dict(zip(_COUNTS, counts, strict=True)))


@dataclass
class _Reports:
    """The latest counters of every worker as they came (read on demand; dead workers' last
    stay), and what ``take_stats`` had taken of them."""

    latest: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    taken: RouterStats | None = None


class WorkerRouters:
    """The driver's view of the routers in its env workers (see the module docstring).

    Hand it to ``EnvWorkers`` as its router and to the ``RolloutScheduler`` as its router."""

    version = SharedVersion()
    """The policy version new requests are issued under (``policy.value``)."""

    def __init__(
        self,
        engines: EngineSetup,
        num_engines: int,
        *,
        update: Callable[[Weights], None] | None = None,
        policy: PolicyVersion | None = None,
        relay: RelayHost | None = None,
        alongside: EngineRouter | None = None,
        clock: Callable[[], float] = time.monotonic,
        pause_timeout_s: float = 120.0,
    ) -> None:
        """``engines``: builds each worker's engines (``num_engines`` of them, the same in every
        worker). ``update(weights)``: loads weights into every engine (a run's weight sync
        passes a callable to ``update_weights_live`` instead). ``policy``: the run's version
        (None: owned here, advanced once per update). ``relay``: serves ``RelayEngines``.
        ``alongside``: a router of the driver's over the same engines (a run's evaluation
        episodes), paused and resumed with the workers'. ``pause_timeout_s``: how long a pause
        waits for each worker's answer; a worker that does not answer in time (its event loop
        is stuck, e.g. in an env call) is killed, its episodes fail, and the pause goes on."""
        if not pause_timeout_s > 0:
            raise ValueError(f"pause_timeout_s must be a positive number, got {pause_timeout_s!r}")
        self.pause_timeout_s = pause_timeout_s
        self.engines, self.num_engines = engines, num_engines
        self.alongside = alongside
        self._update = update
        self._owns_policy = policy is None
        self.policy = policy if policy is not None else PolicyVersion()
        self.relay = relay
        self._clock = clock
        self._workers: EnvWorkers | None = None
        self._paused = False
        self._acks: dict[int, asyncio.Future[None]] = {}
        """Worker (``uid``) -> its ``paused`` answer, while a pause waits for it."""
        self._reports = _Reports()
        self._in_flight: dict[int, int] = {}
        self._stats_since = clock()

    # ------------------------------------------------------------------ the scheduler's
    @property
    def paused(self) -> bool:
        """Between ``pause`` and ``resume`` (a worker started meanwhile starts paused)."""
        return self._paused

    async def update_weights_live(self, weights: Weights | Callable[[], Any]) -> float:
        """Pause every worker's router, load ``weights`` (or call it), resume under the new
        version; returns the seconds paused (``EngineRouter.update_weights_live``)."""
        started, alongside = self._clock(), self.alongside
        await asyncio.gather(self.pause(), *([alongside.pause()] if alongside else []))
        try:
            if callable(weights):
                await asyncio.to_thread(weights)
            elif self._update is not None:
                await asyncio.to_thread(self._update, weights)
            if self._owns_policy:
                self.policy.advance()
        finally:
            self.resume()
            if alongside is not None:
                alongside.resume()
        return self._clock() - started

    def update_weights(self, weights: Weights) -> None:
        """Load weights now and tell the workers the new version (callers make sure nothing is
        in flight: between two ``batch`` steps)."""
        if self._update is not None:
            self._update(weights)
        if self._owns_policy:
            self.policy.advance()
        self.resume()

    async def pause(self) -> None:
        """Every worker's router stops new requests and preempts its in-flight ones; returns
        once all of them are idle (a worker that dies meanwhile counts as idle, and one that
        does not answer within ``pause_timeout_s`` is killed)."""
        self._paused = True
        attached = self._attached()
        loop = asyncio.get_running_loop()
        for worker in attached.live():
            self._acks[worker] = loop.create_future()
            attached.send_to(worker, ("pause",))
        if not self._acks:
            return
        await asyncio.wait(list(self._acks.values()), timeout=self.pause_timeout_s)
        for worker, ack in list(self._acks.items()):
            if not ack.done():  # killing it answers for it (``on_lost``)
                attached.kill_worker(
                    worker,
                    f"it did not pause for a weight update within {self.pause_timeout_s:g} s (its "
                    "event loop is blocked, e.g. by an env call); raise rollout.pause_timeout_s, "
                    "or take slow env calls off the loop (rollout.env_timeout_s runs them in "
                    "threads, env.pool_workers in processes)",
                )
                self.on_paused(worker)
        await asyncio.gather(*self._acks.values())
        self._acks.clear()

    def resume(self) -> None:
        """Every worker's router goes on under ``version``: its held requests go out."""
        self._paused = False
        for worker in self._attached().live():
            self._attached().send_to(worker, ("resume", self.version))

    async def abort_episode(self, key: str) -> None:
        """Abort the episode's running request and refuse its later ones, in the worker that
        plays it (``key``: ``"{play key}a{attempt}"``, as the scheduler writes it)."""
        worker = self._attached().worker_of(key.rpartition("a")[0])
        if worker is not None:
            self._attached().send_to(worker, ("abort_episode", key))

    def take_stats(self) -> RouterStats:
        """The workers' counters since the previous call (as of their latest reports)."""
        now, total = self._clock(), self.totals()
        taken, self._reports.taken = self._reports.taken, total
        total.wall_s = now - self._stats_since
        self._stats_since = now
        if taken is None:
            return total
        for name in _COUNTS:
            setattr(total, name, getattr(total, name) - getattr(taken, name))
        total.busy_s = [a - b for a, b in zip(total.busy_s, taken.busy_s, strict=True)]
        return total

    def totals(self) -> RouterStats:
        """The workers' counters since they started, as of their latest reports."""
        total = RouterStats(busy_s=[0.0] * self.num_engines)
        for wire in self._reports.latest.values():
            report = counters_from_wire(wire)
            for name in _COUNTS:
                setattr(total, name, getattr(total, name) + getattr(report, name))
            total.busy_s = [max(a, b) for a, b in zip(total.busy_s, report.busy_s, strict=True)]
        return total

    @property
    def in_flight(self) -> int:
        """Requests in the workers' engines, as of their latest reports."""
        return sum(self._in_flight.values())

    async def close(self) -> None:
        """The workers' routers end with their processes (``EnvWorkers.close``)."""

    # ------------------------------------------------------------------ EnvWorkers'
    def attach(self, workers: EnvWorkers) -> None:
        if self._workers is not None and self._workers is not workers:
            raise ValueError("a WorkerRouters serves one EnvWorkers")
        self._workers = workers

    def init_message(self) -> tuple[Any, ...]:
        """What a starting worker builds its router from (its engines, the version, paused or
        not, and how long its pauses wait for a hung engine)."""
        return (self.engines, self.version, self._paused, self.pause_timeout_s)

    def on_report(self, worker: int, wire: tuple[Any, ...], in_flight: int) -> None:
        """A worker's counters (with a finished episode, or its ``paused``)."""
        self._reports.latest[worker] = wire
        self._in_flight[worker] = in_flight

    def on_paused(self, worker: int) -> None:
        ack = self._acks.get(worker)
        if ack is not None and not ack.done():
            ack.set_result(None)

    def on_lost(self, worker: int) -> None:
        """A worker died: it has nothing in flight any more (a pause does not wait for it)."""
        self._in_flight.pop(worker, None)
        self.on_paused(worker)
        if self.relay is not None:
            self.relay.forget_peer(worker)

    def _attached(self) -> EnvWorkers:
        if self._workers is None:
            raise RuntimeError("WorkerRouters is used before an EnvWorkers was built over it")
        return self._workers


# ---------------------------------------------------------------------- relayed engines
class RelayEngines:
    """``EngineSetup`` for engines hosted in the driver's process (a ``RelayHost``): ``count``
    engines, reached over the worker's socket."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self, link: WorkerLink) -> list[RelayEngine]:
        relay = _Relay(link)
        link.on_relay = relay.receive
        return [RelayEngine(relay, index) for index in range(self.count)]


class _Relay:
    """A worker's side of the relay: requests out (one payload per loop iteration), results
    in."""

    def __init__(self, link: WorkerLink) -> None:
        self.link = link
        self.waiting: dict[str, asyncio.Future[GenerationResult]] = {}
        self._out: list[tuple[Any, ...]] = []

    def call(self, message: tuple[Any, ...]) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self.flush)
        self._out.append(message)

    def flush(self) -> None:
        if self._out:
            out, self._out = self._out, []
            self.link.send(("relay", pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))

    def receive(self, payload: bytes) -> None:
        for message in pickle.loads(payload):  # ("result", ...) or ("failed", id, error)
            future = self.waiting.pop(message[1], None)
            if future is None or future.done():
                continue
            if message[0] == "result":
                future.set_result(result_from_wire(message))
            else:
                future.set_exception(RuntimeError(message[2]))


class RelayEngine:
    """One driver-hosted engine as a worker's router sees it (``RolloutEngine``); weight
    loads and state are the driver's business (``WorkerRouters``)."""

    def __init__(self, relay: _Relay, index: int) -> None:
        self._relay, self.index = relay, index

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._relay.waiting[request.request_id] = future
        self._relay.call((self.index, request_to_wire("generate", request, request.prompt_ids)))
        future.add_done_callback(functools.partial(self._given_up, request.request_id))
        return future

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.start_generate(request)

    async def abort(self, request_id: str) -> None:
        self._relay.call((self.index, ("abort", request_id)))

    def _given_up(self, request_id: str, future: asyncio.Future[GenerationResult]) -> None:
        if future.cancelled():
            self._relay.waiting.pop(request_id, None)
            self._relay.call((self.index, ("abort", request_id)))

    def update_weights(self, weights: Weights) -> None:
        raise RuntimeError("relayed engines load weights in the driver (WorkerRouters)")

    def sleep(self) -> None:
        """The hosted engine's business."""

    def wake_up(self) -> None:
        """The hosted engine's business."""

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """The hosted engine's business."""


class RelayHost:
    """The driver's side of ``RelayEngines``: runs the workers' requests on ``engines`` and
    sends each worker its results, one payload per loop iteration. A prompt reaches the hosted
    engine as one ``array.array("i")`` (a sequence of ints), made on arrival: the driver holds
    every prompt in flight, and a list would be one Python int per token for it to keep and
    one more container for its cyclic GC to scan (on a cluster, the engines' processes hold
    them).

    ``off_clock()``: a context in which the host's work runs (the cluster simulation keeps it
    off the driver's clock: ``VirtualClockLoop.uncharged``, the engines' processes' work on a
    cluster)."""

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        *,
        off_clock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.engines = list(engines)
        self._starts = [starter(e) for e in self.engines]
        self.off_clock = off_clock
        self._reply: Callable[[int, tuple[Any, ...]], None] | None = None
        self._running: dict[int, dict[str, tuple[int, asyncio.Future[GenerationResult]]]] = {}
        self._out: dict[int, list[tuple[str, asyncio.Future[GenerationResult]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Each request's future -> (peer, request id), answered through one bound method in
        # one context: a partial, a method and a context copy per request would be three more
        # objects in flight for the driver's cyclic GC to scan (it hosts the engines here).
        self._asked: dict[asyncio.Future[GenerationResult], tuple[int, str]] = {}
        self._on_answer = self._answered
        self._context = contextvars.copy_context()

    def connect(self, reply: Callable[[int, tuple[Any, ...]], None]) -> None:
        """``reply(peer, message)`` sends a message to a worker (``EnvWorkers``)."""
        self._reply = reply

    def receive(self, peer: int, payload: bytes) -> None:
        """A worker's requests and aborts."""
        with self.off_clock():
            running = self._running.setdefault(peer, {})
            for index, message in pickle.loads(payload):  # (engine, ("generate" | "abort", ...))
                if message[0] == "generate":
                    request = request_from_wire(message)
                    prompt = array.array("i", request.prompt_ids)  # (see the class docstring)
                    request.prompt_ids = prompt  # type: ignore[assignment]
                    future = self._starts[index](request)
                    running[request.request_id] = (index, future)
                    self._asked[future] = (peer, request.request_id)
                    future.add_done_callback(self._on_answer, context=self._context)
                else:
                    self._abort(index, message[1])

    def receive_all(self, peer: int, messages: list[tuple[Any, ...]]) -> None:
        """A worker's ``("relay", payload)`` messages."""
        with self.off_clock():
            for message in messages:
                self.receive(peer, message[1])

    def forget_peer(self, peer: int) -> None:
        """A worker is gone: abort what it had asked for."""
        with self.off_clock():
            for request_id, (index, future) in self._running.pop(peer, {}).items():
                if not future.done():
                    self._abort(index, request_id)
            self._out.pop(peer, None)

    def _abort(self, index: int, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_off_clock(index, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort_off_clock(self, index: int, request_id: str) -> None:
        with self.off_clock():
            await self.engines[index].abort(request_id)

    def _answered(self, future: asyncio.Future[GenerationResult]) -> None:
        asked = self._asked.pop(future, None)
        if asked is None:
            return
        peer, request_id = asked
        out = self._out.get(peer)
        if out is None:  # one payload per loop iteration and worker
            out = self._out[peer] = []
            asyncio.get_running_loop().call_soon(self._flush, peer)
        out.append((request_id, future))

    def _flush(self, peer: int) -> None:
        """The results that came in this loop iteration, to their worker in one payload."""
        out = self._out.pop(peer, None)
        running = self._running.get(peer)
        if not out or running is None or self._reply is None:
            return  # the worker is gone
        with self.off_clock():  # (everything here, freeing the results included)
            payload = self._payload(out, running)
            del out
            if payload is not None:
                self._reply(peer, ("relay", payload))
            del payload

    @staticmethod
    def _payload(
        out: list[tuple[str, asyncio.Future[GenerationResult]]],
        running: dict[str, tuple[int, asyncio.Future[GenerationResult]]],
    ) -> bytes | None:
        """The answers to the requests in ``out`` still running for their worker, pickled."""
        messages: list[tuple[Any, ...]] = []
        for request_id, future in out:
            if running.pop(request_id, None) is None:
                continue
            if future.cancelled():
                messages.append(("failed", request_id, "the engine gave the request up"))
            elif (error := future.exception()) is not None:
                messages.append(("failed", request_id, f"{type(error).__name__}: {error}"))
            else:
                messages.append(result_to_wire(future.result()))
        return pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL) if messages else None
