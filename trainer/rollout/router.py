"""``EngineRouter``: one ``InferenceEngine`` in front of several, for the rollout scheduler.

What it adds to the engines behind it (each a :class:`RolloutEngine`: an ``HFEngine``, a
``VLLMEngine``, or the driver's ``RankEngine`` for one rank of the ``actor_infer`` cluster):

Routing
    A new episode goes to the engine with the fewest requests in flight (least-loaded);
    its later turns go to the same engine (sticky), so the engine's prefix cache already
    holds the conversation. The episode is read from the request id, which env managers
    write as ``"{episode_key}/{turn}"`` (everything before the last ``/``).
    An engine whose request was given up on (cancelled: ``rollout.generate_timeout_s``, or a
    weight update's pause that ran out) gets no new episodes while others answer, until it
    returns a result again. So does an engine whose last ``_FAILING_AFTER`` requests raised (a
    dead vLLM: its requests end at once, so it would always be the least loaded). Either gets
    a trial episode every ``_PROBE_EVERY`` new ones: a result clears it (a transient fault or
    a stall does not retire it). All avoided: least-loaded.
Abort
    ``abort(request_id)`` goes to the engine that holds the request (a real engine abort:
    the slot is freed); the caller's ``generate`` returns ``finish_reason="abort"``.
    ``abort_episode(key)`` refuses the episode's later requests until ``forget`` of any
    attempt of its play (attempt keys ``"{play}a{n}"``: the scheduler marks them all).
Preemption (partial rollouts)
    ``update_weights_live(weights)`` closes the gate for new requests, aborts every
    in-flight generation, waits until the engines are idle, loads the weights, reopens the
    gate, and each preempted generation *resumes* under the new weights with the tokens it
    already had (prompt + partial tokens, remaining budget: ``trainer.rollout.preempted``). An
    engine still not idle after ``pause_timeout_s`` is hung (it ignores aborts): its requests
    fail (their episodes are replayed elsewhere), it gets no new episodes while others answer
    (as one given up on), and the weights load; the wait is not endless. A
    result's ``policy_version`` is read from the router's ``policy`` (a ``PolicyVersion``) when
    it was issued, so it is right whatever the engines report; a resumed one also carries
    ``extra["token_versions"]``, the version of every generated token (without it, every token
    has ``policy_version``). ``gate_watchers`` are told as the gate closes and reopens.
Accounting
    Busy time per engine (time with at least one request in flight), requests, tokens,
    aborts (counted as sent: stats taken right after aborting hold them), preemptions and
    errors; ``take_stats()`` returns them since the last call. ``oldest_version(play)``: the
    version of an episode's oldest token so far (the scheduler's staleness bound).

Per turn, without a task: ``start_generate(request)`` is ``generate`` as a future (what the
env workers' driver side calls once per turn; ``generate`` awaits it). The router is callbacks
on the engines' futures: an engine with ``start_generate`` (``VLLMEngine``, ``SimEngine``,
``HFEngine``, ``RankEngine``) is asked without a task too, any other through a task.

Weight updates reach the engines through ``update``: by default each engine's own
``update_weights``; the pipeline passes one call that updates every cluster rank at once.

The version: a router made without ``policy`` owns one and advances it once per update
through it. A training run hands it the run's ``WeightSync.policy`` instead: the sync is the
one writer, and the router, its engines and the scheduler read the same object.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from trainer.rollout.preempted import joined_result, resumed_part
from trainer.rollout.router_stats import RouterAccounts, RouterStats
from trainer.strategies.base import FinishReason, GenerationRequest, GenerationResult, Weights
from trainer.weights.versioned import PolicyVersion, SharedVersion

__all__ = ["EngineRouter", "RolloutEngine", "episode_key", "starter"]

_STICKY_CAPACITY = 1 << 20
"""Episodes remembered for sticky routing (oldest forgotten first). Episodes are forgotten when
they end, so this only bounds a caller that never calls ``forget``; it must exceed the episodes
in play at once (50k at cluster scale, more with redundancy and staleness)."""

_FAILING_AFTER = 3
"""Errors in a row that make an engine failing (one or two may be the request's fault)."""
_PROBE_EVERY = 32
"""New episodes between trials on a failing engine (a dead one fails one attempt per 32)."""


def episode_key(request_id: str) -> str:
    """The episode a request belongs to: the id up to its last ``/`` (the whole id without one)."""
    head, sep, _ = request_id.rpartition("/")
    return head if sep else request_id


def _play_of(key: str) -> str:
    """The play of attempt key ``"{play}a{n}"`` (``n`` digits); any other key is its own."""
    head, sep, attempt = key.rpartition("a")
    return head if sep and attempt.isdigit() else key


class RolloutEngine(Protocol):
    """What the rollout path calls on an engine: ``InferenceEngine``
    (``trainer.strategies.base``) without ``generate_batch``, which only a worker rank serves.

    The router needs this of every engine behind it and is one itself, to the env managers.
    A full engine (``HFEngine``, ``VLLMEngine``) fits, and so does a driver-side front that
    only queues requests for a worker rank (``trainer.workers.infer.RankEngine``). An engine
    may also offer ``start_generate(request) -> asyncio.Future[GenerationResult]``
    (``generate`` as a future, cancelled to give the request up): the router then asks it
    without a task.
    """

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...
    async def abort(self, request_id: str) -> None: ...
    def update_weights(self, weights: Weights) -> None: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
    def get_state(self) -> dict[str, Any]: ...
    def set_state(self, state: dict[str, Any]) -> None: ...


class _Flight:
    """One ``start_generate`` call: its request and answer, where its current part runs, the
    parts it has so far (each with the version it was issued under) and what happened to it."""

    __slots__ = (
        "answer",
        "cancelled",
        "engine",
        "issued",
        "key",
        "part",
        "parts",
        "preempted",
        "request",
        "sub_id",
        "submitted",
    )

    def __init__(
        self, request: GenerationRequest, key: str, answer: asyncio.Future[GenerationResult]
    ) -> None:
        self.request, self.key, self.answer = request, key, answer
        self.engine, self.sub_id, self.issued = -1, request.request_id, 0
        self.part: asyncio.Future[GenerationResult] | None = None
        self.parts: list[tuple[GenerationResult, int]] = []
        self.cancelled = self.preempted = self.submitted = False


class _Answer(asyncio.Future[GenerationResult]):
    """The future ``start_generate`` returns: cancelling it gives the request up at once
    (``EngineRouter._give_up``), with no done-callback per turn to watch for it."""

    __slots__ = ("_request_id", "_router")
    _request_id: str
    _router: EngineRouter

    def cancel(self, msg: Any | None = None) -> bool:
        if not super().cancel(msg):
            return False
        self._router._give_up(self)
        return True


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
        pause_timeout_s: float = 120.0,
    ) -> None:
        """``clock``: what busy time is measured with (a simulation passes its loop's
        ``time``: ``trainer.rollout.sim_clock``). ``pause_timeout_s``: how long a weight
        update's pause waits for the engines to answer its aborts (a live engine answers within
        a step) before it gives up on the requests a hung engine holds (``rollout.
        pause_timeout_s``: the same bound as for env workers)."""
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        if not pause_timeout_s > 0:
            raise ValueError(f"pause_timeout_s must be a positive number, got {pause_timeout_s!r}")
        self.pause_timeout_s = pause_timeout_s
        self.engines = list(engines)
        self._starts: list[Callable[[GenerationRequest], asyncio.Future[GenerationResult]]]
        self._starts = [starter(e) for e in self.engines]
        """Per engine: a request in, a future of its result out."""
        self._update = update
        self._owns_policy = policy is None
        self.policy = policy if policy is not None else PolicyVersion()
        self._load = [0] * len(self.engines)
        self._in_flight = 0
        self._silent = [False] * len(self.engines)
        """Engines whose last request was given up on without an answer (hung, maybe)."""
        self._errors_in_a_row = [0] * len(self.engines)
        self._failing: set[int] = set()  # the last ``_FAILING_AFTER`` requests raised
        self._since_probe = 0  # new episodes routed around failing engines since a trial
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._episode_flights: dict[str, set[str]] = {}
        """Episode key -> ids of its requests in ``_flights`` (an episode's abort is a lookup)."""
        self._cancelled: set[str] = set()
        self._cancelled_of: dict[str, list[str]] = {}  # play (``_play_of``) -> its marks
        self._oldest: dict[str, int] = {}
        """Play (``_play_of``) -> the version of its current attempt's oldest token."""
        self._held: list[_Flight] = []
        """Requests (new, or preempted parts) waiting for ``resume``."""
        self._idle: asyncio.Event | None = None
        self.paused = False  # a weight update holds every turn (``pause`` to ``resume``)
        self.gate_watchers: list[Callable[[bool], None]] = []
        """Called with ``paused`` as ``pause`` begins and ``resume`` ends it (``EnvWorkers``
        tells its workers: their turn deadlines do not count a pause: ``turn_deadline``)."""
        self._clock = clock
        self._accounts = RouterAccounts(len(self.engines), clock)

    # ------------------------------------------------------------------ RolloutEngine
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate on the episode's engine; resumes across weight updates (module docstring)."""
        return await self.start_generate(request)

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        """``generate`` as a future, without a task: cancelling it gives the request up, as
        cancelling ``generate`` does (the engine's part is cancelled; the engine gets no new
        episodes while others answer)."""
        request_id = request.request_id
        key = episode_key(request_id)
        answer = _Answer(loop=asyncio.get_running_loop())
        answer._router, answer._request_id = self, request_id  # no cycle through the flight
        flight = _Flight(request, key, answer)
        self._flights[request_id] = flight
        running = self._episode_flights.get(key)
        if running is None:
            self._episode_flights[key] = {request_id}
        else:
            running.add(request_id)
        self._submit(flight)
        return answer

    async def abort(self, request_id: str) -> None:
        """Abort in the engine that holds the request; unknown or finished ids are ignored.
        Counted now (``take_stats``), not when the engine answers."""
        flight = self._flights.get(request_id)
        if flight is None:
            return
        if not flight.cancelled and not flight.answer.done():
            self._count("abort")
        flight.cancelled = True
        if flight.submitted:
            await self.engines[flight.engine].abort(flight.sub_id)
        elif flight in self._held:  # waiting for resume: it ends now
            self._held.remove(flight)
            self._finish(flight, "abort")

    async def abort_episode(self, key: str) -> None:
        """Abort the episode's request in flight; refuse later ones until its play's ``forget``."""
        if key not in self._cancelled:
            self._cancelled.add(key)
            self._cancelled_of.setdefault(_play_of(key), []).append(key)
        running = self._episode_flights.get(key)
        if running:
            await asyncio.gather(*(self.abort(r) for r in list(running)))

    def forget(self, key: str) -> None:
        """The episode ended: drop its sticky engine, its play's cancelled marks and oldest
        version (a replay's tokens start afresh)."""
        play = _play_of(key)
        for marked in self._cancelled_of.pop(play, ()):
            self._cancelled.discard(marked)
        self._oldest.pop(play, None)
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
        idle: ``pause_timeout_s`` at most, then the requests still in an engine are given up
        on (``_give_up_hung``). Bounded, so a hung engine cannot hold a weight update (and,
        through it, the run: a paused router holds every turn deadline) for good."""
        idle = self._ensure_idle()
        self.paused = True
        for watcher in self.gate_watchers:
            watcher(True)
        preempted = [f for f in self._flights.values() if not f.cancelled and f.submitted]
        for flight in preempted:
            flight.preempted = True
        # all at once: an engine takes the whole set between two of its steps (one by one, each
        # abort would wait for a step of its own)
        aborts = asyncio.gather(*(self.engines[f.engine].abort(f.sub_id) for f in preempted))
        try:
            await asyncio.wait_for(asyncio.gather(aborts, idle.wait()), self.pause_timeout_s)
        except TimeoutError:
            self._give_up_hung()

    def _give_up_hung(self) -> None:
        """The pause's wait ran out: each request still in an engine fails (its episode records
        an engine error and is replayed on a fresh attempt, routed elsewhere), its part is
        cancelled, and its engine is avoided until it answers again (``_silent``)."""
        for flight in [f for f in self._flights.values() if f.submitted]:
            part, index = flight.part, flight.engine
            self._leave(flight)
            flight.part = None  # its late answer, if any, is ignored (``_landed``)
            self._silent[index] = True
            self._accounts.current.errors += 1
            if part is not None:
                part.cancel()
            self._fail(
                flight,
                TimeoutError(
                    f"engine {index} did not answer within {self.pause_timeout_s:g} s of a "
                    "weight update's pause (it ignored the abort: a hung inference worker?); the "
                    "turn was given up"
                ),
            )

    def resume(self) -> None:
        """Reopen the gate closed by ``pause``: the requests held meanwhile go out, in order."""
        self.paused = False
        for watcher in self.gate_watchers:
            watcher(False)
        held, self._held = self._held, []
        for flight in held:
            self._submit(flight)

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

    def oldest_version(self, play: str) -> int | None:
        """The version of the oldest token the current attempt of ``play`` (an episode key, or
        the play of attempt keys ``"{play}a{n}"``) has generated: None before one came back, or
        after ``forget``. Parts come back at a weight update's pause, so it is exact after one."""
        return self._oldest.get(play)

    def take_stats(self) -> RouterStats:
        """Counters since the previous call (busy time of running requests is split at now)."""
        return self._accounts.take()

    def totals(self) -> RouterStats:
        """Counters since the router was made (or ``reset_totals``), up to now; does not
        disturb ``take_stats`` intervals (the scheduler's per-batch metrics)."""
        return self._accounts.totals()

    def reset_totals(self) -> None:
        """Start ``totals`` afresh (from now)."""
        self._accounts.reset()

    # ------------------------------------------------------------------ internals
    def _ensure_idle(self) -> asyncio.Event:
        """The idle event, created on first use inside the running loop."""
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def _submit(self, flight: _Flight) -> None:
        """Send the flight's next part to its episode's engine (held while paused)."""
        if flight.cancelled or flight.key in self._cancelled:
            self._finish(flight, "abort")
            return
        if self.paused:
            self._held.append(flight)
            return
        request, parts = flight.request, flight.parts
        sub = request
        if parts:
            sub = resumed_part(request, len(parts), [t for r, _ in parts for t in r.token_ids])
        index = self._route(flight.key)
        flight.engine, flight.sub_id, flight.preempted = index, sub.request_id, False
        flight.issued = self.policy.value  # weights change only while paused and idle
        self._enter(flight)
        try:
            part = self._starts[index](sub)
        except Exception as error:  # noqa: BLE001 - the caller's future raises it
            self._leave(flight)
            self._errored(index)
            self._fail(flight, error)
            return
        flight.part = part
        part.add_done_callback(functools.partial(self._landed, flight))

    def _landed(self, flight: _Flight, part: asyncio.Future[GenerationResult]) -> None:
        """A part's engine answered: the flight ends, or goes on after a preemption."""
        if flight.part is not part:  # given up on by a pause (``_give_up_hung``)
            return
        self._leave(flight)
        flight.part = None
        if part.cancelled():  # given up on (rollout.generate_timeout_s), or the engine closed
            self._silent[flight.engine] = True
            self._drop(flight)
            flight.answer.cancel()
            return
        error = part.exception()
        if error is not None:
            self._errored(flight.engine)
            self._fail(flight, error)
            return
        result = part.result()
        self._silent[flight.engine] = False
        self._errors_in_a_row[flight.engine] = 0
        self._failing.discard(flight.engine)
        self._accounts.current.new_tokens += len(result.token_ids)
        flight.parts.append((result, flight.issued))
        if result.token_ids and (play := _play_of(flight.key)) not in self._oldest:
            self._oldest[play] = flight.issued
            if len(self._oldest) > _STICKY_CAPACITY:  # a caller that never calls ``forget``
                del self._oldest[next(iter(self._oldest))]
        reason = result.finish_reason
        if reason != "abort" or flight.cancelled or not flight.preempted:
            self._finish(flight, reason)
            return
        self._accounts.current.preempted += 1
        if sum(len(r.token_ids) for r, _ in flight.parts) >= flight.request.max_new_tokens:
            self._finish(flight, "length")  # preempted as its budget ran out
        else:
            self._submit(flight)  # held until ``resume``

    def _give_up(self, answer: _Answer) -> None:
        """The caller cancelled the answer: cancel the engine's part (or drop the held one)."""
        flight = self._flights.get(answer._request_id)
        if flight is None or flight.answer is not answer:  # it had ended already
            return
        flight.cancelled = True
        if flight.part is not None and not flight.part.done():
            self._silent[flight.engine] = True  # new episodes avoid it until it answers again
            flight.part.cancel()
        elif flight in self._held:
            self._held.remove(flight)
            self._drop(flight)

    def _finish(self, flight: _Flight, reason: FinishReason) -> None:
        """The flight ended with ``reason``: count it and answer (unless given up on)."""
        self._drop(flight)
        if flight.answer.done():
            return
        if not flight.cancelled:  # (a cancelled one was counted as its abort was sent)
            self._count(reason)
        parts = flight.parts
        if len(parts) == 1 and parts[0][0].finish_reason == reason:
            result, issued = parts[0]  # the engine's own result: every token has one version
            result.policy_version = issued
        else:
            result = joined_result(flight.request.request_id, parts, reason, self.policy.value)
        flight.answer.set_result(result)

    def _count(self, reason: FinishReason) -> None:
        """A request ended (or its abort was sent) with ``reason``."""
        self._accounts.current.requests += 1
        if reason == "abort":
            self._accounts.current.aborted += 1

    def _fail(self, flight: _Flight, error: BaseException) -> None:
        self._drop(flight)
        if not flight.answer.done():
            flight.answer.set_exception(error)

    def _drop(self, flight: _Flight) -> None:
        """Forget the flight (its request id and episode no longer name it)."""
        request_id = flight.request.request_id
        if self._flights.get(request_id) is flight:
            del self._flights[request_id]
        running = self._episode_flights.get(flight.key)
        if running is not None:
            running.discard(request_id)
            if not running:
                del self._episode_flights[flight.key]

    def _errored(self, index: int) -> None:
        """A request on engine ``index`` raised: count it; avoid the engine after a few."""
        self._accounts.current.errors += 1
        self._errors_in_a_row[index] += 1
        if self._errors_in_a_row[index] >= _FAILING_AFTER:
            self._failing.add(index)

    def _route(self, key: str) -> int:
        """The episode's engine (``key``: ``episode_key`` of its requests)."""
        index = self._sticky.get(key)
        if index is None:
            load = self._load
            if self._failing or any(self._silent):  # rare: healthy engines first
                index = self._route_around(load)
            else:  # the least loaded, the first of equals (one C pass: a new episode each time)
                index = load.index(min(load))
            self._sticky[key] = index
            if len(self._sticky) > _STICKY_CAPACITY:
                self._sticky.popitem(last=False)
        else:
            self._sticky.move_to_end(key)
        return index

    def _route_around(self, load: list[int]) -> int:
        """A new episode's engine while some are avoided (hung or failing): module docstring."""
        failing, silent = self._failing, self._silent
        avoided = [i for i in range(len(load)) if silent[i] or i in failing]
        if len(avoided) == len(load):
            return load.index(min(load))
        self._since_probe += 1
        if self._since_probe >= _PROBE_EVERY:  # an avoided engine's trial episode
            self._since_probe = 0
            return min(avoided, key=lambda i: (load[i], i))
        return min(range(len(load)), key=lambda i: (silent[i] or i in failing, load[i], i))

    def _enter(self, flight: _Flight) -> None:
        index, flight.submitted = flight.engine, True
        if self._load[index] == 0:
            self._accounts.busy(index)
        self._load[index] += 1
        self._in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def _leave(self, flight: _Flight) -> None:
        index, flight.submitted = flight.engine, False
        self._load[index] -= 1
        self._in_flight -= 1
        if self._load[index] == 0:
            self._accounts.idle(index)
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()


def starter(
    engine: RolloutEngine,
) -> Callable[[GenerationRequest], asyncio.Future[GenerationResult]]:
    """The engine's ``start_generate`` (a request in, a future of its result out), or, for an
    engine that only has ``generate``, one that runs it in a task."""
    start = getattr(engine, "start_generate", None)
    if start is not None:
        return start

    def start_generate(request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        return asyncio.ensure_future(engine.generate(request))

    return start_generate
