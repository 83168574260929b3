"""The ROLL-style RL trainer for language-model agents.

One driver process (the *single controller*) runs the pipeline; each role (``actor_train``,
``actor_infer``, ``reference``, ``critic``, ``reward``) is a cluster of workers, in-process or
Ray actors, placed on devices by AutoDeviceMapping. Modules:

Infrastructure
    ``trainer.config``       the typed config tree; ``load_config(path, overrides)`` (sections
                             in ``config_section`` and ``config_lifecycle``, reading and
                             locating errors in ``_config_io``, cross-section checks in
                             ``_config_checks``)
    ``trainer.devices``      AutoDeviceMapping: colocated/disaggregated groups, validation,
                             the ``Colocation`` offload/reload switcher (plain Python)
    ``trainer.memory``       will it fit: per-device memory of every role, phase by phase, from
                             the model's config.json alone (``memory_roles``, ``model_shape``);
                             the config refuses a device over capacity; ``--dry-run`` prints it
    ``trainer.controller``   dispatch modes and ``@register`` (no Ray), ``Batch``, ``Worker``,
                             ``Cluster`` (local or Ray), ``ResourceManager`` (placement groups)
    ``trainer.checkpoint``   atomic checkpoints with RNG state, seeds and extra state
                             (``trainer.checkpoint_read``: reading and checking one back)
    ``trainer.errors``       the exception tree (messages name the path, the value, the fix)

Learning
    ``trainer.models``       build tiny HF models and tokenizers; load local checkpoints
    ``trainer.strategies``   training/inference strategies behind protocols (``hf``, ...)
    ``trainer.workers``      role workers (actor, critic, reference, infer, reward)
    ``trainer.rollout``      ``Rollouts``, the one rollout path: scheduler, router, episodes,
                             trajectories
    ``trainer.weights``      the weight sync: sender, receiver, buckets, transports, the
                             policy version
    ``trainer.algos``        advantages (GAE, GRPO, Reinforce++, RLOO) and losses
    ``trainer.rewards``      verifiers and judges for the reward role
    ``trainer.roles``        a config -> the policy folder and the running role clusters
    ``trainer.sft``          demonstrations (expert or file) for the behaviour-cloning warm start
    ``trainer.metrics``      the metrics log (JSONL, TensorBoard, W&B), summaries, reward curves
    ``trainer.pipeline``     ``AgenticPipeline.fit()``: rollout -> ... -> checkpoint -> eval
    ``trainer.cli``          ``envhub train CONFIG [a.b=value ...] [--resume]``

Names below are imported lazily: ``import trainer`` loads nothing heavy (no torch, no Ray).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AutoDeviceMapping",
    "CheckpointManager",
    "ConfigError",
    "DevicePlan",
    "TrainerConfig",
    "TrainerError",
    "load_config",
]

_LAZY: dict[str, str] = {
    "TrainerConfig": "trainer.config",
    "load_config": "trainer.config",
    "AutoDeviceMapping": "trainer.devices",
    "DevicePlan": "trainer.devices",
    "CheckpointManager": "trainer.checkpoint",
    "TrainerError": "trainer.errors",
    "ConfigError": "trainer.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
