"""An env worker process (``trainer.rollout.env_workers``): its event loop and the engine it
generates through.

The driver starts ``python -m trainer.rollout.env_worker_process FD [--env-calls FD2]
[--relay FD3] [--lockstep]`` with one end of a socket pair as ``FD`` and its own ``sys.path`` in
``PYTHONPATH``. The first frame carries ``("init", setup, routing)``: the worker calls
``setup(engine)`` and answers ``("ready",)``, or ``("fatal", traceback)`` and exits.
``engine`` is a ``RemoteEngine`` (the driver routes every turn), or, with ``routing``
(``WorkerRouters.init_message``: the engines' setup, the version, paused or not, the pause
timeout), a ``LocalRoute``: an ``EngineRouter`` of the worker's own over the engines it
builds (``trainer.rollout.worker_routing``). Then:

    driver -> worker   ("play", key, spec, sampling, max_retries)  play_episode in a task
                       ("result", *result) / ("failed", request_id, error)
                       ("stop", [keys])                              no more replays
                       ("pause",) / ("resume", version)              routing here: the router
                       ("abort_episode", key)                        stops / goes on; aborts
                       ("relay", payload)                            relayed engines' results
    worker -> driver   ("generate", *request)                       a whole prompt
                       ("extend", *request)                         only the ids after the
                                                                    episode's last prompt and
                                                                    its generation
                       ("abort", request_id) / ("forget", key)
                       ("done", key, trajectory, failed attempts, report)
                       ("error", key, text)
                       ("paused", report)                           routing here: idle
                       ("relay", payload)                           relayed engines' requests
                       ("idle", frames answered, CPU seconds)        lockstep only

A ``report`` is None when the driver routes, else the worker's router counters and its
requests in flight (``WorkerRouters.on_report``).

``pause`` / ``resume`` also come when the driver routes: its router paused for a weight update
and went on (the ``RemoteEngine`` tells the turn deadlines, which do not count a pause; no
``paused`` answer).

Frames and the messages' encodings: ``trainer.rollout.wire``.

Around each env call of an episode (making, resetting, stepping, closing its env) the worker
records the episode's key in memory it shares with the driver (``--env-calls FD``:
``trainer.rollout.env_worker_replay.EnvCalls``), so that, if the call kills the process, the
driver fails only that episode and replays the others.

The worker exits when the socket closes (its driver closed it or is gone), after cancelling
its episodes and closing its env source.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from trainer.rollout.env_worker_replay import EnvCalls
from trainer.rollout.router import EngineRouter, episode_key
from trainer.rollout.trajectory import Trajectory
from trainer.rollout.wire import (
    Channel,
    attach_socket,
    request_to_wire,
    result_from_wire,
    trajectory_to_wire,
)
from trainer.strategies.base import GenerationRequest, GenerationResult
from trainer.weights.versioned import PolicyVersion

if TYPE_CHECKING:
    from trainer.rollout.env_manager import EnvManager, EnvSession, EnvSource, Sampling
    from trainer.rollout.env_output import ResetOutcome, StepOutcome
    from trainer.rollout.groups import EpisodeSpec
    from trainer.rollout.worker_routing import EngineSetup

__all__ = ["LocalRoute", "RemoteEngine", "WorkerSetup"]

WorkerSetup = Callable[["RemoteEngine | LocalRoute"], "tuple[EnvManager, EnvSource]"]
"""Builds a worker's ``EnvManager`` (generating through the given engine) and ``EnvSource``."""

_T = TypeVar("_T")


