"""The driver's handle on one env worker process (``trainer.rollout.env_workers``): its process,
sockets, the episodes and generation requests it holds, and the lockstep clock's bookkeeping."""

from __future__ import annotations

import asyncio
import collections
import itertools
import subprocess
from dataclasses import dataclass, field
from typing import Any

from envhub.pool.procs import ExitWatch
from trainer.rollout.env_worker_replay import EnvCalls, HeldEpisode
from trainer.rollout.wire import Channel

__all__ = ["WorkerHandle"]

_uids = itertools.count()


@dataclass
class WorkerHandle:
    """The driver's handle on one worker process."""

    index: int
    process: subprocess.Popen[bytes]
    channel: Channel
    ready: asyncio.Future[bool]
    """Set once the worker answered its setup (True) or failed it (False)."""
    calls: EnvCalls
    """The episodes the worker has in an env call (read once it died: those are the culprits)."""
    relay: Channel | None = None
    """The relayed engines' own socket (``RelayEngines``), if any."""
    next_answer: int = 0
    """lockstep: the number of the worker's next answer (answers come on either socket)."""
    early: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)
    """lockstep: answers that came before an earlier one, by number."""
    init_paused: bool = False
    """Routing in the worker: its router started paused (a weight update was under way)."""
    uid: int = field(default_factory=lambda: next(_uids))
    """Unique among all workers ever started (a replacement keeps ``index``, not this)."""
    episodes: dict[str, HeldEpisode] = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)
    """Generation requests the worker is waiting for (aborted in the router if it dies)."""
    waiting: set[str] = field(default_factory=set)
    """Once it died: the play keys of its episodes that waited for a generation (not culprits
    even when its record of env calls overflowed)."""
    last_turn: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    """Episode key -> its last prompt and generated ids (an ``extend`` goes on from them)."""
    sent_at: collections.deque[float] = field(default_factory=collections.deque)
    """lockstep: the clock at each frame not answered yet."""
    lane_free: float = 0.0
    """lockstep: when the worker's own timeline is free again."""
    watch: ExitWatch | None = None
    """Watches the process itself: a forked helper may hold the socket open after it died."""
    killed: str = ""
    """Why the driver killed it (a pause it did not answer)."""
