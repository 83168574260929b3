"""Moving policy weights from the training layout to the inference engines.

``buckets``    pack full HF-named tensors into size-bounded flat buffers (and back)
``transport``  hand buckets over: shared memory / CUDA IPC when colocated, a broadcast
               group when disaggregated; versioned so stale or half-updated weights are
               never served silently
``sync``       the driver's ``WeightSync`` (trainer ranks -> inference workers, per bucket,
               version-checked) and the worker halves it calls
``errors``     what can go wrong, with the fix

Nothing heavy is imported by ``import trainer.weights``.
"""

from __future__ import annotations

__all__ = ["buckets", "errors", "sync", "transport"]