class RemoteEngine:
    """The driver's router as a worker's ``EnvManager`` sees it (``RolloutEngine``).

    ``paused`` and ``version`` follow the driver's router as it tells them (``("pause",)`` and
    ``("resume", version)`` around a weight update): a turn's ``rollout.generate_timeout_s``
    does not count the time the driver held it (``trainer.rollout.turn_deadline``)."""

    def __init__(self, worker: _WorkerLoop) -> None:
        self._worker = worker
        self.paused = False
        self.version = 0
        """The policy version of the driver's last resume this worker was told of (0 before)."""

    def gate(self, message: tuple[Any, ...]) -> None:
        """The driver's router paused (``("pause",)``) or resumed (``("resume", version)``)."""
        self.paused = message[0] == "pause"
        if not self.paused:
            self.version = message[1]

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        worker = self._worker
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        worker.waiting[request.request_id] = future
        key = episode_key(request.request_id)
        prompt = request.prompt_ids
        last = worker.last_turn.get(key)
        worker.last_turn.pop(key, None)
        if last is not None and len(prompt) >= len(last) and prompt[: len(last)] == last:
            # the usual turn of an episode: only the ids after the previous turn's travel
            worker.channel.send(request_to_wire("extend", request, prompt[len(last) :]))
        else:
            worker.channel.send(request_to_wire("generate", request, prompt))
        worker.settle()
        try:
            result = await future
        finally:
            worker.waiting.pop(request.request_id, None)
        if result.finish_reason != "abort":  # what the driver now holds for this episode
            worker.last_turn[key] = prompt + result.token_ids
        return result

    async def abort(self, request_id: str) -> None:
        self._worker.channel.send(("abort", request_id))

    def forget(self, key: str) -> None:
        self._worker.last_turn.pop(key, None)
        self._worker.channel.send(("forget", key))


class LocalRoute:
    """The worker's own ``EngineRouter`` as its ``EnvManager`` sees it (routing in the worker:
    ``trainer.rollout.worker_routing``)."""

    def __init__(self, worker: _WorkerLoop, router: EngineRouter) -> None:
        self._worker, self.router = worker, router

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        worker = self._worker
        answer = self.router.start_generate(request)
        worker.waiting[request.request_id] = answer
        worker.settle()
        try:
            return await answer
        finally:
            worker.waiting.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        await self.router.abort(request_id)

    def forget(self, key: str) -> None:
        self.router.forget(key)


