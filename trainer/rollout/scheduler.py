"""``RolloutScheduler``: every sample's lifecycle, from group start to the training batch.

Episodes come in *groups* (one task, ``group_size`` plays, compared by GRPO/RLOO). The
scheduler keeps groups running on an ``EngineRouter`` and hands out a batch of
``num_groups`` finished groups as soon as that many are ready::

    start group -> episodes play (EnvManager, or EnvWorkers' processes) -> group done
        -> failed?   (an episode still failed after retries)  -> recorded, replaced
        -> filtered? (dynamic sampling: all rewards equal)    -> recorded, replaced
        -> stale?    (async: oldest token > max_staleness)    -> recorded, replaced
        -> ready queue -> next_batch() takes each env's quota of num_groups groups

Modes:

``sync``  (on-policy) groups run only while a batch is being collected;
          ``ceil(num_groups * redundancy)`` start at once, and when the batch is full the
          surplus is aborted in the engine and its envs closed (in the background: an env
          call still running does not hold the batch). Weights change only between batches,
          so every token has the version being trained.
``async`` rollouts keep running while the trainer trains (up to
          ``ceil(num_groups * redundancy) + num_groups * (max_staleness - 1)`` groups in play).
          A weight update preempts in-flight generations, which resume under the new
          weights with their tokens kept (per-token versions recorded); groups that can no
          longer meet the bound are aborted at once, and no group whose oldest token is more
          than ``max_staleness`` versions behind the trained policy enters a batch.

Task seeds are drawn in order from ``(seed, group number)`` exactly like ``plan_groups``
(the pipeline starts at ``first_group=num_groups``, step 1's first group), so ``sync`` with
no redundancy, no filter and no failures plays the same tasks, with the same group ids, as
the plain batched rollout, step by step. With a mix of envs every batch holds each env's
quota, its step's ``plan_groups`` partition, and groups beyond the plan (replacements,
redundancy, ``async``'s next batches) play the envs short of theirs (``env_quotas``): the
fastest env does not fill the batch. A batch's groups are in group order, not the order they
finished (gradient accumulation does not depend on timing). Failures never hang the run: an
episode whose env raised, timed out or whose generation errored is replayed on a fresh env
(``max_retries``), then its group is replaced; ``RolloutError`` stops the run when
``max_failed_groups`` groups of one env in a row failed (an env of a mix that always fails
stops the run too, named; the first failed group of each env is logged as a warning, with its
reason).

What the policy played is reported beside what is trained: every group that played out
(``group_in_play``: no episode failed or was cut short), trained or not, counts in the next
batch's ``rollout/played_*`` (``batch_metrics``), since the trained groups are a filtered or a
first-finished sample of them.

Cancelled groups (the sync surplus, groups doomed by a weight update, those running at
``close``) *drain*: their requests are aborted at once, and their episodes end and close their
envs in the background, counted among the groups in play until they have (so an env call that
takes long never holds a batch or a weight update, and never lets more envs open than
``capacity`` allows); ``close`` waits ``close_timeout_s`` for them, then cancels them.

``LoopThread`` runs the scheduler's event loop in a background thread so a blocking
trainer (``AgenticPipeline.fit``) can train while rollouts continue.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from trainer.config import RolloutConfig, TrainerConfig
from trainer.rollout.batch_metrics import PlayedGroups, batch_metrics
from trainer.rollout.env_manager import EnvManager, EnvSource, Sampling
from trainer.rollout.env_quotas import EnvQuotas
from trainer.rollout.env_workers import EnvWorkers
from trainer.rollout.group_failures import GroupFailures
from trainer.rollout.group_in_play import GroupInPlay
from trainer.rollout.groups import EVAL_SEED_BASE, EpisodeSpec, play_episode
from trainer.rollout.router import EngineRouter
from trainer.rollout.trajectory import Trajectory
from trainer.rollout.worker_routing import WorkerRouters
from trainer.strategies.base import Weights

__all__ = ["LoopThread", "RolloutBatch", "RolloutScheduler", "SchedulerConfig"]

T = TypeVar("T")
Mode = Literal["sync", "async"]
_ROLLOUT_DEFAULTS = {name: field.default for name, field in RolloutConfig.model_fields.items()}
"""The scheduler's defaults are the config's (``rollout.*``): one set of defaults."""


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler produces and how (see the module docstring)."""

    num_groups: int
    """Groups per training batch."""
    group_size: int
    """Episodes per group (same task and seed)."""
    env_ids: tuple[str, ...]
    """Tasks are spread over these envs (``groups.env_for_group``)."""
    env_weights: tuple[float, ...] = ()
    """Each env's share of every batch's groups (partitioned as ``plan_groups`` does:
    ``trainer.rollout.env_quotas``); empty or equal: round-robin."""
    env_group_sizes: tuple[int, ...] = ()
    """Each env's episodes per group (``env_ids`` order); empty: ``group_size`` for all."""
    seed: int = 0
    mode: Mode = "sync"
    redundancy: float = _ROLLOUT_DEFAULTS["redundancy"]
    """Groups started per group needed (>= 1); the first of each env to finish fill its quota
    of the batch."""
    max_staleness: int = _ROLLOUT_DEFAULTS["max_staleness"]
    """``async``: most policy versions a trained token may lag the trained policy."""
    dynamic_sampling: bool = _ROLLOUT_DEFAULTS["dynamic_sampling"]
    """Drop groups whose episode rewards are all equal (they carry no GRPO signal)."""
    max_filtered_per_batch: int | None = None
    """Filtered groups per batch after which the filter lets groups through (default 4x
    ``num_groups``), so a policy that always wins or always loses cannot stall training."""
    max_retries: int = 2
    """Replays of a failed episode (fresh env, same task) before its group is replaced."""
    max_failed_groups: int | None = None
    """Consecutive failed groups of one env that stop the run (default ``2 * num_groups + 2``)."""

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> SchedulerConfig:
        """A run's scheduler: ``rollout.mode`` ``batch`` and ``sync`` are both the ``sync`` mode
        (``batch`` only forbids redundancy and dynamic sampling), ``async`` is ``async``."""
        rollout, env = cfg.rollout, cfg.env
        return cls(
            num_groups=env.num_groups,
            group_size=env.group_size,
            env_ids=tuple(env.ids),
            env_weights=tuple(env.weights),
            env_group_sizes=tuple(env.group_sizes),
            seed=cfg.seed,
            mode="async" if rollout.mode == "async" else "sync",
            redundancy=rollout.redundancy,
            max_staleness=rollout.max_staleness,
            dynamic_sampling=rollout.dynamic_sampling,
        )

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"scheduler mode {self.mode!r} is unknown; use 'sync' or 'async'")
        if self.redundancy < 1.0:
            raise ValueError(
                f"redundancy {self.redundancy} starts fewer groups than a batch needs; use >= 1.0"
            )
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.num_groups <= 0 or self.group_size <= 0 or not self.env_ids:
            raise ValueError("num_groups and group_size must be > 0 and env_ids not empty")

    def group_size_of(self, env_id: str) -> int:
        """Episodes per group of ``env_id``."""
        if self.env_group_sizes:
            return self.env_group_sizes[self.env_ids.index(env_id)]
        return self.group_size

    @property
    def capacity(self) -> int:
        """Groups in play (running + ready) at most: ``ceil(num_groups * redundancy)``, plus in
        ``async`` one more batch per staleness step beyond the first. With ``max_staleness=1``
        the groups refilled when a batch is taken play during the train phase and make the
        next batch one version behind; a larger buffer would only produce groups that go stale."""
        running = math.ceil(self.num_groups * self.redundancy)
        return running + (
            self.num_groups * max(self.max_staleness - 1, 0) if self.mode == "async" else 0
        )


