"""The single controller: dispatch modes, workers, and clusters of workers per role.

- :mod:`trainer.controller.dispatch` — ``Dispatch``/``Collect`` modes, ``@register``, and the
  pure functions that split a call over ranks and combine the answers (no Ray).
- :mod:`trainer.controller.batch` — ``Batch``, the columns-of-rows unit that ``DP_SPLIT``
  (and ``DP_SPLIT_RAGGED``, for batches of any size) cuts across data-parallel ranks.
- :mod:`trainer.controller.worker` — ``Worker``, the base of every role's worker, with the
  ``offload()``/``reload()`` hooks colocation uses.
- :mod:`trainer.controller.cluster` — ``Cluster``: all workers of one role, in-process
  (``local``) or as Ray actors (``ray``); ``remote(Worker.method)`` derives a role cluster's
  typed methods from its worker's.
- :mod:`trainer.controller.resources` — ``ResourceManager``: a device mapping as Ray
  placement groups across nodes; ``init_local_ray``.

Names are imported lazily; nothing here imports Ray until a Ray-backed cluster is built.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Batch",
    "CallFuture",
    "Cluster",
    "Collect",
    "Dispatch",
    "ResourceManager",
    "Worker",
    "WorkerContext",
    "init_local_ray",
    "register",
    "remote",
]

_LAZY: dict[str, str] = {
    "Dispatch": "trainer.controller.dispatch",
    "Collect": "trainer.controller.dispatch",
    "register": "trainer.controller.dispatch",
    "Batch": "trainer.controller.batch",
    "Worker": "trainer.controller.worker",
    "WorkerContext": "trainer.controller.worker",
    "Cluster": "trainer.controller.cluster",
    "CallFuture": "trainer.controller.cluster",
    "remote": "trainer.controller.cluster",
    "ResourceManager": "trainer.controller.resources",
    "init_local_ray": "trainer.controller.resources",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainer.controller' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
