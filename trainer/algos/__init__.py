"""RL algorithms as pure tensor functions: advantage estimators and policy/value losses.

Nothing here knows about models, workers or envs: every function takes padded ``(B, T)``
tensors aligned with ``input_ids`` plus a ``response_mask`` (1 where the policy wrote the
token) and returns tensors, so each one is checked in tests against hand-computed values.
"""

from __future__ import annotations

__all__ = ["advantages", "losses"]
