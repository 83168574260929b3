"""Errors of the weight sync. Each names the bad value and the fix.

TrainerError
└── WeightSyncError            a sync could not complete
    ├── BucketTooSmallError    a single tensor does not fit in one bucket
    ├── StaleWeightsError      an engine's weights are older than, or only partly, the trainer's
    │   └── VersionReusedError a sync announced a version an engine already served
    └── TransportError         the other side of a transport died or broke the protocol
"""

from __future__ import annotations

from trainer.errors import TrainerError

__all__ = [
    "BucketTooSmallError",
    "StaleWeightsError",
    "TransportError",
    "VersionReusedError",
    "WeightSyncError",
]


class WeightSyncError(TrainerError, RuntimeError):
    """Moving weights from the trainer to an inference engine failed."""


class BucketTooSmallError(WeightSyncError, ValueError):
    """``bucket_bytes`` is smaller than the largest tensor to sync."""


class StaleWeightsError(WeightSyncError):
    """An engine holds weights other than the trainer's latest complete version."""


class VersionReusedError(StaleWeightsError):
    """A sync announced a weights version that an engine already served (or an older one)."""


class TransportError(WeightSyncError):
    """A transport peer died, timed out or sent something out of protocol."""
