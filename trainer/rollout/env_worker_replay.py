"""What becomes of the episodes an env worker held when it dies (``EnvWorkers``).

A worker process dies when one of its envs kills it (a segfault, ``os._exit``, the OOM killer)
or when the driver kills it (a pause it did not answer). The episodes it held are of two kinds:

suspects    those the worker was working on: in an env call, or in the Python between two
            turns (their generation had come back). One of them killed it. They fail, with the
            worker and its exit code as the reason, and are not replayed: an env that kills its
            process would kill the replacement too, and every episode held there with it.
bystanders  those waiting for a generation in the driver's router when it died (the worker's
            ``requests``): none of them was running in the worker. Each is replayed from its
            start on a live worker, as ``play_episode`` replays a failed attempt: the lost
            attempt uses one of its ``max_retries`` (repeated deaths cannot replay it forever;
            with none left it fails as a suspect does), and it does not go to ``on_failure``
            (it did not fail: its group is not charged a failed episode).

When the workers route their own turns (``WorkerRouters``) the driver does not see which
episodes wait for the engine, so every episode held is a suspect.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.rollout.router import episode_key
from trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from trainer.rollout.env_manager import Sampling
    from trainer.rollout.groups import EpisodeSpec

__all__ = ["HeldEpisode", "bystanders", "settle_held"]


@dataclass
class HeldEpisode:
    """An episode the driver gave a worker, with what it takes to give it to another."""

    spec: EpisodeSpec
    sampling: Sampling
    max_retries: int
    """Replays left to it (``play_episode``'s ``max_retries``; a worker's death uses one)."""
    future: asyncio.Future[Trajectory]
    on_failure: Callable[[Trajectory], None] | None


def bystanders(requests: Iterable[str]) -> set[str]:
    """The play keys of the episodes whose generation ``requests`` were waiting in the router.

    A request id is ``"{key}a{attempt}/{turn}"`` (``play_episode`` names its attempts so): the
    play key is its episode key without the attempt suffix."""
    return {episode_key(request_id).rpartition("a")[0] for request_id in requests}


def settle_held(
    episodes: dict[str, HeldEpisode],
    waiting: set[str],
    reason: str,
    replay: Callable[[str, HeldEpisode], None] | None,
) -> None:
    """End the episodes of a dead worker: ``replay`` each of the bystanders (``waiting``) that
    has a replay left, fail every other one with ``reason`` (module docstring). No ``replay``
    (the workers are closing, or cannot start): every one fails."""
    for key, episode in episodes.items():
        if episode.future.done():
            continue
        if replay is not None and key in waiting and episode.max_retries > 0:
            replay(key, dataclasses.replace(episode, max_retries=episode.max_retries - 1))
        else:
            spec = episode.spec
            episode.future.set_result(
                Trajectory(spec.env_id, spec.seed, spec.group_id, failed=True, failure=reason)
            )
