"""``EnvWorkers``: env managers in worker processes, so that one driver can feed a cluster.

Per turn an episode costs the process that plays it the chat template and tokenizer, the
tool parser, the env's step and the trajectory's bookkeeping (a few hundred microseconds of
Python; benchmarks/README.md, ``rollout_scale``). At 10,000 episodes over 64 engines one
process cannot keep up and the engines wait for it. As ROLL runs its env managers on env
worker actors, ``EnvWorkers`` runs ``EnvManager`` s in ``workers`` processes; the driver keeps
the ``RolloutScheduler`` (groups, redundancy, staleness, batches) and the ``EngineRouter``,
and per turn only forwards a generation request to the router and the result back::

    driver                                          worker k (one of ``workers``)
    scheduler --play(spec, key)--> EnvWorkers ====> play_episode(EnvManager, EnvSource)
    router    <---generate/abort/forget--------- ==  RemoteEngine <- EnvManager.run
    router    ----result------------------------> ==  (the turn goes on: decode, env step)
    scheduler <---done(trajectory, failed tries)- ==

Each worker builds its ``EnvManager`` and ``EnvSource`` by calling ``setup(engine)`` (a
picklable callable, e.g. a module-level function or a ``functools.partial`` of one) with a
``RemoteEngine`` that stands for the driver's router. A worker is a child process
(``python -m trainer.rollout.env_worker_process``: its loop, the engine stand-in and the
messages are there) joined to the driver by a socket pair: trusted, local, never a network
port, so messages are pickled (like ``multiprocessing``'s own pipes). Everything one side has
to say within one event-loop iteration travels as one length-prefixed frame (one write and one
read however many episodes spoke), and after an episode's first turn only the token ids after
its previous prompt and generation travel (the driver holds those and rebuilds the prompt).

Guarantees: an episode is played by one worker from its start to its end (its replays on a
fresh env too) unless that worker dies; ``stop(keys)`` ends the episodes' replays after the
running attempt (the scheduler then aborts their generations in the router). A worker that dies
fails the episodes that were in an env call (``failure`` names the worker and its exit code) and
replays every other one on a live worker (``trainer.rollout.env_worker_replay``); their
generations are aborted in the router, and a fresh worker takes its place; nothing hangs:
its death is seen when its process exits (even while a helper its env forked holds the socket),
and its process group, helpers included, dies with it. ``close()`` ends every worker process
(killed if it does not exit within ``close_timeout_s``), and a worker whose driver is gone exits
on its own (its socket closes). A worker stuck in an env call that holds the GIL is not detected
(only a weight update's ``rollout.pause_timeout_s`` kills it): such envs belong in an
``EnvPool``.

With a ``WorkerRouters`` in place of the router, each worker routes its own turns to the
engines and the driver only sees episodes start and end, and the weight updates' pause and
resume (``trainer.rollout.worker_routing``).

``lockstep=True`` is for the cluster simulation only (``trainer.rollout.sim_clock``,
benchmarks/rollout_scale.py): each worker answers every frame once all its episodes wait for the
engine again and nothing else in it can run, reporting the CPU seconds that took (answers are
numbered: with relayed engines they come on either of two sockets, and are taken in order); the
driver's simulated clock does not move past an unanswered frame, and the answer takes effect
after that many simulated seconds on the worker's own timeline (a worker is one CPU: its frames
queue behind each other). So the simulation charges each worker's real CPU to its own timeline
and only the driver's to the driver's, as processes on separate cores would run.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envhub.pool.procs import ExitWatch, describe_exit, kill_group
from trainer.rollout.env_output import score_episode
from trainer.rollout.env_worker_handle import WorkerHandle
from trainer.rollout.env_worker_process import LocalRoute, RemoteEngine, WorkerSetup
from trainer.rollout.env_worker_replay import EnvCalls, HeldEpisode, bystanders, settle_held
from trainer.rollout.router import episode_key
from trainer.rollout.trajectory import Trajectory
from trainer.rollout.wire import (
    Channel,
    attach_socket,
    request_from_wire,
    result_to_wire,
    trajectory_from_wire,
)
from trainer.strategies.base import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from trainer.rollout.env_manager import EnvManager, EnvSource, Sampling
    from trainer.rollout.groups import EpisodeSpec
    from trainer.rollout.router import EngineRouter
    from trainer.rollout.worker_routing import WorkerRouters

__all__ = ["EnvWorkers", "ManagerSetup", "RemoteEngine", "WorkerSetup"]


@dataclass(frozen=True)
class ManagerSetup:
    """The setup a training run gives its workers (``rollout.env_workers``): the driver's
    tokenizer and renderer options, ``EnvManager`` options, and a picklable factory of the run's
    env source (e.g. ``functools.partial(LocalEnvSource, kwargs)``)."""

    tokenizer: Any
    tool_parser: str
    max_tool_calls: int
    manager_options: dict[str, Any]
    """``EnvManager`` keyword arguments (turn and context limits, timeouts, sample unit)."""
    source: Callable[[], EnvSource]

    def __call__(self, engine: RemoteEngine | LocalRoute) -> tuple[EnvManager, EnvSource]:
        from trainer.rollout.env_manager import EnvManager
        from trainer.rollout.trajectory import ChatRenderer

        renderer = ChatRenderer(self.tokenizer, self.tool_parser, self.max_tool_calls)
        return EnvManager(engine, renderer, **self.manager_options), self.source()


_log = logging.getLogger(__name__)
_keys = itertools.count()


# ---------------------------------------------------------------------- the driver's side
class EnvWorkers:
    """``workers`` processes playing episodes for the driver's scheduler (module docstring).

    Hand it to ``RolloutScheduler`` (or ``play_episode`` / ``run_episodes``) in place of an
    ``EnvManager``: ``engine`` is the router its workers generate through (an
    ``EngineRouter`` in the driver, or ``WorkerRouters``: a router in each worker)."""

    def __init__(
        self,
        router: EngineRouter | WorkerRouters,
        setup: WorkerSetup,
        *,
        workers: int = 4,
        lockstep: bool = False,
        close_timeout_s: float = 10.0,
        on_episode_end: Callable[[Trajectory], Any] | None = None,
    ) -> None:
        """``on_episode_end``: awaited in the driver for each finished (not failed) episode
        before ``play`` returns it (e.g. the run's reward functions), as ``EnvManager`` would."""
        if workers < 1:
            raise ValueError(
                f"rollout.env_workers must be >= 1 to use worker processes, got {workers}"
            )
        from trainer.rollout.worker_routing import WorkerRouters

        self.engine = router
        self.routing = router if isinstance(router, WorkerRouters) else None
        """The workers route their own turns (None: the driver's router does)."""
        self._router = None if isinstance(router, WorkerRouters) else router
        """The driver's router, when it routes the workers' turns."""
        if self._router is not None:  # its pauses reach the workers' turn deadlines
            self._router.gate_watchers.append(self._tell_gate)
        if self.routing is not None:
            self.routing.attach(self)
            if self.routing.relay is not None:
                self.routing.relay.connect(self._send_relay)
        self.setup, self.num_workers, self.lockstep = setup, workers, lockstep
        self.close_timeout_s = close_timeout_s
        self.on_episode_end = on_episode_end
        self._workers: list[WorkerHandle] = []
        self._by_uid: dict[int, WorkerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._answers: set[asyncio.Future[GenerationResult]] = set()
        """The router's answers to the workers' requests not in yet (cancelled at close)."""
        self._closed = False
        self._broken: str | None = None
        """Why no worker can play (its setup failed): every call raises it."""
        self.lane_busy_s = 0.0
        """lockstep: the workers' CPU seconds reported so far (their timelines' busy time)."""
        self.restarts = 0
        """Workers replaced after dying."""
        self.played = 0
        """Episodes the workers finished (failed ones included)."""

    async def start(self) -> None:
        """Start the worker processes and wait until each has built its manager (idempotent).

        Raises ``RuntimeError`` with the worker's traceback when ``setup`` fails in it."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn(len(self._workers)))
        for worker in list(self._workers):
            await asyncio.shield(worker.ready)
        if self._broken is not None:
            raise RuntimeError(self._broken)

    async def play(
        self,
        spec: EpisodeSpec,
        sampling: Sampling,
        *,
        max_retries: int = 2,
        key: str | None = None,
        on_failure: Callable[[Trajectory], None] | None = None,
    ) -> Trajectory:
        """``play_episode`` in the least busy worker; same arguments and result (``stop`` is
        ``stop(keys)`` here)."""
        if self._closed:
            raise RuntimeError("EnvWorkers is closed")
        if self._broken is not None or not self._all_ready():
            await self.start()  # (then the least busy worker is picked and given the episode
            # with no await between: episodes asked for meanwhile spread over all workers)
        key = key or f"w{next(_keys)}"
        future: asyncio.Future[Trajectory] = asyncio.get_running_loop().create_future()
        self._assign(key, HeldEpisode(spec, sampling, max_retries, future, on_failure))
        try:
            return await future
        except asyncio.CancelledError:
            for worker in self._workers:  # its first worker's, or a replay's
                if worker.episodes.pop(key, None) is not None:
                    self._send(worker, ("stop", [key]))
            raise

    def _assign(self, key: str, episode: HeldEpisode) -> None:
        """Give the episode to the least busy worker."""
        worker = min(self._workers, key=lambda w: len(w.episodes))
        worker.episodes[key] = episode
        self._send(worker, ("play", key, episode.spec, episode.sampling, episode.max_retries))

    def _replay(self, key: str, episode: HeldEpisode) -> None:
        """Play a dead worker's bystander again on a live worker, once the workers are ready."""
        self._spawn_task(self._replay_when_ready(key, episode))

    async def _replay_when_ready(self, key: str, episode: HeldEpisode) -> None:
        reason = "EnvWorkers closed"
        try:
            if not self._closed:
                await self.start()
        except RuntimeError as error:  # its replacement's setup failed: no worker can play
            reason = str(error)
        except asyncio.CancelledError:
            settle_held({key: episode}, set(), reason, None)
            raise
        if self._closed or self._broken is not None:
            settle_held({key: episode}, set(), self._broken or reason, None)
        elif not episode.future.done():  # (given up on meanwhile: nothing to play)
            self._assign(key, episode)

    def stop(self, keys: list[str]) -> None:
        """No more replays for these episodes after their running attempt."""
        for worker in self._workers:
            held = [k for k in keys if k in worker.episodes]
            if held:
                self._send(worker, ("stop", held))

    def _all_ready(self) -> bool:
        """Every worker is started and answered its setup successfully."""
        return len(self._workers) >= self.num_workers and len(self.live()) == len(self._workers)

    @property
    def episodes(self) -> int:
        """Episodes being played in the workers."""
        return sum(len(w.episodes) for w in self._workers)

    # ------------------------------------------------------------------ WorkerRouters'
    def live(self) -> list[int]:
        """The workers (their ``uid``) that are ready."""
        return [
            w.uid
            for w in self._workers
            if w.ready.done() and not w.ready.cancelled() and w.ready.result()
        ]

    def send_to(self, uid: int, message: tuple[Any, ...]) -> None:
        """A message to a worker (none if it is gone)."""
        worker = self._by_uid.get(uid)
        if worker is not None:
            self._send(worker, message)

    def _tell_gate(self, paused: bool) -> None:
        """The driver's router paused (or resumed) for a weight update: so do the workers'
        turn deadlines (``RemoteEngine``)."""
        version = self.engine.version
        for uid in self.live():
            self.send_to(uid, ("pause",) if paused else ("resume", version))

    def worker_of(self, play_key: str) -> int | None:
        """The worker playing the episode ``play_key`` (None: none does)."""
        for worker in self._workers:
            if play_key in worker.episodes:
                return worker.uid
        return None

    async def close(self) -> None:
        """End every worker (their envs are closed by them); episodes still held fail."""
        self._closed = True
        if self._router is not None and self._tell_gate in self._router.gate_watchers:
            self._router.gate_watchers.remove(self._tell_gate)
        workers, self._workers = self._workers, []
        self._by_uid.clear()
        for worker in workers:
            worker.channel.close()
            if worker.relay is not None:
                worker.relay.close()
        for worker in workers:
            await self._reap(worker)
            kill_group(worker.process)  # the helpers its envs started
            settle_held(worker.episodes, set(), "EnvWorkers closed", None)
            worker.episodes = {}
            worker.calls.close()
            if worker.watch is not None:
                worker.watch.cancel()
        for waiting in [*self._tasks, *self._answers]:
            waiting.cancel()

    # ------------------------------------------------------------------ workers
    def _spawn(self, index: int) -> WorkerHandle:
        """A new worker process (``trainer.rollout.env_worker_process``): it gets the
        driver's ``sys.path``, then ``setup`` in its first frame, and answers ``ready``."""
        loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        command = [sys.executable, "-m", "trainer.rollout.env_worker_process", str(theirs.fileno())]
        passed = [theirs]
        calls, calls_fd = EnvCalls.create()  # which episodes are in an env call, if it dies
        command += ["--env-calls", str(calls_fd)]
        relay = self.routing.relay if self.routing is not None else None
        if relay is not None:  # the relayed engines' traffic gets a socket of its own
            relay_mine, relay_theirs = socket.socketpair()
            passed.append(relay_theirs)
            command += ["--relay", str(relay_theirs.fileno())]
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        process = subprocess.Popen(
            command + (["--lockstep"] if self.lockstep else []),
            pass_fds=[calls_fd, *(s.fileno() for s in passed)],
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,  # its own group: kill_group takes its envs' helpers too
        )
        for sock in passed:
            sock.close()
        os.close(calls_fd)
        holder: list[WorkerHandle] = []
        channel = Channel(
            lambda frame: self._on_frame(holder[0], frame),
            lambda: self._on_lost(holder[0]),
            auto_flush=not self.lockstep,
        )
        worker = WorkerHandle(index, process, channel, loop.create_future(), calls)
        worker.watch = ExitWatch(process, functools.partial(self._on_lost, worker), sock=mine)
        if relay is not None:
            worker.relay = Channel(
                lambda frame: self._on_frame(holder[0], frame),
                lambda: None,  # the main socket's loss is the worker's
                auto_flush=not self.lockstep,
            )
            attach_socket(worker.relay, relay_mine, relay.off_clock)
        worker.lane_free = loop.time()
        holder.append(worker)
        self._by_uid[worker.uid] = worker
        loop.create_task(loop.connect_accepted_socket(lambda: channel, mine))
        _owe(loop, 1)  # the clock waits for its "ready"
        routing = None
        if self.routing is not None:
            routing = self.routing.init_message()
            worker.init_paused = routing[2]
        channel.queue(("init", self.setup, routing))
        return worker

    def _send(self, worker: WorkerHandle, message: tuple[Any, ...]) -> None:
        if not self.lockstep:
            worker.channel.send(message)
            return
        first = not worker.channel.pending
        worker.channel.send(message)
        if first:  # one frame per loop iteration, with the clock it left at
            asyncio.get_running_loop().call_soon(self._flush_lockstep, worker)

    def _send_relay(self, uid: int, message: tuple[Any, ...]) -> None:
        """The relayed engines' answers to a worker, on their own socket, at once (the
        ``RelayHost`` calls this once per loop iteration and worker, off the clock)."""
        worker = self._by_uid.get(uid)
        if worker is None or worker.relay is None:
            return
        worker.relay.send(message)
        if worker.relay.flush() and self.lockstep:
            loop = asyncio.get_running_loop()
            worker.sent_at.append(loop.time())
            _owe(loop, 1)

    def _flush_lockstep(self, worker: WorkerHandle) -> None:
        loop = asyncio.get_running_loop()
        if worker.channel.flush():
            worker.sent_at.append(loop.time())
            _owe(loop, 1)

    def _on_frame(self, worker: WorkerHandle, frame: list[tuple[Any, ...]]) -> None:
        if frame[0][0] in ("ready", "fatal"):  # the answer to "init", before anything else
            self._on_init(worker, frame[0])
            return
        if not self.lockstep:
            self._handle(worker, frame)
            return
        number = frame[-1][3]  # ("idle", frames answered, CPU seconds they took, number)
        if number != worker.next_answer:  # it overtook an earlier one on the other socket
            worker.early[number] = frame
            return
        while True:
            self._take_answer(worker, frame)
            worker.next_answer += 1
            later = worker.early.pop(worker.next_answer, None)
            if later is None:
                return
            frame = later

    def _take_answer(self, worker: WorkerHandle, frame: list[tuple[Any, ...]]) -> None:
        """lockstep: a worker's answer takes effect once its own timeline got there."""
        loop = asyncio.get_running_loop()
        _, answered, cpu_s, _ = frame[-1]
        sent = [worker.sent_at.popleft() for _ in range(answered)]
        _owe(loop, -answered)
        start = max(sent[-1] if sent else loop.time(), worker.lane_free)
        worker.lane_free = start + cpu_s
        self.lane_busy_s += cpu_s
        messages = frame[:-1]
        relay = self.routing.relay if self.routing is not None else None
        if relay is not None and all(m[0] == "relay" for m in messages):
            loop.call_at(worker.lane_free, relay.receive_all, worker.uid, messages)
        else:
            loop.call_at(worker.lane_free, self._handle, worker, messages)

    def _route(self, worker: WorkerHandle, router: EngineRouter, message: tuple[Any, ...]) -> None:
        """A turn's message when the driver routes: into the router, its answer back."""
        kind = message[0]
        if kind in ("generate", "extend"):
            request = request_from_wire(message)
            key = episode_key(request.request_id)
            if kind == "extend":  # the prompt goes on from the episode's previous turn
                last = worker.last_turn.get(key)
                if last is None:  # cannot happen while both sides agree; fail the turn
                    error = "the driver holds no previous turn of this episode to extend"
                    self._send(worker, ("failed", request.request_id, error))
                    return
                request.prompt_ids = [*last[0], *last[1], *request.prompt_ids]
            worker.requests.add(request.request_id)
            # the router's future (no task per turn); its end answers the worker
            answer = router.start_generate(request)
            self._answers.add(answer)
            answer.add_done_callback(functools.partial(self._answer, worker, request, key))
        elif kind == "abort":
            self._spawn_task(router.abort(message[1]))
        elif kind == "forget":
            worker.last_turn.pop(message[1], None)
            router.forget(message[1])

    def _handle(self, worker: WorkerHandle, frame: list[tuple[Any, ...]]) -> None:
        for message in frame:
            kind = message[0]
            if kind in ("generate", "extend", "abort", "forget"):
                if self._router is not None:  # (workers that route do not send these)
                    self._route(worker, self._router, message)
            elif kind == "relay" and self.routing is not None and self.routing.relay is not None:
                self.routing.relay.receive(worker.uid, message[1])
            elif kind == "paused" and self.routing is not None:
                self.routing.on_report(worker.uid, *message[1])
                self.routing.on_paused(worker.uid)
            elif kind == "done":
                _, key, wire, failed_attempts, report = message
                if report is not None and self.routing is not None:
                    self.routing.on_report(worker.uid, *report)
                episode = worker.episodes.pop(key, None)
                self.played += 1
                if episode is None:
                    continue  # given up on (cancelled) meanwhile
                trajectory = trajectory_from_wire(wire)
                if episode.on_failure is not None:
                    for attempt in failed_attempts:
                        episode.on_failure(attempt)
                if self.on_episode_end is not None and not trajectory.failed:
                    self._spawn_task(self._finish(episode, trajectory, self.on_episode_end))
                elif not episode.future.done():
                    episode.future.set_result(trajectory)
            elif kind == "error":  # play_episode raised: a bug, surfaced as the scheduler would
                episode = worker.episodes.pop(message[1], None)
                if episode is not None and not episode.future.done():
                    episode.future.set_exception(RuntimeError(message[2]))

    @staticmethod
    async def _finish(
        episode: HeldEpisode, trajectory: Trajectory, hook: Callable[[Trajectory], Any]
    ) -> None:
        """Score a worker's episode here (a hook that raises or scores NaN fails it, as in
        ``EnvManager.run``: ``env_output.score_episode``), then hand it to ``play``."""
        await score_episode(trajectory, hook)
        if not episode.future.done():
            episode.future.set_result(trajectory)

    def _answer(
        self,
        worker: WorkerHandle,
        request: GenerationRequest,
        key: str,
        answer: asyncio.Future[GenerationResult],
    ) -> None:
        """A generation ended: its result (or error) goes back to the worker that asked."""
        self._answers.discard(answer)
        worker.requests.discard(request.request_id)
        if answer.cancelled():  # only at close: the worker is gone
            return
        error = answer.exception()
        if error is not None:  # the worker's episode records it as failed
            worker.last_turn.pop(key, None)
            self._send(worker, ("failed", request.request_id, f"{type(error).__name__}: {error}"))
            return
        result = answer.result()
        worker.last_turn[key] = (request.prompt_ids, result.token_ids)
        self._send(worker, result_to_wire(result))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.warning("env worker message failed: %r", task.exception())

    def _on_init(self, worker: WorkerHandle, answer: tuple[Any, ...]) -> None:
        _owe(asyncio.get_running_loop(), -1)
        if answer[0] == "fatal" and self._broken is None:
            self._broken = (
                f"an env worker could not build its EnvManager (the setup {self.setup!r}); its "
                f"error:\n{answer[1]}"
            )
        if not worker.ready.done():
            worker.ready.set_result(answer[0] == "ready")
        routing = self.routing
        if answer[0] == "ready" and routing is not None and not routing.paused:
            # a weight update may have begun or ended while it started (it was not "live")
            self._send(worker, ("resume", routing.version))
        elif answer[0] == "ready" and routing is not None and not worker.init_paused:
            self._send(worker, ("pause",))
        elif answer[0] == "ready" and self._router is not None and self._router.paused:
            self._send(worker, ("pause",))  # (it was not "live" when the pause began)

    def kill_worker(self, uid: int, reason: str) -> None:
        """Kill a worker that stopped answering; its episodes fail with ``reason``."""
        worker = self._by_uid.get(uid)
        if worker is not None:
            worker.killed = reason
            self._on_lost(worker)

    def _on_lost(self, worker: WorkerHandle) -> None:
        """Its socket closed, its process exited, or the driver kills it (or ``close`` ran)."""
        if not worker.ready.done():  # died before it was ready: do not start it again
            self._on_init(worker, ("fatal", "the worker process exited before it was ready"))
        if worker not in self._workers:
            return
        kill_group(worker.process)  # it is gone or going: so are the helpers its envs started
        worker.channel.close()
        loop = asyncio.get_running_loop()
        _owe(loop, -len(worker.sent_at))
        worker.sent_at.clear()
        self._by_uid.pop(worker.uid, None)
        if worker.relay is not None:
            worker.relay.close()
        if self.routing is not None:
            self.routing.on_lost(worker.uid)
        worker.waiting = bystanders(worker.requests)  # (none when the workers route)
        for request_id in list(worker.requests):
            if self._router is not None:
                self._spawn_task(self._router.abort(request_id))
        if self._broken is None:  # a fresh worker takes its place at once
            self.restarts += 1
            self._workers[self._workers.index(worker)] = self._spawn(worker.index)
        else:
            self._workers.remove(worker)
        self._spawn_task(self._bury(worker))

    async def _bury(self, worker: WorkerHandle) -> None:
        code = await self._reap(worker)
        why = f"was killed: {worker.killed}" if worker.killed else f"died ({describe_exit(code)})"
        _log.warning("env worker %d %s", worker.index, why)
        episodes, worker.episodes = worker.episodes, {}
        culprits = worker.calls.running()
        worker.calls.close()
        if culprits is None:  # the record overflowed: every episode not waiting may be one
            culprits = set(episodes) - worker.waiting
        replay = None if self._closed or self._broken is not None else self._replay
        settle_held(episodes, culprits, self._broken or f"env worker {worker.index} {why}", replay)

    async def _reap(self, worker: WorkerHandle) -> int | None:
        """The worker's exit code, once it exited (killed after ``close_timeout_s``)."""
        process = worker.process
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, process.wait, self.close_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            await loop.run_in_executor(None, process.wait)
        return process.returncode


def _owe(loop: asyncio.AbstractEventLoop, frames: int) -> None:
    """Tell a simulated clock that ``frames`` more (or fewer) answers are owed to it."""
    owe = getattr(loop, "owe", None)
    if owe is not None:
        owe(frames)
