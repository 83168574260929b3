"""Moving policy weights from the training layout to the inference engines.

``buckets``    pack full HF-named tensors into size-bounded flat buffers (and back)
``transport``  hand buckets over: shared memory / CUDA IPC when colocated, a broadcast
               group when disaggregated; versioned so stale or half-updated weights are
               never served silently
``errors``     what can go wrong, with the fix

Nothing heavy is imported by ``import trainer.weights``.
"""

from __future__ import annotations

__all__ = ["buckets", "errors", "transport"]
