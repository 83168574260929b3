"""Engines and training strategies behind the ``InferenceEngine`` / ``TrainStrategy`` protocols.

``hf_engine.HFEngine`` (torch generation) and ``hf.HFTrainStrategy`` (plain torch, CPU or one
GPU) are the embedded defaults; ``trainer.workers.infer.make_engine`` and
``trainer.workers.actor.make_train_strategy`` pick one by name, so fsdp2/megatron/vllm plug in
behind the same protocols without the workers changing.
"""

from __future__ import annotations

__all__ = ["base", "hf", "hf_engine"]
