"""The one place where Megatron-Core is taught to run on a CPU. Never active on GPU.

Megatron-Core assumes CUDA in three places our CPU training reaches:

1. Its RNG tracker (``tensor_parallel.random.CudaRNGStatesTracker``) seeds, saves and
   restores *CUDA* generator states (``torch.cuda.get_rng_state``/``manual_seed``) to give
   tensor-parallel regions their own dropout/initialisation streams.
2. A few buffers are allocated with ``device=torch.cuda.current_device()`` (e.g. the
   all-gather output in ``tensor_parallel.mappings``, the pipeline's send/receive buffers in
   ``pipeline_parallel.p2p_communication``).
3. The pipeline schedules (``pipeline_parallel.schedules``, megatron-core 0.16) create their
   token counter with a literal ``torch.zeros([], dtype=torch.int, device="cuda")``, which a
   CPU-only torch refuses ("Torch not compiled with CUDA enabled").

``activate(seed)`` replaces (1) with :class:`CpuRNGStatesTracker`, the same bookkeeping
over the CPU generator (``torch.get_rng_state``/``set_rng_state``), seeded exactly as
``model_parallel_cuda_manual_seed`` seeds its streams; and, only when this torch has no
CUDA at all, makes ``torch.cuda.current_device`` return ``"cpu"`` so (2) allocates host
memory, and gives the schedules module (only it) a ``torch`` whose ``zeros`` maps
``device="cuda"`` to the CPU (3). Nothing else changes: same modules, same math, same
collectives (gloo; pipeline send/receive are gloo ``isend``/``irecv``).

It is called by ``MegatronTrainStrategy`` when, and only when, the training device is the
CPU; ``activate`` refuses to run in a process whose torch sees a GPU (a half-CPU,
half-CUDA Megatron would silently mix devices). ``is_active()`` tells tests and logs.
Dropout must be 0 on CPU (the strategy sets it), so no random stream affects the math.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trainer.strategies.parallel_errors import ParallelConfigError

__all__ = ["CpuRNGStatesTracker", "activate", "is_active"]

if TYPE_CHECKING:
    # built on first access by the module ``__getattr__``: it subclasses a Megatron-Core class,
    # which is imported only then
    CpuRNGStatesTracker: type

_ACTIVE = False


def _tracker_class() -> type:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """``CudaRNGStatesTracker`` over the CPU generator (same names, same seeds)."""

        def add(self, name: str, seed: int) -> None:
            import torch

            self._is_initialized = True
            if seed in self.seeds_:
                raise ParallelConfigError(
                    f"megatron rng seed {seed} is already tracked; use distinct seeds"
                )
            if name in self.states_:
                raise ParallelConfigError(f"megatron rng state {name!r} is already tracked")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            import torch

            if name not in self.states_:
                raise ParallelConfigError(f"megatron rng state {name!r} was never added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    return CpuRNGStatesTracker


def __getattr__(name: str) -> Any:
    if name == "CpuRNGStatesTracker":
        return _tracker_class()
    raise AttributeError(name)


class _SchedulesTorch:
    """``torch`` as Megatron's ``pipeline_parallel.schedules`` sees it on CPU.

    The same module, except that ``zeros(device="cuda")`` allocates on the CPU.
    """

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def zeros(self, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return self._torch.zeros(*args, device=device, **kwargs)


def _cpu_device() -> str:
    """``torch.cuda.current_device`` on CPU-only torch: Megatron passes it on as ``device=``."""
    return "cpu"


def activate(seed: int, tp_rank: int = 0) -> None:
    """Install the CPU RNG tracker (seeded like ``model_parallel_cuda_manual_seed``) and make
    Megatron allocate on the CPU."""
    global _ACTIVE
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        raise ParallelConfigError(
            "megatron CPU training was asked for in a process that sees a GPU; train on device "
            "'cuda', or hide the GPUs (CUDA_VISIBLE_DEVICES='') so no CUDA tensor mixes into the "
            "CPU run"
        )
    tracker = _tracker_class()()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # deliberately a str where torch declares an int device index: on a CPU-only torch nothing
    # but Megatron's allocations calls it, and they take any device
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _SchedulesTorch):
        schedules.torch = _SchedulesTorch(torch)
    _ACTIVE = True


def is_active() -> bool:
    """Whether :func:`activate` ran in this process."""
    return _ACTIVE