class _WorkerLoop:
    """A worker process's event loop: plays the episodes the driver sends (``WorkerLink`` of
    the engines it builds when it routes its turns itself)."""

    def __init__(
        self, lockstep: bool, relay: socket.socket | None = None, calls: EnvCalls | None = None
    ) -> None:
        self.lockstep = lockstep
        self.calls = calls
        """Where the episodes in an env call are recorded for the driver (``EnvCalls``)."""
        self.channel = Channel(self.on_frame, self.on_lost, auto_flush=not lockstep)
        self.relay: Channel | None = None
        """The relayed engines' own socket to the driver (``RelayEngines``), if any."""
        self._relay_sock = relay
        if relay is not None:
            self.relay = Channel(self.on_frame, lambda: None, auto_flush=not lockstep)
        self._answers = 0
        """lockstep: answers sent (the driver takes them in this order, from either socket)."""
        self.waiting: dict[str, asyncio.Future[GenerationResult]] = {}
        """Request id -> its answer, while an episode waits for it."""
        self.last_turn: dict[str, list[int]] = {}
        """Episode key -> its last prompt + generated ids, as the driver holds them."""
        self.router: EngineRouter | None = None
        """The worker's own router (routing here), else None: the driver routes."""
        self.remote: RemoteEngine | None = None
        """The driver's router as the episodes see it, when it routes (else None)."""
        self.on_relay: Callable[[bytes], None] | None = None
        """Relayed engines' results handler (``trainer.rollout.worker_routing.RelayEngines``)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._settling = False
        self.manager: EnvManager | None = None
        self.source: EnvSource | None = None
        self.plays: dict[str, asyncio.Task[None]] = {}
        self.stopped: set[str] = set()
        self.lost = asyncio.Event()
        self._owed = 0
        self._cpu_from = 0.0

    def send(self, message: tuple[Any, ...]) -> None:
        """A message to the driver (``WorkerLink``): relayed engines' on their own socket."""
        if message[0] == "relay" and self.relay is not None:
            self.relay.send(message)
        else:
            self.channel.send(message)

    def init(
        self, setup: WorkerSetup, routing: tuple[EngineSetup, int, bool, float] | None = None
    ) -> None:
        """Build the manager with ``setup`` (and the router with ``routing``); answer ``ready``,
        or ``fatal`` and stop."""
        try:
            engine: RemoteEngine | LocalRoute
            if routing is None:
                engine = self.remote = RemoteEngine(self)
            else:
                engines, version, paused, pause_timeout_s = routing
                self.router = EngineRouter(
                    engines(self), policy=PolicyVersion(version), pause_timeout_s=pause_timeout_s
                )
                engine = LocalRoute(self, self.router)
                if paused:  # nothing in flight yet: it only holds requests until "resume"
                    self.spawn(self.router.pause())
            self.manager, self.source = setup(engine)
        except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
            self.channel.queue(("fatal", traceback.format_exc()[-4000:]))
            self.channel.close()
            return
        self.channel.queue(("ready",))

    def on_frame(self, frame: list[tuple[Any, ...]]) -> None:
        if frame[0][0] == "init":
            self.init(*frame[0][1:])
            return
        if self.lockstep:
            if not self._owed:
                self._cpu_from = time.thread_time()
            self._owed += 1
        for message in frame:
            kind = message[0]
            if kind == "result":  # popped now: the episode no longer waits (``settle``)
                result = result_from_wire(message)
                future = self.waiting.pop(result.request_id, None)
                if future is not None and not future.done():
                    future.set_result(result)
            elif kind == "failed":
                future = self.waiting.pop(message[1], None)
                if future is not None and not future.done():
                    future.set_exception(RuntimeError(message[2]))
            elif kind == "play":
                _, key, spec, sampling, max_retries = message
                task = asyncio.get_running_loop().create_task(
                    self.play(key, spec, sampling, max_retries)
                )
                self.plays[key] = task
            elif kind == "stop":
                self.stopped.update(message[1])
            elif kind == "relay" and self.on_relay is not None:
                self.on_relay(message[1])
            elif self.router is not None:
                self.route(self.router, message)
            elif kind in ("pause", "resume") and self.remote is not None:
                self.remote.gate(message)
        self.settle()

    def route(self, router: EngineRouter, message: tuple[Any, ...]) -> None:
        """The driver's word to the worker's own router."""
        kind = message[0]
        if kind == "pause":
            self.spawn(self.pause(router))
        elif kind == "resume":
            router.policy.restore(message[1])
            router.resume()
        elif kind == "abort_episode":
            self.spawn(router.abort_episode(message[1]))

    async def pause(self, router: EngineRouter) -> None:
        await router.pause()
        self.channel.send(("paused", self.report()))
        self.settle()

    def report(self) -> tuple[Any, ...] | None:
        """The router's counters and requests in flight (routing here), else None."""
        from trainer.rollout.worker_routing import counters_to_wire

        if self.router is None:
            return None
        return counters_to_wire(self.router.totals()), self.router.in_flight

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def play(self, key: str, spec: EpisodeSpec, sampling: Sampling, retries: int) -> None:
        from trainer.rollout.groups import play_episode

        if self.manager is None or self.source is None:
            raise RuntimeError("an episode arrived before the worker's setup (the init frame)")
        failed: list[Trajectory] = []
        source = self.source
        if self.calls is not None:
            source = _RecordedSource(source, key, self.calls)
        try:
            trajectory = await play_episode(
                self.manager,
                source,
                spec,
                sampling,
                max_retries=retries,
                key=key,
                on_failure=failed.append,
                stop=lambda: key in self.stopped,
            )
        except Exception as error:  # noqa: BLE001 - reported to the driver's scheduler
            self.channel.send(("error", key, f"{type(error).__name__}: {error}"[:500]))
        else:
            wire = trajectory_to_wire(trajectory)
            self.channel.send(("done", key, wire, failed, self.report()))
        finally:
            self.plays.pop(key, None)
            self.stopped.discard(key)
            self.settle()

    def settle(self) -> None:
        """lockstep: answer the owed frames once every episode waits for the engine again and
        nothing else in the worker can run (a router's callbacks, a relay's flush, a pause)."""
        if not self.lockstep or not self._owed or self._settling:
            return
        self._settling = True
        asyncio.get_running_loop().call_soon(self._settle_when_quiet)

    def _settle_when_quiet(self) -> None:
        loop = asyncio.get_running_loop()
        if getattr(loop, "_ready", None):  # CPython's queue of callbacks ready to run
            loop.call_soon(self._settle_when_quiet)
            return
        self._settling = False
        if not self._owed or len(self.waiting) < len(self.plays):
            return  # an episode still works: its next request (or end) settles again
        idle = ("idle", self._owed, time.thread_time() - self._cpu_from, self._answers)
        self._answers += 1
        self._owed = 0
        channel = self.channel
        if self.relay is not None:
            if channel.pending:  # the relayed messages ride along, in order
                for message in self.relay.take_pending():
                    channel.send(message)
            else:  # only engine traffic: the answer travels on its socket
                channel = self.relay
        channel.send(idle)
        channel.flush()

    def on_lost(self) -> None:
        self.lost.set()

    async def serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: self.channel, sock)
        if self.relay is not None and self._relay_sock is not None:
            attach_socket(self.relay, self._relay_sock)
        try:
            await self.lost.wait()
        finally:
            for task in list(self.plays.values()):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(*self.plays.values(), return_exceptions=True), 10
                )
            if self.source is not None:
                with contextlib.suppress(Exception):
                    await self.source.aclose()


