"""The worker threads of ``envhub.evaluate``: episodes played at once, each bounded in time.

``play_jobs(jobs, ...)`` plays every job (env id, agent, seed, sample) on ``concurrency``
threads and hands each result to ``on_done``. What it guarantees:

1. Every job ends as exactly one result, passed to ``on_done`` in the caller's thread in
   finishing order: the episode ``play`` returned, or a failed one made by ``fail``:
   ``env_error`` when the env could not be built, ``episode_timeout`` when the episode ran
   past ``episode_timeout`` seconds.
2. Envs are not shared between threads (Playwright's are thread-bound): a worker builds one
   per env id on first use, reuses it, and closes its envs when it runs out of jobs. An env
   whose constructor failed is not built again by that worker; its other jobs fail at once.
3. A thread cannot be killed, so the worker of an overrun episode is *abandoned*: a daemon
   thread, it never keeps the process from exiting; what it returns is dropped, it takes no
   further job, and its envs are never used again (it closes them itself if its call ever
   returns). A fresh worker takes its place, so the run goes on at the same concurrency.
4. On Ctrl-C, or an error that is not the episode's (``EnvKwargsError``: the command line
   gave the env arguments it does not take), the workers take no new job and the error is
   raised here; every finished episode has already been handed to ``on_done``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from envhub.errors import EnvKwargsError, describe_error

__all__ = ["Job", "play_jobs"]

Job = tuple[str, str, int, int]  # env id, agent name, seed, sample
_log = logging.getLogger(__name__)
_EXITED = object()  # a worker's last message


def play_jobs(
    jobs: list[Job],
    *,
    make_env: Callable[[str], Any],
    play: Callable[[Any, Job], Any],
    fail: Callable[[Job, str, str, float], Any],
    on_done: Callable[[Any], None],
    concurrency: int,
    episode_timeout: float | None = None,
) -> None:
    """Play ``jobs``: ``play(env, job)`` on a worker's env for ``job[0]``; ``fail(job, reason,
    detail, seconds)`` for a job that could not be played (see the module's guarantees)."""
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
                result = self.play(job, envs, broken)
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
                envs[env_id] = self.pool.make_env(env_id)
            except (KeyboardInterrupt, EnvKwargsError):
                raise
            except BaseException as error:  # noqa: BLE001 - env code may raise anything
                broken[env_id] = f"make: {describe_error(error)}"
        if env_id in broken:
            return self.pool.fail(job, "env_error", broken[env_id], 0.0)
        return self.pool.play(envs[env_id], job)


class _Pool:
    def __init__(
        self,
        jobs: list[Job],
        make_env: Callable[[str], Any],
        play: Callable[[Any, Job], Any],
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
                (w, w.job, now - w.started)
                for w in self.workers
                if (w.job is not None or w.closing) and now - w.started >= episode_timeout
            ]
            for worker, _, _ in overdue:
                worker.abandoned = True
                self.workers.discard(worker)
        detail = (
            f"the episode ran past --episode-timeout {episode_timeout:g} s; its thread was "
            "abandoned and its env is not reused"
        )
        results = []
        for _, job, seconds in overdue:
            if job is None:  # done with its jobs, stuck in an env's close(): leave it be
                _log.warning("an env's close() did not return in %g s; left running", seconds)
                continue
            results.append(self.fail(job, "episode_timeout", detail, seconds))
            self.workers.add(_Worker(self))
        return results
