"""Moving policy weights from the training layout to the inference engines.

``buckets``    pack full HF-named tensors into size-bounded flat buffers (and back)
``shards``     where each trainer rank's own shard lands in the full tensors (no gather)
``transport``  hand buckets over: shared memory / CUDA IPC when colocated, a broadcast
               group when disaggregated
``versioned``  never serve a half sync (``VersionedEngine``, ``confirm_versions``) and the
               run's one policy version (``PolicyVersion``)
``sender``     the trainer ranks' half: ``WeightSender`` (inherited by ``ActorWorker``) and
               ``WeightSenderCluster``
``receiver``   the inference workers' half: ``WeightReceiver`` (inherited by ``InferWorker``)
               and ``WeightReceiverCluster``
``sync``       the driver's ``WeightSync``: plans each sync, calls both halves, owns the version
``errors``     what can go wrong, with the fix

Nothing heavy is imported by ``import trainer.weights``.
"""

from __future__ import annotations

__all__ = ["buckets", "errors", "receiver", "sender", "shards", "sync", "transport", "versioned"]
