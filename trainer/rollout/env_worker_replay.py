"""What becomes of the episodes an env worker held when it dies (``EnvWorkers``).

A worker process dies when one of its envs kills it (a segfault, ``os._exit``, the OOM killer)
or when something outside kills it (the driver, after a pause it did not answer). The worker
records which of its episodes are in an env call (making, resetting, stepping or closing their
env: ``EnvCalls``), and the driver reads that record once the worker is dead:

culprits    the episodes in an env call when it died: one of them killed it. They fail, with
            the worker and its exit code as the reason, and are not replayed: an env that kills
            its process would kill the replacement too, and every episode held there with it.
bystanders  every other episode it held (waiting for a generation, or in the Python between a
            turn and its env call): none of them was running an env. Each is replayed from its
            start on a live worker, as ``play_episode`` replays a failed attempt: the lost
            attempt uses one of its ``max_retries`` (repeated deaths cannot replay it forever;
            with none left it fails as a culprit does), and it does not go to ``on_failure``
            (it did not fail: its group is not charged a failed episode).

A worker killed while no env call ran has no culprit: all its episodes are replayed. Not
covered: an env call given up on (``rollout.env_timeout_s``) whose thread goes on and later
kills the process is no longer in the record (its episode ended); the episodes in calls then
are blamed. Should the record overflow (``EnvCalls.SIZE``), the episodes that were not waiting
for a generation in the driver's router are all culprits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.rollout.router import episode_key
from trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from trainer.rollout.env_manager import Sampling
    from trainer.rollout.groups import EpisodeSpec

__all__ = ["EnvCalls", "HeldEpisode", "bystanders", "settle_held"]

_UNKNOWN = 0xFFFFFFFF
"""``EnvCalls``' length when the keys did not fit."""


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
    culprits: set[str],
    reason: str,
    replay: Callable[[str, HeldEpisode], None] | None,
) -> None:
    """End the episodes of a dead worker: fail the ``culprits`` with ``reason`` and ``replay``
    every other one that has a replay left (module docstring). No ``replay`` (the workers are
    closing, or cannot start): every one fails."""
    for key, episode in episodes.items():
        if episode.future.done():
            continue
        if replay is not None and key not in culprits and episode.max_retries > 0:
            replay(key, dataclasses.replace(episode, max_retries=episode.max_retries - 1))
        else:
            spec = episode.spec
            episode.future.set_result(
                Trajectory(spec.env_id, spec.seed, spec.group_id, failed=True, failure=reason)
            )


class EnvCalls:
    """The play keys of the episodes in an env call in a worker, in memory the worker and the
    driver share: the worker writes it around each env call (``begin``/``end``), the driver
    reads it once the worker is dead (``running``).

    A message per env call would cost the hot path a socket write and the driver a frame read
    per turn (it would have to leave the worker before a call that kills it, alone in its frame,
    which the lockstep clock does not expect); a store into shared memory costs the worker about
    two microseconds per env call and the driver nothing. The record is a length (4 bytes,
    little-endian; ``_UNKNOWN``: more keys than fit) and the keys joined by newlines; the length
    is zeroed while the keys are rewritten, so a worker killed mid-update reads as in no env
    call (every episode is replayed)."""

    SIZE = 1 << 16

    def __init__(self, memory: mmap.mmap) -> None:
        self._memory = memory
        self._running: dict[str, int] = {}
        """Play key -> its env calls running (threaded envs: several at once)."""

    @classmethod
    def create(cls) -> tuple[EnvCalls, int]:
        """The driver's record for a new worker, and the file descriptor the worker maps (the
        driver closes it once the worker started)."""
        if hasattr(os, "memfd_create"):  # Linux: anonymous memory, no file anywhere
            fd = os.memfd_create("envhub-env-calls")
        else:
            with tempfile.TemporaryFile() as file:  # unlinked: gone with its last mapping and fd
                fd = os.dup(file.fileno())
        os.ftruncate(fd, cls.SIZE)
        return cls(mmap.mmap(fd, cls.SIZE)), fd

    @classmethod
    def attach(cls, fd: int) -> EnvCalls:
        """The worker's side of the record its driver created (``--env-calls FD``)."""
        memory = mmap.mmap(fd, cls.SIZE)
        os.close(fd)
        return cls(memory)

    def begin(self, key: str) -> None:
        """``key``'s episode is about to call its env (make, reset, step or close it)."""
        self._running[key] = self._running.get(key, 0) + 1
        self._write()

    def end(self, key: str) -> None:
        """``key``'s env call returned (or raised, or was given up on)."""
        left = self._running.pop(key, 1) - 1
        if left:
            self._running[key] = left
        self._write()

    def _write(self) -> None:
        data = "\n".join(self._running).encode()
        memory = self._memory
        memory[:4] = b"\0\0\0\0"
        if len(data) > self.SIZE - 4:
            memory[:4] = _UNKNOWN.to_bytes(4, "little")
            return
        memory[4 : 4 + len(data)] = data
        memory[:4] = len(data).to_bytes(4, "little")

    def running(self) -> set[str] | None:
        """The driver, once the worker is dead: the play keys of the episodes that were in an
        env call (None: more than the record holds, or it is closed)."""
        if self._memory.closed:
            return None
        size = int.from_bytes(self._memory[:4], "little")
        if size == _UNKNOWN:
            return None
        return set(self._memory[4 : 4 + size].decode().split("\n")) - {""}

    def close(self) -> None:
        """Unmap the record (idempotent)."""
        self._memory.close()
