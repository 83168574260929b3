"""``FolderLock``: one training run per folder (its ``output_dir``, its checkpoint folder).

Two runs writing one folder destroy each other's checkpoints (one removes the other's
half-written save, prunes its checkpoints, or moves the folder aside while it writes). The lock
is an exclusive ``fcntl.flock``, which the kernel drops when its process ends, even after
``kill -9``: a crashed run never leaves a stale lock behind. The lock file names the holder's
pid and host, for the refusal.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from trainer.errors import CheckpointError

__all__ = ["FolderLock"]


class FolderLock:
    """An exclusive ``fcntl.flock`` on ``folder/name``, held until :meth:`release` or the
    process ends (the kernel drops it then, even after ``kill -9``).

    ``setting`` names the config key that chooses the folder, for the refusal's fix. Locks are
    per open file, so a second lock on the same folder is refused in the same process too.
    """

    def __init__(self, folder: str | Path, *, name: str = ".lock", setting: str) -> None:
        self.path = Path(folder) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().split()
            handle.close()
            pid, host = (holder + ["?", "?"])[:2]
            raise CheckpointError(
                f"{self.path.parent} is in use by another training run (pid {pid} on {host}); "
                "two runs writing one folder destroy each other's checkpoints. Wait for it to "
                f"end or stop it (kill {pid}), or give this run its own {setting}"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {socket.gethostname()}\n")
        handle.flush()
        self._handle: IO[str] | None = handle

    def release(self) -> None:
        """Unlock (idempotent); the file stays, naming the last holder."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
