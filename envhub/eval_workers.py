"""The worker threads of ``envhub.evaluate``: episodes played at once, each bounded in time.

``play_jobs(jobs, ...)`` plays every job (env id, agent, seed, sample) on ``concurrency``
threads and hands each result to ``on_done``. What it guarantees:

1. Every job ends as exactly one result, passed to ``on_done`` in the caller's thread in
   finishing order: the episode ``play`` returned, or a failed one made by ``fail``:
   ``env_error`` when the env could not be built; for an episode that ran past
   ``episode_timeout`` seconds, the side whose call was under way then by its ``EpisodeClock``
   (a hang is always the call under way, whatever the other side used before; building the
   env is the env's), or, caught between two calls, the side that used most of its time:
   ``env_timeout`` for the env (it hung or crawls), ``episode_timeout`` for the agent (for a
   model, a server slow to answer and a model whose replies take that long look the same from
   here). The failure's detail names the call under way and how long it had run, and each
   side's total.
2. Envs are not shared between threads (Playwright's are thread-bound): a worker builds one
   per env id on first use, reuses it, and closes its envs when it runs out of jobs. An env
   whose constructor failed is not built again by that worker; its other jobs fail at once.
3. A thread cannot be killed, so the worker of an overrun episode is *abandoned*: a daemon
   thread, it never keeps the process from exiting; what it returns is dropped, it takes no
   further job, and its envs are never used again (it closes them itself if its call ever
   returns). Its episode stops: the call under way runs to its end, but no further call starts
   (its clock refuses: no request to the model, no env step after the episode was reported
   failed). A fresh worker takes its place, so the run goes on at the same concurrency.
4. On Ctrl-C, or an error that is not the episode's (``EnvKwargsError``: the command line
   gave the env arguments it does not take), the workers take no new job and the error is
   raised here; every finished episode has already been handed to ``on_done``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from envhub.errors import EnvKwargsError, describe_error
from envhub.eval_records import CHARGED_TO_AGENT

__all__ = ["EpisodeClock", "Job", "play_jobs"]

Job = tuple[str, str, int, int]  # env id, agent name, seed, sample
Side = Literal["env", "agent"]
_log = logging.getLogger(__name__)
_EXITED = object()  # a worker's last message


class _Abandoned(BaseException):
    """Raised in the thread of an episode given up on as its next call would start (the
    module's guarantee 3). A ``BaseException``: code that catches everything (``run_episode``
    around an env call) ends the episode on it too, and its result is dropped."""


class EpisodeClock:
    """Where the time of one episode goes: into the env's calls or the agent's turns. The thread
    playing it times each call (``timing``); another reads the call under way and the totals
    (``read``) to say whose call an episode that ran out of time was stuck in (the module's
    guarantee 1), and ``abandon``s it, so that it starts no further call (guarantee 3)."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        """``now``: the clock read (seconds; a test's own)."""
        self._now = now
        self._lock = threading.Lock()
        self._spent = {"env": 0.0, "agent": 0.0}
        self._running: tuple[Side, float] | None = None  # the call under way, since when
        self._abandoned = False

    @contextlib.contextmanager
    def timing(self, side: Side) -> Iterator[None]:
        """Count the time of the block as ``side``'s; once the episode is abandoned, raise
        ``_Abandoned`` instead of starting it."""
        with self._lock:
            if self._abandoned:
                raise _Abandoned
            start = self._now()
            self._running = side, start
        try:
            yield
        finally:
            with self._lock:
                self._spent[side] += self._now() - start
                self._running = None

    def abandon(self) -> None:
        """The episode was given up on: no block starts from now on (a call under way runs on)."""
        with self._lock:
            self._abandoned = True

    def read(self) -> tuple[dict[Side, float], tuple[Side, float] | None]:
        """Seconds in each side's calls so far, the call under way included; and the call under
        way (its side, seconds so far), or None between calls."""
        with self._lock:
            spent: dict[Side, float] = {"env": self._spent["env"], "agent": self._spent["agent"]}
            running = None
            if self._running is not None:
                side, since = self._running
                running = side, self._now() - since
                spent[side] += running[1]
        return spent, running


def play_jobs(
    jobs: list[Job],
    *,
    make_env: Callable[[str], Any],
    play: Callable[[Any, Job, EpisodeClock], Any],
    fail: Callable[[Job, str, str, float], Any],
    on_done: Callable[[Any], None],
    concurrency: int,
    episode_timeout: float | None = None,
) -> None:
    """Play ``jobs``: ``play(env, job, clock)`` on a worker's env for ``job[0]``, timing the
    env's calls and the agent's turns on ``clock``; ``fail(job, reason, detail, seconds)`` for
    a job that could not be played (see the module's guarantees)."""
    if episode_timeout is not None and not episode_timeout > 0:
        raise ValueError(f"episode_timeout must be > 0 seconds or None, got {episode_timeout!r}")
    pool = _Pool(jobs, make_env, play, fail, max(1, min(concurrency, len(jobs))))
    try:
        pool.run(on_done, episode_timeout)
    finally:
        pool.stop.set()


class _Worker:
    """One thread, and the job it plays now (``None`` between jobs) or that it is closing its
    envs, since ``started``."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.job: Job | None = None
        self.clock = EpisodeClock()  # the job's
        self.closing = False
        self.started = 0.0
        self.abandoned = False
        self.thread = threading.Thread(target=self.work, name="envhub-eval", daemon=True)
        self.thread.start()

    def work(self) -> None:
        pool = self.pool
        envs: dict[str, Any] = {}
        broken: dict[str, str] = {}
        try:
            while not pool.stop.is_set() and (job := pool.todo.get()) is not None:
                with pool.lock:
                    self.job, self.started = job, time.monotonic()
                    self.clock = EpisodeClock()
                try:
                    result = self.play(job, envs, broken)
                except _Abandoned:  # given up on (already reported): plays no further call
                    return
                with pool.lock:
                    if self.abandoned:  # timed out: already reported, envs never reused
                        return
                    self.job = None
                    pool.done.put((self, result))
        except BaseException as error:  # noqa: BLE001 - Ctrl-C or a bug: the caller raises it
            pool.done.put((self, error))
        finally:
            with pool.lock:
                self.closing, self.started = True, time.monotonic()
            for env in envs.values():
                try:
                    env.close()
                except KeyboardInterrupt:
                    raise
                except BaseException as error:  # noqa: BLE001 - must not hide the results
                    _log.warning("closing an env failed: %s: %s", type(error).__name__, error)
            with pool.lock:
                if not self.abandoned:
                    pool.done.put((self, _EXITED))

    def play(self, job: Job, envs: dict[str, Any], broken: dict[str, str]) -> Any:
        env_id = job[0]
        if env_id not in envs and env_id not in broken:
            try:
                with self.clock.timing("env"):
                    envs[env_id] = self.pool.make_env(env_id)
            except (KeyboardInterrupt, EnvKwargsError):
                raise
            except BaseException as error:  # noqa: BLE001 - env code may raise anything
                broken[env_id] = f"make: {describe_error(error)}"
        if env_id in broken:
            return self.pool.fail(job, "env_error", broken[env_id], 0.0)
        return self.pool.play(envs[env_id], job, self.clock)


class _Pool:
    def __init__(
        self,
        jobs: list[Job],
        make_env: Callable[[str], Any],
        play: Callable[[Any, Job, EpisodeClock], Any],
        fail: Callable[[Job, str, str, float], Any],
        workers: int,
    ) -> None:
        self.make_env, self.play, self.fail = make_env, play, fail
        self.todo: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.done: queue.SimpleQueue[tuple[_Worker, Any]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        for job in jobs:
            self.todo.put(job)
        for _ in range(workers):  # one end marker per worker (a replacement takes its own's)
            self.todo.put(None)
        self.workers = {_Worker(self) for _ in range(workers)}

    def run(self, on_done: Callable[[Any], None], episode_timeout: float | None) -> None:
        while self.workers:
            try:
                worker, item = self.done.get(timeout=self._wait(episode_timeout))
            except queue.Empty:
                for result in self._abandon_overdue(episode_timeout or 0.0):
                    on_done(result)
                continue
            if item is _EXITED:
                self.workers.discard(worker)
            elif isinstance(item, BaseException):
                raise item
            else:
                on_done(item)

    def _wait(self, episode_timeout: float | None) -> float | None:
        """Seconds until the first running episode is overdue (None: no bound)."""
        if episode_timeout is None:
            return None
        with self.lock:
            starts = [w.started for w in self.workers if w.job is not None or w.closing]
        if not starts:
            return episode_timeout
        return max(0.0, min(starts) + episode_timeout - time.monotonic())

    def _abandon_overdue(self, episode_timeout: float) -> list[Any]:
        """Give up on the workers busy for ``episode_timeout`` seconds; the failed episodes."""
        now = time.monotonic()
        with self.lock:
            overdue = [
                (w, w.job, w.clock, now - w.started)
                for w in self.workers
                if (w.job is not None or w.closing) and now - w.started >= episode_timeout
            ]
            for worker, _, clock, _ in overdue:
                worker.abandoned = True
                clock.abandon()
                self.workers.discard(worker)
        results = []
        for _, job, clock, seconds in overdue:
            if job is None:  # done with its jobs, stuck in an env's close(): leave it be
                _log.warning("an env's close() did not return in %g s; left running", seconds)
                continue
            results.append(self.fail(job, *_out_of_time(clock, episode_timeout), seconds))
            self.workers.add(_Worker(self))
        return results


def _out_of_time(clock: EpisodeClock, episode_timeout: float) -> tuple[str, str]:
    """The failure reason and detail of an episode that ran past ``episode_timeout``: the side
    whose call was under way (a hang is the call under way), or between calls the side that used
    most of its time (the module's guarantee 1)."""
    spent, running = clock.read()
    totals = (
        f"in all: the agent's turns {spent['agent']:.1f} s, the env's calls {spent['env']:.1f} s"
    )
    if running is not None:
        side, seconds = running
        call = CHARGED_TO_AGENT if side == "agent" else "in the env's call"
        when = f"{call}, under way for {seconds:.1f} s ({totals})"
    else:
        side = "env" if spent["env"] > spent["agent"] else "agent"
        calls = f"{CHARGED_TO_AGENT}s" if side == "agent" else "in the env's calls"
        when = f"between two calls, most of it {calls} ({totals})"
    return "env_timeout" if side == "env" else "episode_timeout", (
        f"the episode ran past --episode-timeout {episode_timeout:g} s {when}; its thread was "
        "abandoned and its env is not reused"
    )
