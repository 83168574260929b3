"""``EnvPool``: many episodes over N self-healing env workers, behind an async API.

See ``envhub.pool`` (the package docstring) for the user-facing API. This module holds the
scheduling: where a new episode goes (the live worker with the fewest episodes), the
back-pressure when every slot is taken, the watchdog that kills a worker making no
progress, and the healing that turns a dead worker's episodes into ``EpisodeFailure``
records and starts a replacement.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal, Self

import orjson

from envhub.core import Message, assistant_message
from envhub.errors import EpisodeError, EpisodeOverError, ResetNeededError
from envhub.pool.base import (
    OP_CLOSE,
    OP_RESET,
    OP_STEP,
    OP_STEP_MESSAGE,
    STATUS_ENV_ERROR,
    STATUS_LOST,
    STATUS_OK,
    STATUS_USAGE_ERROR,
    EpisodeFailure,
    PoolStats,
    ResetResult,
    StepResult,
    Worker,
    dumps,
)
from envhub.pool.errors import (
    PoolClosedError,
    PoolFullError,
    UnknownEpisodeError,
    WorkerStartError,
)
from envhub.pool.framing import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["Backend", "EnvPool"]

Backend = Literal["process", "local", "inline", "ray"]
_BACKENDS = ("process", "local", "inline", "ray")
_PROBE_EVERY_S = 1.0  # how often the watchdog asks each idle worker whether it is still there
_USAGE_ERRORS: dict[str, type[EpisodeError]] = {
    "ResetNeededError": ResetNeededError,
    "EpisodeOverError": EpisodeOverError,
}


@dataclass(slots=True)
class _Episode:
    id: int
    worker: Any
    slot: int
    turn: int = 0
    op: int = 0
    failure: EpisodeFailure | None = None


class EnvPool:
    """N env workers hosting any number of episodes (see ``envhub.pool``)."""

    def __init__(
        self,
        env: Any,
        *,
        num_workers: int = 2,
        backend: Backend = "process",
        env_kwargs: dict[str, Any] | None = None,
        step_timeout_s: float = 30.0,
        reset_timeout_s: float | None = None,
        start_timeout_s: float = 60.0,
        max_episodes: int | None = None,
        ray_options: dict[str, Any] | None = None,
        restart_attempts: int = 5,
        retry_after_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {backend!r}")
        for name, value in (
            ("step_timeout_s", step_timeout_s),
            ("start_timeout_s", start_timeout_s),
            ("reset_timeout_s", reset_timeout_s),
        ):
            if value is not None and not (
                isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not (
            isinstance(retry_after_s, (int, float))
            and not isinstance(retry_after_s, bool)
            and 0 <= retry_after_s < math.inf
        ):
            raise ValueError(
                f"retry_after_s must be a number of seconds >= 0, got {retry_after_s!r}"
            )
        for name, count in (
            ("restart_attempts", restart_attempts),
            ("max_message_bytes", max_message_bytes),
        ):
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"{name} must be a positive int, got {count!r}")
        if max_episodes is not None and (not isinstance(max_episodes, int) or max_episodes < 1):
            raise ValueError(
                f"max_episodes must be a positive int or None (unbounded), got {max_episodes!r}"
            )
        from envhub.registry import EnvSpec, spec

        self.spec: EnvSpec = spec(env) if isinstance(env, str) else env
        if not isinstance(self.spec, EnvSpec):
            raise TypeError(
                f"env must be an env id or an EnvSpec, got {type(env).__name__}: {env!r:.80}"
            )
        self.env_id = self.spec.id
        self.backend = "process" if backend == "local" else backend
        self.num_workers = num_workers
        self.env_kwargs = dict(env_kwargs or {})
        self.step_timeout_s = float(step_timeout_s)
        self.reset_timeout_s = float(reset_timeout_s or step_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.max_episodes = max_episodes
        self.ray_options = dict(ray_options or {})
        self.restart_attempts = restart_attempts
        self.retry_after_s = float(retry_after_s)
        self.max_message_bytes = max_message_bytes
        self._slots: list[Any] = [None] * num_workers
        self._generation = [0] * num_workers
        self._episodes: dict[int, _Episode] = {}
        self._per_slot = [0] * num_workers
        self._ids = itertools.count(1)
        self._wakeup: asyncio.Future[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._respawns: dict[int, asyncio.Task[None]] = {}
        """Slot -> the task starting its replacement worker (one per slot at most)."""
        self._given_up: list[str] = [""] * num_workers
        """Per slot: why its replacement could not be started ("" while it may run)."""
        self._given_up_at = 0.0
        """Loop time of the last give-up: a reset ``retry_after_s`` later tries again."""
        self._started = False
        self._closed = False
        self._start_lock: asyncio.Lock | None = None
        self.last_worker_error = ""
        self._steps = self._resets = self._failures = self._restarts = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start every worker (``reset`` does this on first use); raises ``WorkerStartError``."""
        if self._closed:
            raise PoolClosedError(f"the pool for {self.env_id} is closed; build a new EnvPool")
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            results = await asyncio.gather(
                *(self._spawn(slot) for slot in range(self.num_workers)), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                await self.aclose()
                raise errors[0]
            self._started = True
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
            for slot, worker in enumerate(self._slots):  # it died while its siblings started
                if worker is None and not self._closed:
                    self._replace(slot)

    def _replace(self, slot: int) -> None:
        """Start replacing the worker of ``slot`` (once: a replacement being started stays)."""
        if slot not in self._respawns:
            self._restarts += 1
            self._respawns[slot] = asyncio.get_running_loop().create_task(self._respawn(slot))

    def _worker_class(self) -> Any:
        if self.backend == "process":
            from envhub.pool.local import ProcessWorker

            return ProcessWorker
        if self.backend == "inline":
            from envhub.pool.local import InlineWorker

            return InlineWorker
        from envhub.pool.ray import RayWorker

        return RayWorker

    async def _spawn(self, slot: int) -> None:
        """Start a worker for ``slot``; it takes the slot once its env built (the worker it
        replaces, if any is still there, is killed: a slot never holds two processes)."""
        self._generation[slot] += 1
        name = f"{self.backend}-{slot}.{self._generation[slot]}"
        options: dict[str, Any] = {"start_timeout_s": self.start_timeout_s}
        if self.backend == "ray":
            options["ray_options"] = self.ray_options
        if self.backend != "inline":
            options["max_message_bytes"] = self.max_message_bytes
        worker = self._worker_class()(name, self.spec, self.env_kwargs, self._on_dead, **options)
        worker.slot = slot
        await worker.start()
        if self._closed:
            await worker.stop()
            return
        old = self._slots[slot]
        self._slots[slot] = worker
        if old is not None and old is not worker:
            old.kill("worker_lost", f"worker {old.name} was replaced by {name}")
        self._given_up[slot] = ""
        self._notify()

    async def _respawn(self, slot: int) -> None:
        """Replace the worker of ``slot``: up to ``restart_attempts`` starts in a row, with a
        doubling pause between them, then give the slot up (waiting resets then raise)."""
        delay = 0.2
        try:
            for attempt in range(1, self.restart_attempts + 1):
                if self._closed:
                    return
                try:
                    await self._spawn(slot)
                    return
                except Exception as exc:  # noqa: BLE001 - a crash loop must not take the pool down
                    self.last_worker_error = f"{type(exc).__name__}: {exc}"
                if attempt < self.restart_attempts:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
            self._given_up[slot] = self.last_worker_error
            self._given_up_at = asyncio.get_running_loop().time()
        finally:
            if self._respawns.get(slot) is asyncio.current_task():
                del self._respawns[slot]
            self._notify()

    def _on_dead(self, worker: Worker, reason: str, detail: str) -> None:
        """The worker of a slot died or was killed: fail its episodes, then replace it.

        A worker that never took its slot (its start failed or was cancelled) hosts no
        episode: whoever started it sees the error, and nothing is restarted for it."""
        slot = getattr(worker, "slot", -1)
        if not (0 <= slot < len(self._slots) and self._slots[slot] is worker):
            return
        self._slots[slot] = None
        if self._closed or reason == "pool_closed":
            return
        culprit = worker.head_episode
        for ep in self._episodes.values():
            if ep.worker is worker and ep.failure is None:
                own = ep.id == culprit or culprit < 0
                why = reason if own else "worker_lost"
                text = (
                    detail
                    if own
                    else (
                        f"{detail} (while serving episode {culprit}; this episode shared the "
                        "worker)"
                    )
                )
                ep.failure = EpisodeFailure(
                    ep.id,
                    why,  # type: ignore[arg-type]
                    text,
                    worker.name,
                    ep.turn,
                )
                self._failures += 1
        if self._started:  # (one that dies while the pool starts is replaced by ``start``)
            self._replace(slot)

    def _notify(self) -> None:
        """Wake every reset waiting in ``_place`` (a worker or a slot freed up, or gave up)."""
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _watch(self) -> None:
        """Kill a worker whose head request ran past its timeout; probe the idle ones."""
        tick = max(0.01, min(0.25, self.step_timeout_s / 4, self.reset_timeout_s / 4))
        loop = asyncio.get_running_loop()
        next_probe = loop.time() + _PROBE_EVERY_S
        while not self._closed:
            await asyncio.sleep(tick)
            now = loop.time()
            if now >= next_probe:
                next_probe = now + _PROBE_EVERY_S
                for worker in self._slots:
                    if worker is not None and worker.alive and not worker.inflight:
                        worker.probe()
            for worker in self._slots:
                if worker is None or not worker.alive or not worker.inflight:
                    continue
                head = self._episodes.get(worker.head_episode)
                limit = (
                    self.reset_timeout_s
                    if head is not None and head.op == OP_RESET
                    else self.step_timeout_s
                )
                waited = now - worker.head_since
                if waited > limit:
                    what = "reset" if head is not None and head.op == OP_RESET else "step"
                    worker.kill(
                        "step_timeout",
                        (
                            f"episode {worker.head_episode}'s {what} ran {waited:.1f} s, past the "
                            f"{limit:g} s timeout; worker {worker.name} ({worker.location}) was "
                            "killed and is being replaced"
                        ),
                    )

    async def aclose(self) -> None:
        """Stop every worker and fail open episodes with ``pool_closed``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        respawns = list(self._respawns.values())
        for task in [self._watchdog, *respawns]:
            if task is not None:
                task.cancel()
        # a replacement being started is killed by its cancelled start (before we go on)
        await asyncio.gather(*respawns, return_exceptions=True)
        for ep in self._episodes.values():
            if ep.failure is None:
                ep.failure = EpisodeFailure(
                    ep.id, "pool_closed", "the pool was closed", ep.worker.name, ep.turn
                )
        workers = [w for w in self._slots if w is not None]
        self._slots = [None] * self.num_workers
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        self._notify()

    def close(self) -> None:
        """Kill every worker now, without waiting (for ``finally`` blocks and atexit)."""
        self._closed = True
        for task in [self._watchdog, *self._respawns.values()]:
            if task is not None:
                task.cancel()
        for worker in self._slots:
            if worker is not None:
                worker.kill("pool_closed", "the pool was closed")
        self._slots = [None] * self.num_workers

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ placement
    async def _place(self, wait_s: float | None) -> tuple[Any, int]:
        """The live worker with the fewest episodes, waiting for capacity or a replacement;
        ``WorkerStartError`` once no worker runs and every replacement gave up."""
        loop = asyncio.get_running_loop()
        deadline = None if wait_s is None else loop.time() + wait_s
        retried = False  # one more round of starts per reset at most, however long it waits
        while True:
            if self._closed:
                raise PoolClosedError(f"the pool for {self.env_id} is closed; build a new EnvPool")
            full = self.max_episodes is not None and len(self._episodes) >= self.max_episodes
            if not full:
                best = -1
                for slot, worker in enumerate(self._slots):
                    if (
                        worker is not None
                        and worker.alive
                        and (best < 0 or self._per_slot[slot] < self._per_slot[best])
                    ):
                        best = slot
                if best >= 0:
                    return self._slots[best], best
            retried = self._check_given_up(retry=not retried) or retried
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                why = (
                    f"all {self.max_episodes} episode slots are busy"
                    if full
                    else f"no worker is running (last error: {self.last_worker_error or 'none'})"
                )
                raise PoolFullError(
                    f"{self.env_id}: {why} after waiting {wait_s:g} s; close finished episodes or "
                    "raise max_episodes/num_workers"
                )
            if self._wakeup is None:
                self._wakeup = loop.create_future()
            try:  # (the timeout is a safety net: every change calls _notify)
                await asyncio.wait_for(asyncio.shield(self._wakeup), min(remaining or 1.0, 1.0))
            except TimeoutError:
                pass

    @property
    def given_up(self) -> bool:
        """No worker runs and none is being started: every replacement failed to start
        ``restart_attempts`` times in a row (resets raise ``WorkerStartError`` until a reset
        ``retry_after_s`` after that tries again)."""
        if self._respawns or any(w is not None and w.alive for w in self._slots):
            return False
        return any(self._given_up)

    def _check_given_up(self, *, retry: bool) -> bool:
        """When the pool has given up: start one more round of replacements if ``retry`` and
        ``retry_after_s`` has passed (True), else raise ``WorkerStartError``."""
        if not self.given_up:
            return False
        loop = asyncio.get_running_loop()
        wait = self._given_up_at + self.retry_after_s - loop.time()
        if retry and wait <= 0 and not self._closed:
            for slot, why in enumerate(self._given_up):
                if why and slot not in self._respawns:
                    self._given_up[slot] = ""
                    self._replace(slot)
            return True
        errors = [e for e in self._given_up if e]
        raise WorkerStartError(
            f"{self.env_id}: no env worker is running: each replacement failed to start "
            f"{self.restart_attempts} times in a row (restart_attempts={self.restart_attempts}); "
            f"last error: {errors[-1]}\nThe pool tries again in {max(wait, 0):.0f} s "
            f"(retry_after_s={self.retry_after_s:g}), on a reset; fix the env (the error above) "
            "meanwhile"
        )

    # ------------------------------------------------------------------ the API
    async def reset_json(
        self,
        episode: int | None = None,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        wait_s: float | None = None,
    ) -> tuple[int, bytes] | EpisodeFailure:
        """Like ``reset`` but return ``(episode, JSON bytes of {observation, info})``."""
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}: {seed!r:.40}")
        try:  # encode before placing: a refused reset must not hold a slot
            payload = dumps([seed, options or {}])
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"reset(seed={seed!r:.40}, options=...) cannot be sent to the env worker: {e}; "
                "seeds must fit in 64 bits and options must be JSON (str keys, 64-bit ints)"
            ) from None
        if not self._started:
            await self.start()
        ep = self._episodes.get(episode) if episode is not None else None
        if episode is not None and ep is None:
            raise UnknownEpisodeError(
                f"episode {episode} is not in this pool; call reset() without an episode to start "
                "one"
            )
        if ep is not None and ep.failure is not None:  # a fresh env on a live worker, same id
            self._drop(ep)
            ep = None
        placed = ep is None
        if ep is None:
            worker, slot = await self._place(wait_s)
            ep = _Episode(episode if episode is not None else next(self._ids), worker, slot)
            self._episodes[ep.id] = ep
            self._per_slot[slot] += 1
        ep.op = OP_RESET
        ep.turn = 0
        try:
            status, body = await ep.worker.submit(OP_RESET, ep.id, payload)
        except BaseException:  # the caller gave up (cancelled): the episode it placed goes
            if placed:
                self._abandon(ep)
            raise
        if status == STATUS_OK:
            self._resets += 1
            return ep.id, body
        if placed and status == STATUS_USAGE_ERROR:  # it raises: nobody learns the episode's id
            self._abandon(ep)
        return self._not_ok(ep, status, body)

    async def reset(
        self,
        episode: int | None = None,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        wait_s: float | None = None,
    ) -> ResetResult | EpisodeFailure:
        """Start an episode (or restart ``episode`` in place); see ``envhub.pool``."""
        result = await self.reset_json(episode, seed=seed, options=options, wait_s=wait_s)
        if isinstance(result, EpisodeFailure):
            return result
        data = orjson.loads(result[1])
        return ResetResult(result[0], data["observation"], data["info"])

    async def step_json(self, episode: int, action: str | Message) -> bytes | EpisodeFailure:
        """Like ``step`` but return the JSON bytes of ``{observation, reward, terminated, truncated,
        info}``."""
        ep = self._episodes.get(episode)
        if ep is None:
            raise UnknownEpisodeError(
                f"episode {episode} is not in this pool; call reset() to start an episode first"
            )
        if ep.failure is not None:
            return ep.failure
        if isinstance(action, str):
            op, payload = OP_STEP, action.encode()
        else:  # a structured action, checked here: a bad one is the caller's error, not the env's
            op, payload = OP_STEP_MESSAGE, orjson.dumps(assistant_message(action, "EnvPool"))
        ep.op = OP_STEP
        status, body = await ep.worker.submit(op, episode, payload)
        if status == STATUS_OK:
            ep.turn += 1
            self._steps += 1
            return body
        return self._not_ok(ep, status, body)

    async def step(self, episode: int, action: str | Message) -> StepResult | EpisodeFailure:
        """Apply ``action`` to ``episode``; a failure comes back as an ``EpisodeFailure``."""
        result = await self.step_json(episode, action)
        if isinstance(result, EpisodeFailure):
            return result
        d = orjson.loads(result)
        return StepResult(
            episode, d["observation"], d["reward"], d["terminated"], d["truncated"], d["info"]
        )

    async def close_episode(self, episode: int) -> None:
        """Free the episode's slot (its env is kept for reuse). Unknown ids are ignored."""
        ep = self._episodes.get(episode)
        if ep is None:
            return
        self._drop(ep)
        if ep.failure is None and ep.worker.alive:
            await ep.worker.submit(OP_CLOSE, ep.id, b"")

    def _abandon(self, ep: _Episode) -> None:
        """Forget an episode nobody will close (its reset was cancelled): the worker closes its
        env after the reset it is running, and the slot is free at once."""
        self._drop(ep)
        if ep.worker.alive:
            ep.worker.submit(OP_CLOSE, ep.id, b"")  # answered in order; nobody waits for it

    def _drop(self, ep: _Episode) -> None:
        if self._episodes.pop(ep.id, None) is not None:
            self._per_slot[ep.slot] -= 1
            self._notify()

    def _not_ok(self, ep: _Episode, status: int, body: bytes) -> EpisodeFailure:
        data = orjson.loads(body)
        if status == STATUS_ENV_ERROR:
            ep.failure = EpisodeFailure(
                ep.id, "env_error", data.get("message", ""), ep.worker.name, ep.turn
            )
            self._failures += 1
            return ep.failure
        if status == STATUS_LOST:
            if ep.failure is None:  # the death callback names it; this is a fallback
                ep.failure = EpisodeFailure(
                    ep.id,
                    data.get("reason", "worker_lost"),
                    data.get("detail", ""),
                    ep.worker.name,
                    ep.turn,
                )
                self._failures += 1
            return ep.failure
        error = _USAGE_ERRORS.get(data.get("error", ""), EpisodeError)
        raise error(data.get("message", "the env refused the call"))

    # ------------------------------------------------------------------ introspection
    def stats(self) -> PoolStats:
        live = [w for w in self._slots if w is not None]
        return PoolStats(
            backend=self.backend,
            workers=self.num_workers,
            workers_alive=sum(1 for w in live if w.alive),
            episodes=len(self._episodes),
            capacity=self.max_episodes,
            steps=self._steps,
            resets=self._resets,
            failures=self._failures,
            worker_restarts=self._restarts,
            placement={w.name: w.location for w in live},
        )

    def workers(self) -> list[Any]:
        """The live workers (for placement reports and tests)."""
        return [w for w in self._slots if w is not None]

    def episode_worker(self, episode: int) -> Any:
        """The worker hosting ``episode``."""
        ep = self._episodes.get(episode)
        if ep is None:
            raise UnknownEpisodeError(f"episode {episode} is not in this pool")
        return ep.worker

    @property
    def closed(self) -> bool:
        return self._closed
