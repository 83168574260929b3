"""Start gloo ranks for the strategy tests: forked from a server that imported torch and
transformers once (``forkserver`` with those preloaded), not a fresh interpreter per rank and
test (``mp.spawn``) that imports them again. The ranks run the same code either way."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from trainer.strategies.distributed import free_port

PRELOAD = [
    "torch",
    "transformers",
    "tests.trainer.strategies.dist_workers",
    "tests.trainer.strategies.grad_workers",
]
"""What the server imports before it forks a rank (it takes them at its first start)."""


def run_ranks(fn: Callable[..., None], world: int, *args: Any) -> dict[Any, Any]:
    """Run ``fn(rank, world, port, out, *args)`` on ``world`` ranks; return what they put in
    ``out`` (a shared dict); a rank that fails fails the call with its traceback."""
    import torch.multiprocessing as mp

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with context.Manager() as manager:
        out = manager.dict()
        mp.start_processes(
            fn,
            args=(world, free_port(), out, *args),
            nprocs=world,
            join=True,
            start_method="forkserver",
        )
        return dict(out)
