"""``EngineRouter``: one ``InferenceEngine`` in front of several, for the rollout scheduler.

What it adds to the engines behind it (each a :class:`RolloutEngine`: an ``HFEngine``, a
``VLLMEngine``, or the driver's ``RankEngine`` for one rank of the ``actor_infer`` cluster):

Routing
    A new episode goes to the engine with the fewest requests in flight (least-loaded);
    its later turns go to the same engine (sticky), so the engine's prefix cache already
    holds the conversation. The episode is read from the request id, which env managers
    write as ``"{episode_key}/{turn}"`` (everything before the last ``/``).
    An engine whose request was given up on (cancelled: ``rollout.generate_timeout_s``) gets
    no new episodes while others answer, until it returns a result again.
Abort
    ``abort(request_id)`` goes to the engine that holds the request (a real engine abort:
    the slot is freed); the caller's ``generate`` returns ``finish_reason="abort"``.
Preemption (partial rollouts)
    ``update_weights_live(weights)`` closes the gate for new requests, aborts every
    in-flight generation, waits until the engines are idle, loads the weights, reopens the
    gate, and each preempted generation *resumes* under the new weights with the tokens it
    already had (prompt + partial tokens, remaining budget). The result carries
    ``extra["token_versions"]``: the weight version of every generated token, read from the
    router's ``policy`` (a ``PolicyVersion``) when each part was issued, so it is right
    whatever the engines report.
Accounting
    Busy time per engine (time with at least one request in flight), requests, tokens,
    aborts and preemptions; ``take_stats()`` returns them since the last call.

Weight updates reach the engines through ``update``: by default each engine's own
``update_weights``; the pipeline passes one call that updates every cluster rank at once.

The version: a router made without ``policy`` owns one and advances it once per update
through it. A training run hands it the run's ``WeightSync.policy`` instead: the sync is the
one writer, and the router, its engines and the scheduler read the same object.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainer.strategies.base import FinishReason, GenerationRequest, GenerationResult, Weights
from trainer.weights.versioned import PolicyVersion, SharedVersion

__all__ = ["EngineRouter", "RolloutEngine", "RouterStats", "episode_key"]

_STICKY_CAPACITY = 1 << 20
"""Episodes remembered for sticky routing (oldest forgotten first). Episodes are forgotten when
they end, so this only bounds a caller that never calls ``forget``; it must exceed the episodes
in play at once (50k at cluster scale, more with redundancy and staleness)."""


def episode_key(request_id: str) -> str:
    """The episode a request belongs to: the id up to its last ``/`` (the whole id without one)."""
    head, sep, _ = request_id.rpartition("/")
    return head if sep else request_id


class RolloutEngine(Protocol):
    """What the rollout path calls on an engine: ``InferenceEngine``
    (``trainer.strategies.base``) without ``generate_batch``, which only a worker rank serves.

    The router needs this of every engine behind it and is one itself, to the env managers.
    A full engine (``HFEngine``, ``VLLMEngine``) fits, and so does a driver-side front that
    only queues requests for a worker rank (``trainer.workers.infer.RankEngine``).
    """

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def abort(self, request_id: str) -> None: ...

    def update_weights(self, weights: Weights) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


@dataclass
class RouterStats:
    """Counters since the last ``take_stats`` (busy seconds per engine, wall seconds)."""

    wall_s: float = 0.0
    busy_s: list[float] = field(default_factory=list)
    requests: int = 0
    new_tokens: int = 0
    aborted: int = 0
    preempted: int = 0
    errors: int = 0

    @property
    def busy_fraction(self) -> float:
        """Mean over engines of the share of wall time with at least one request in flight."""
        if not self.busy_s or self.wall_s <= 0:
            return 0.0
        return min(1.0, sum(self.busy_s) / (len(self.busy_s) * self.wall_s))


@dataclass
class _Flight:
    """One ``generate`` call: where its current part runs and what happened to it."""

    engine: int
    sub_id: str
    cancelled: bool = False
    preempted: bool = False
    submitted: bool = False


def _resumed(request: GenerationRequest, part: int, ids: list[int]) -> GenerationRequest:
    """Part ``part`` of a preempted ``request``: its prompt plus the ``ids`` generated so far,
    with the rest of its token budget."""
    return GenerationRequest(
        f"{request.request_id}.{part}",
        request.prompt_ids + ids,
        request.max_new_tokens - len(ids),
        request.temperature,
        request.top_p,
        request.stop_token_ids,
    )


class EngineRouter:
    """Routes, aborts and preempts requests over ``engines`` (see the module docstring)."""

    version = SharedVersion()
    """The policy version new requests are issued under (``policy.value``)."""

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        *,
        update: Callable[[Weights], None] | None = None,
        policy: PolicyVersion | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: what busy time is measured with (a simulation passes its loop's
        ``time``: ``trainer.rollout.sim_clock``)."""
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self._update = update
        self._owns_policy = policy is None
        self.policy = policy if policy is not None else PolicyVersion()
        self._load = [0] * len(self.engines)
        self._in_flight = 0
        self._silent = [False] * len(self.engines)
        """Engines whose last request was given up on without an answer (hung, maybe)."""
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._episode_flights: dict[str, set[str]] = {}
        """Episode key -> ids of its requests in ``_flights`` (an episode's abort is a lookup)."""
        self._cancelled: set[str] = set()
        self._gate: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._paused = False
        self._stats = RouterStats(busy_s=[0.0] * len(self.engines))
        self._clock = clock
        self._busy_since: list[float | None] = [None] * len(self.engines)
        self._stats_since = clock()
        self._total = RouterStats(busy_s=[0.0] * len(self.engines))

    # ------------------------------------------------------------------ RolloutEngine
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate on the episode's engine; resumes across weight updates (module docstring)."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason: FinishReason = "length"
        flight = self._flights.setdefault(request.request_id, _Flight(-1, request.request_id))
        key = episode_key(request.request_id)
        self._episode_flights.setdefault(key, set()).add(request.request_id)
        try:
            for part in itertools.count():
                if self._gate is None or not self._gate.is_set():
                    await self._wait_open()
                if flight.cancelled or key in self._cancelled:
                    reason = "abort"
                    break
                sub = request if part == 0 else _resumed(request, part, ids)
                flight.engine, flight.sub_id, flight.preempted = (
                    self._route(request.request_id),
                    sub.request_id,
                    False,
                )
                # weights change only while the gate is closed and nothing is in flight
                issued = self.version
                self._enter(flight)
                try:
                    result = await self.engines[flight.engine].generate(sub)
                except asyncio.CancelledError:
                    # given up on (rollout.generate_timeout_s): new episodes avoid the engine
                    # until it answers again
                    self._silent[flight.engine] = True
                    raise
                except Exception:
                    self._stats.errors += 1
                    raise
                finally:
                    self._leave(flight)
                self._silent[flight.engine] = False
                if part == 0:  # the engine's own lists: nothing to join (the common case)
                    ids, logprobs = result.token_ids, result.logprobs
                else:
                    ids, logprobs = ids + result.token_ids, logprobs + result.logprobs
                versions += [issued] * len(result.token_ids)
                self._stats.new_tokens += len(result.token_ids)
                reason = result.finish_reason
                if reason != "abort" or flight.cancelled or not flight.preempted:
                    break
                self._stats.preempted += 1
                if len(ids) >= request.max_new_tokens:
                    reason = "length"
                    break
        finally:
            self._flights.pop(request.request_id, None)
            in_flight = self._episode_flights.get(key)
            if in_flight is not None:
                in_flight.discard(request.request_id)
                if not in_flight:
                    del self._episode_flights[key]
        self._stats.requests += 1
        if reason == "abort":
            self._stats.aborted += 1
        return GenerationResult(
            request.request_id,
            ids,
            logprobs,
            reason,
            versions[-1] if versions else self.version,
            {"token_versions": versions},
        )

    async def abort(self, request_id: str) -> None:
        """Abort in the engine that holds the request; unknown or finished ids are ignored."""
        flight = self._flights.get(request_id)
        if flight is None:
            return
        flight.cancelled = True
        if flight.submitted:
            await self.engines[flight.engine].abort(flight.sub_id)

    async def abort_episode(self, key: str) -> None:
        """Abort the episode's running request and refuse its later ones (until ``forget``)."""
        self._cancelled.add(key)
        running = self._episode_flights.get(key)
        if running:
            await asyncio.gather(*(self.abort(r) for r in list(running)))

    def forget(self, key: str) -> None:
        """The episode ended: drop its sticky engine and its cancelled mark."""
        self._cancelled.discard(key)
        self._sticky.pop(key, None)

    def update_weights(self, weights: Weights) -> None:
        """Load weights into every engine now (callers make sure nothing is in flight)."""
        if self._update is not None:
            self._update(weights)
        else:
            materialised = dict(weights)  # a mapping or (name, tensor) pairs, read once
            for engine in self.engines:
                engine.update_weights(materialised)
        self._advance()

    async def update_weights_live(self, weights: Weights | Callable[[], Any]) -> float:
        """Pause, preempt in-flight generations, load ``weights``, resume; returns seconds paused.

        ``weights`` may instead be a callable that loads every engine itself once they are idle
        (run in a thread); either way the version goes up by one (advanced by the router when
        it owns ``policy``, by the loader - the run's weight sync - when the policy is shared)."""
        started = self._clock()
        await self.pause()
        try:
            if callable(weights):  # the caller loads the engines (the pipeline's weight sync)
                await asyncio.to_thread(weights)
                self._advance()
            else:
                await asyncio.to_thread(self.update_weights, weights)
        finally:
            self.resume()
        return self._clock() - started

    async def pause(self) -> None:
        """Stop new requests, abort in-flight ones for resumption, wait until every engine is
        idle."""
        gate, idle = self._ensure_events()
        self._paused = True
        gate.clear()
        preempted = [f for f in self._flights.values() if not f.cancelled and f.submitted]
        for flight in preempted:
            flight.preempted = True
        # all at once: an engine takes the whole set between two of its steps (one by one, each
        # abort would wait for a step of its own)
        await asyncio.gather(*(self.engines[f.engine].abort(f.sub_id) for f in preempted))
        await idle.wait()

    def resume(self) -> None:
        """Reopen the gate closed by ``pause``."""
        self._paused = False
        if self._gate is not None:
            self._gate.set()

    def sleep(self) -> None:
        for engine in self.engines:
            engine.sleep()

    def wake_up(self) -> None:
        for engine in self.engines:
            engine.wake_up()

    def get_state(self) -> dict[str, Any]:
        return {"engines": [e.get_state() for e in self.engines], "version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore the engines' states, and the version when the router owns it (a shared
        version is restored by its owner)."""
        for engine, engine_state in zip(self.engines, state["engines"], strict=True):
            engine.set_state(engine_state)
        if self._owns_policy:
            self.policy.restore(int(state.get("version", self.version)))

    def _advance(self) -> None:
        """One update went through the router: count it, unless the policy's owner (the sync)
        does."""
        if self._owns_policy:
            self.policy.advance()

    async def close(self) -> None:
        for engine in self.engines:
            close = getattr(engine, "close", None)
            if close is not None:
                await close()

    # ------------------------------------------------------------------ introspection
    @property
    def in_flight(self) -> int:
        """Requests submitted to an engine and not answered yet."""
        return self._in_flight

    @property
    def loads(self) -> list[int]:
        """In-flight requests per engine."""
        return list(self._load)

    def engine_of(self, key: str) -> int | None:
        """The engine an episode is pinned to (None before its first request)."""
        return self._sticky.get(key)

    def take_stats(self) -> RouterStats:
        """Counters since the previous call (busy time of running requests is split at now)."""
        now = self._clock()
        stats = self._stats
        for i, since in enumerate(self._busy_since):
            if since is not None:
                stats.busy_s[i] += now - since
                self._busy_since[i] = now
        stats.wall_s = now - self._stats_since
        self._stats, self._stats_since = RouterStats(busy_s=[0.0] * len(self.engines)), now
        total = self._total
        total.wall_s += stats.wall_s
        total.busy_s = [a + b for a, b in zip(total.busy_s, stats.busy_s, strict=True)]
        for name in ("requests", "new_tokens", "aborted", "preempted", "errors"):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        return stats

    def totals(self) -> RouterStats:
        """Counters since the router was made (or ``reset_totals``), up to now; does not
        disturb ``take_stats`` intervals (the scheduler's per-batch metrics)."""
        now, total, current = self._clock(), self._total, self._stats
        busy = [
            t + c + (now - since if since is not None else 0.0)
            for t, c, since in zip(total.busy_s, current.busy_s, self._busy_since, strict=True)
        ]
        counts = {
            name: getattr(total, name) + getattr(current, name)
            for name in ("requests", "new_tokens", "aborted", "preempted", "errors")
        }
        return RouterStats(wall_s=total.wall_s + now - self._stats_since, busy_s=busy, **counts)

    def reset_totals(self) -> None:
        """Start ``totals`` afresh (from now)."""
        self.take_stats()
        self._total = RouterStats(busy_s=[0.0] * len(self.engines))

    # ------------------------------------------------------------------ internals
    def _ensure_events(self) -> tuple[asyncio.Event, asyncio.Event]:
        """The gate and idle events, created on first use inside the running loop."""
        if self._gate is None or self._idle is None:
            self._gate, self._idle = asyncio.Event(), asyncio.Event()
            if not self._paused:
                self._gate.set()
            if self.in_flight == 0:
                self._idle.set()
        return self._gate, self._idle

    async def _wait_open(self) -> None:
        gate, _ = self._ensure_events()
        await gate.wait()

    def _route(self, request_id: str) -> int:
        key = episode_key(request_id)
        index = self._sticky.get(key)
        if index is None:
            load = self._load
            if any(self._silent):  # rare: engines that answered first
                index = min(range(len(load)), key=lambda i: (self._silent[i], load[i], i))
            else:  # the least loaded, the first of equals (one C pass: a new episode each time)
                index = load.index(min(load))
            self._sticky[key] = index
            if len(self._sticky) > _STICKY_CAPACITY:
                self._sticky.popitem(last=False)
        else:
            self._sticky.move_to_end(key)
        return index

    def _enter(self, flight: _Flight) -> None:
        index, flight.submitted = flight.engine, True
        if self._load[index] == 0:
            self._busy_since[index] = self._clock()
        self._load[index] += 1
        self._in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def _leave(self, flight: _Flight) -> None:
        index, flight.submitted = flight.engine, False
        self._load[index] -= 1
        self._in_flight -= 1
        since = self._busy_since[index]
        if self._load[index] == 0 and since is not None:
            self._stats.busy_s[index] += self._clock() - since
            self._busy_since[index] = None
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()