class _RecordedSource:
    """The worker's env source as one episode (``key``) plays it: each of its env calls (making,
    resetting, stepping, closing its env) is in ``calls`` while it runs, so that the driver can
    tell which episode's env killed the worker (``EnvCalls``)."""

    def __init__(self, source: EnvSource, key: str, calls: EnvCalls) -> None:
        self._source, self._key, self._calls = source, key, calls

    async def session(self, env_id: str) -> EnvSession:
        session = await _recorded(self._calls, self._key, self._source.session, env_id)
        return _RecordedSession(session, self._key, self._calls)

    async def aclose(self) -> None:
        await self._source.aclose()


class _RecordedSession:
    """An episode's env session, its calls recorded (``_RecordedSource``)."""

    def __init__(self, session: EnvSession, key: str, calls: EnvCalls) -> None:
        self._session, self._key, self._calls = session, key, calls

    async def reset(self, seed: int, options: dict[str, Any] | None = None) -> ResetOutcome:
        return await _recorded(self._calls, self._key, self._session.reset, seed, options)

    async def step(self, action: str | dict[str, Any]) -> StepOutcome:
        return await _recorded(self._calls, self._key, self._session.step, action)

    async def close(self) -> None:
        await _recorded(self._calls, self._key, self._session.close)


async def _recorded(
    calls: EnvCalls, key: str, call: Callable[..., Awaitable[_T]], *args: Any
) -> _T:
    """``call(*args)`` awaited with ``key`` in ``calls`` meanwhile (until it returns, raises, or
    is given up on)."""
    calls.begin(key)
    try:
        return await call(*args)
    finally:
        calls.end(key)


def main(argv: list[str]) -> None:
    """A worker process: play episodes until the driver's socket closes."""
    from envhub.gc_tuning import relax_gc

    relax_gc()  # as the driver does: many in-flight objects, few cycles
    sock = socket.socket(fileno=int(argv[0]))
    relay = None
    if "--relay" in argv:
        relay = socket.socket(fileno=int(argv[argv.index("--relay") + 1]))
    calls = None
    if "--env-calls" in argv:
        calls = EnvCalls.attach(int(argv[argv.index("--env-calls") + 1]))

    async def main() -> None:
        await _WorkerLoop(lockstep="--lockstep" in argv, relay=relay, calls=calls).serve(sock)

    asyncio.run(main())


if __name__ == "__main__":
    main(sys.argv[1:])
