"""Errors of the parallel strategies (``fsdp2``, ``megatron``) and the HF<->Megatron converter.

They subclass the trainer's own tree (``trainer.errors``) so a caller catching
``TrainerError`` or ``ModelError`` sees them too. Each message names the bad value and the fix.

    TrainerError
    ├── ParallelConfigError      a parallel layout that cannot work (TP not dividing heads, ...)
    └── ModelError
        └── UnsupportedModelError   the converter does not know this architecture / layout
"""

from __future__ import annotations

from trainer.errors import ModelError, TrainerError

__all__ = ["ParallelConfigError", "UnsupportedModelError"]


class ParallelConfigError(TrainerError, ValueError):
    """A tensor/pipeline/data-parallel layout that cannot be built for this model or world."""


class UnsupportedModelError(ModelError):
    """An HF architecture (or a feature of it) that the Megatron converter cannot map exactly."""
