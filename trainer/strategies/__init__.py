"""Engines and training strategies behind the ``InferenceEngine`` / ``TrainStrategy`` protocols.

``base`` holds the protocols and ``BaseTrainStrategy`` (the shared train loop); ``registry`` is
the one table of names (``make_train_strategy`` / ``make_engine`` build by name). Training:
``hf`` (plain torch, CPU or one GPU; the embedded default), ``fsdp2``, ``megatron`` (with
``megatron_convert``, ``megatron_model``, ``megatron_cpu_shim``); inference: ``hf_engine``
(the default, with ``decode_batch`` and ``hf_weights``) and ``vllm_engine`` (with ``vllm_weights``,
``vllm_platform``, ``vllm_worker``, ``vllm_lora``, ``vllm_sampling``); ``batching`` is the async
front they and the driver's per-rank engines share; ``model_eos`` the EOS ids both engines
and the renderer stop on.
``distributed``, ``offload`` and ``parallel_errors`` are what the strategies share.
"""

from __future__ import annotations

__all__ = ["base", "hf", "hf_engine", "registry"]