@dataclass
class RolloutBatch:
    """One training batch: ``num_groups * group_size`` trajectories (group after group)."""

    trajectories: list[Trajectory]
    failed: list[Trajectory]
    """Failed attempts recorded since the previous batch (never trained on)."""
    metrics: dict[str, float]
    version: int
    """The policy version this batch is trained at (staleness is measured against it)."""


class RolloutScheduler:
    """Keeps groups playing and hands out batches (see the module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        manager: EnvManager | EnvWorkers,
        router: EngineRouter | WorkerRouters,
        source: EnvSource,
        sampling: Sampling,
        *,
        first_group: int = 0,
        close_timeout_s: float = 10.0,
    ) -> None:
        """``close_timeout_s``: how long ``close`` waits for cancelled episodes to end and close
        their envs before it cancels them (an env call that hangs is abandoned)."""
        if manager.engine is not router:
            raise ValueError(
                "the EnvManager (or EnvWorkers) must generate through the scheduler's "
                "EngineRouter (manager.engine)"
            )
        self.cfg, self.manager, self.router, self.source, self.sampling = (
            config,
            manager,
            router,
            source,
            sampling,
        )
        self.next_group = first_group
        """The next task number to start (checkpointed so a resumed run does not repeat tasks)."""
        self._quotas = EnvQuotas(
            config.env_ids, config.env_weights, config.num_groups, first_group=first_group
        )
        self.close_timeout_s = close_timeout_s
        self._running: dict[int, GroupInPlay] = {}
        self._ready: list[GroupInPlay] = []
        self._draining: dict[int, GroupInPlay] = {}
        """Cancelled groups whose episodes have not ended yet (in play for ``capacity``)."""
        self._fresh = (-1, 0)
        """(version, n): the first n ready groups met the staleness bound at that version."""
        self._failed: list[Trajectory] = []
        self._collecting = config.mode == "async"
        self._changed: asyncio.Event | None = None
        self._failures = GroupFailures(
            config.max_failed_groups or 2 * config.num_groups + 2,
            max_retries=config.max_retries,
            mix=len(config.env_ids) > 1,
        )
        self._filtered_this_batch = 0
        self._counts: collections.Counter[str] = collections.Counter()
        """Events since the last batch's metrics (groups filtered, failed, aborted, ...)."""
        self._played = PlayedGroups()
        """Groups played out since the last batch's metrics (``rollout/played_*``)."""
        self._weight_pause_s = 0.0
        """Seconds rollouts were paused for weight updates since the last batch's metrics."""
        self._closed = False
        self._restarting = False
        """True while ``restart_from`` aborts: no group starts (it would take an old number)."""

    # ------------------------------------------------------------------ public
    async def next_batch(self) -> RolloutBatch:
        """Wait until every env's quota of groups is ready and return them as one batch (in
        group order)."""
        self._changed = self._changed or asyncio.Event()
        self._collecting = True
        self._fill()
        while True:
            self._drop_stale_ready()
            if self._quotas.met(self._ready):
                break
            failing = self._failures.stopping()
            if failing is not None:
                failures = [t.failure or "unknown" for t in self._failed if t.env_id == failing]
                raise self._failures.error(failing, failures[-20:])
            self._changed.clear()
            self._fill()
            await self._changed.wait()
        self._ready.sort(key=lambda g: (g.oldest_version() or 0, g.finished_at))
        taken, self._ready = self._quotas.take(self._ready)
        self._fresh = (self._fresh[0], len(self._ready))  # what is left was checked just now
        self._quotas.next_window()
        for group in taken:
            self._count(group, False)
        taken.sort(key=lambda g: g.number)
        if self.cfg.mode == "sync":
            self._collecting = False
            surplus = list(self._running.values()) + self._ready
            self._ready, self._fresh = [], (-1, 0)
            await self._cancel_all(surplus, "aborted_surplus_episodes")
        trajectories = [t for g in taken for t in g.trajectories()]
        failed, self._failed = self._failed, []
        metrics = self._metrics(trajectories)
        self._filtered_this_batch = 0
        self._fill()
        return RolloutBatch(trajectories, failed, metrics, self.router.version)

    async def update_weights(self, weights: Weights | Callable[[], Any]) -> float:
        """Load new weights (preempting and resuming in-flight turns); returns seconds paused.

        ``weights``: tensors for every engine, or a callable that loads them itself (see
        ``EngineRouter.update_weights_live``). Then aborts running groups that can no longer
        meet ``max_staleness``: those with a token older than it allows (``_oldest_token``).
        No group starts while the weights load (the router holds its turns meanwhile); those
        due start once they have loaded."""
        paused = await self.router.update_weights_live(weights)
        self._weight_pause_s += paused
        if self.cfg.mode == "async":
            bound = self.router.version - self.cfg.max_staleness
            doomed = [
                group
                for group in self._running.values()
                if (oldest := self._oldest_token(group)) is not None and oldest < bound
            ]
            await self._cancel_all(doomed, "stale_aborted_groups")
            self._drop_stale_ready()
            self._fill()
        return paused

    async def close(self) -> None:
        """Abort everything still running (engine requests and envs): wait ``close_timeout_s``
        for the episodes to end and close their envs, then cancel those that have not."""
        self._closed = True
        self._collecting = False
        await self._cancel_all(list(self._running.values()), "aborted_at_close")
        tasks = [task for group in self._draining.values() for task in group.tasks]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.close_timeout_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=self.close_timeout_s)

    def state_dict(self) -> dict[str, int]:
        return {"next_group": self.next_group}

    async def restart_from(self, next_group: int, *, window: int | None = None) -> None:
        """Continue numbering tasks at ``next_group`` (a resumed run's counter). Groups already
        in play were numbered from the old counter (they would repeat trained tasks): they
        are aborted and dropped. New groups start at the next ``update_weights`` or
        ``next_batch`` (a resume loads the checkpoint's weights first). ``window``: the next
        step's first ``plan_groups`` number, whose envs set its quotas (default ``next_group``,
        which is it unless groups were replaced or started beyond the plan)."""
        in_play = list(self._running.values()) + self._ready
        self._ready, self._fresh = [], (-1, 0)
        self._restarting = True  # an aborted group's end would start a replacement: not yet
        try:
            await self._cancel_all(in_play, "aborted_at_resume")
            tasks = [task for group in in_play for task in group.tasks]
            if tasks:  # drained before the counter moves (a group ending later would start one)
                await asyncio.wait(tasks)
            for group in in_play:  # (their ``_group_done`` may come later: it finds them gone)
                if self._draining.pop(group.number, None) is not None:
                    self._forget(group)
        finally:
            self._restarting = False
        self._counts.pop("aborted_at_resume", None)
        self._played = PlayedGroups()  # (none of them will be trained)
        self.next_group = next_group
        self._quotas.restart(next_group if window is None else window)

    # ------------------------------------------------------------------ groups
    def _fill(self) -> None:
        """Start groups up to ``capacity``; none while a weight update holds the router (a group
        started then would count as started under the old version, its first turn waiting for
        the new one: ``update_weights`` fills once the weights have loaded)."""
        while (
            self._collecting
            and not self._closed
            and not self._restarting
            and not self.router.paused
            and len(self._running) + len(self._ready) + len(self._draining) < self.cfg.capacity
        ):
            self._start_group()

    def _start_group(self) -> None:
        number = self.next_group
        self.next_group += 1
        group = GroupInPlay(
            number,
            self._quotas.env_for(number),
            (self.cfg.seed * 7_919 + number) % EVAL_SEED_BASE,
            started_version=self.router.version,
        )
        self._count(group, True)
        for index in range(self.cfg.group_size_of(group.env_id)):
            key = f"g{number}e{index}"
            group.keys.append(key)
            group.tasks.append(asyncio.ensure_future(self._play(group, key)))
        self._running[number] = group
        gathered = asyncio.gather(*group.tasks, return_exceptions=True)
        gathered.add_done_callback(lambda _: self._group_done(group))

    async def _play(self, group: GroupInPlay, key: str) -> Trajectory:
        """One episode with replays on fresh envs (``groups.play_episode``); returns the last
        attempt."""

        def failed(trajectory: Trajectory) -> None:
            self._failed.append(trajectory)
            self._counts["failed_attempts"] += 1

        trajectory = await play_episode(
            self.manager,
            self.source,
            EpisodeSpec(group.env_id, group.seed, group.number),
            self.sampling,
            max_retries=self.cfg.max_retries,
            key=key,
            on_failure=failed,
            stop=lambda: group.cancelled,
        )
        if trajectory.failed and not group.cancelled:  # every replay failed: the episode is lost
            failed(trajectory)
            self._counts["lost_episodes"] += 1
        return trajectory

    def _group_done(self, group: GroupInPlay) -> None:
        self._running.pop(group.number, None)
        group.finished_at = time.monotonic()
        if any(task.cancelled() for task in group.tasks):  # the loop shut down under it
            group.cancelled = True
        ready = False
        if group.number in self._draining:  # cancelled while it played: it has drained now
            del self._draining[group.number]
            self._forget(group)
        elif not group.cancelled:
            ready = self._judge(group)
        if group.cancelled and group.played_out():  # it ended before its abort could cut it
            self._played.add(group.trajectories())
        if ready:
            self._ready.append(group)
        else:  # failed, filtered or cancelled: out of play
            self._count(group, False)
        self._fill()
        if self._changed is not None:
            self._changed.set()

    def _judge(self, group: GroupInPlay) -> bool:
        """Whether a finished group is ready for a batch: not when it failed, nor when dynamic
        sampling filters it (each recorded). Every group not failed played out."""
        errors = [task.exception() for task in group.tasks if task.exception() is not None]
        for error in errors:  # a bug, not an env failure: surface it rather than loop forever
            self._counts.update(("failed_attempts", "lost_episodes"))
            self._failed.append(
                Trajectory(
                    group.env_id,
                    group.seed,
                    group.number,
                    failed=True,
                    failure=f"scheduler error {type(error).__name__}: {error}"[:500],
                )
            )
        trajectories = [] if errors else group.trajectories()
        if errors or any(t.failed for t in trajectories):
            self._counts["failed_groups"] += 1
            failed = [t.failure for t in self._failed if t.env_id == group.env_id]
            self._failures.failed(group.env_id, failed[-1] if failed else None)
            return False
        self._failures.succeeded(group.env_id)
        self._played.add(trajectories)
        rewards = {round(t.episode_reward, 9) for t in trajectories}
        if self.cfg.dynamic_sampling and len(rewards) == 1 and len(trajectories) > 1:
            limit = self.cfg.max_filtered_per_batch
            if self._filtered_this_batch < (4 * self.cfg.num_groups if limit is None else limit):
                self._filtered_this_batch += 1
                self._counts["filtered_groups"] += 1
                return False
            self._counts["filter_passed_over_limit"] += 1
        return True

    async def _cancel_all(self, groups: list[GroupInPlay], reason: str) -> None:
        """Cancel ``groups``: abort their requests; their episodes drain in the background
        (module docstring). They are marked cancelled at once, before anything else runs: a
        group that ends while the others' aborts go out is then not judged ready (it would
        enter a later batch, generated by an older policy)."""
        for group in groups:
            group.cancelled = True
        await asyncio.gather(*(self._cancel(group, reason) for group in groups))

    async def _cancel(self, group: GroupInPlay, reason: str) -> None:
        """Abort a group's generations in the engine; its episodes end and close their envs in
        the background (``_draining`` until ``_group_done``)."""
        group.cancelled = True
        self._running.pop(group.number, None)
        self._count(group, False)
        if reason == "aborted_surplus_episodes":  # every episode thrown away, played out or cut
            self._counts[reason] += len(group.tasks)
        elif reason == "stale_aborted_groups":
            self._counts[reason] += 1
        else:
            self._counts[reason] += sum(not task.done() for task in group.tasks)
        if isinstance(self.manager, EnvWorkers):  # no replays after the aborted attempts
            self.manager.stop(group.keys)
        await asyncio.gather(
            *(
                self.router.abort_episode(f"{key}a{attempt}")  # one engine round trip for all
                for key in group.keys
                for attempt in range(1 + self.cfg.max_retries)
            )
        )
        if all(task.done() for task in group.tasks):
            self._forget(group)
        else:
            self._draining[group.number] = group

    def _count(self, group: GroupInPlay, in_play: bool) -> None:
        """Count ``group`` in (or out of) its env's groups in play, once either way."""
        if group.counted != in_play:
            group.counted = in_play
            (self._quotas.started if in_play else self._quotas.ended)(group.env_id)

    def _oldest_token(self, group: GroupInPlay) -> int | None:
        """The version of the oldest token a running group has generated (None before one):
        its ended episodes' and, of the others, what the router saw. Not the version it started
        under: its first token may come much later (a slow env reset). A router in the env
        workers (``WorkerRouters``) does not say: then that version (no token is older)."""
        if not isinstance(self.router, EngineRouter):
            return group.started_version
        versions = []
        for task, key in zip(group.tasks, group.keys, strict=True):
            if not task.done():
                versions.append(self.router.oldest_version(key))
            elif not task.cancelled() and task.exception() is None:
                versions.append(task.result().oldest_version)
        return min((version for version in versions if version is not None), default=None)

    def _forget(self, group: GroupInPlay) -> None:
        """Drop the abort marks of an ended cancelled group: an attempt that never reached the
        router (its env did not start, or its episode had ended) left them."""
        if isinstance(self.router, EngineRouter):
            for key in group.keys:
                self.router.forget(f"{key}a0")

    def _drop_stale_ready(self) -> None:
        """Drop ready groups that no longer meet ``max_staleness``. Called on every group
        completion: only groups that joined since the last call are looked at, unless the
        version changed since."""
        if self.cfg.mode != "async":
            return
        version = self.router.version
        checked = self._fresh[1] if self._fresh[0] == version else 0
        bound = version - self.cfg.max_staleness
        keep = self._ready[:checked]
        for group in self._ready[checked:]:
            oldest = group.oldest_version()
            if oldest is not None and oldest < bound:
                self._counts["stale_dropped_groups"] += 1
                self._count(group, False)
            else:
                keep.append(group)
        self._ready = keep
        self._fresh = (version, len(keep))

    # ------------------------------------------------------------------ metrics
    def _metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        paused, self._weight_pause_s = self._weight_pause_s, 0.0
        in_play = {
            "rollout/ready_groups": float(len(self._ready)),
            "rollout/running_groups": float(len(self._running)),
            "rollout/draining_groups": float(len(self._draining)),
            "rollout/engine_in_flight": float(self.router.in_flight),
        }
        return batch_metrics(
            trajectories,
            self.router.take_stats(),
            self._counts,
            in_play=in_play,
            played=self._played,
            version=self.router.version,
            max_staleness=self.cfg.max_staleness,
            weight_pause_s=paused,
        )


class LoopThread:
    """An asyncio event loop in a daemon thread; ``run(coro)`` blocks the caller for the result."""

    def __init__(self, name: str = "rollout-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the loop; returns a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (exceptions re-raised here)."""
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Stop the loop and join the thread (pending tasks are cancelled)."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()
