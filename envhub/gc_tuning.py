"""Cyclic-GC thresholds for processes that hold thousands of episodes in flight.

Both sides of envhub have such a process: ``envhub serve`` (every session's socket, request,
future and pending answer) and the trainer's rollout driver (every episode in play, with
trajectories whose token lists grow to thousands of entries). With CPython's default
thresholds, the objects of in-flight work survive the young collections, so full collections
come every few hundred milliseconds and rescan all of them: at 10,000 hub sessions that cost
more than serving the steps (``benchmarks/hub_throughput.py --sessions 10000``; the driver's
case: ``benchmarks/rollout_scale.py``). Garbage is still reclaimed, by reference counting as
always, and cycles by collections that now come less often.
"""

from __future__ import annotations

import gc

__all__ = ["CPYTHON_GC_DEFAULTS", "MANY_IN_FLIGHT_GC_THRESHOLDS", "relax_gc"]

CPYTHON_GC_DEFAULTS = (700, 10, 10)
MANY_IN_FLIGHT_GC_THRESHOLDS = (50_000, 50, 100)
"""Cyclic-GC thresholds of a process that holds many episodes in flight (``relax_gc``)."""


def relax_gc() -> bool:
    """Raise CPython's cyclic-GC thresholds to ``MANY_IN_FLIGHT_GC_THRESHOLDS`` when they are still
    the defaults (a process that set its own keeps them); True when changed. ``envhub serve``
    and ``envhub train`` call it at start; a program serving or driving episodes itself may."""
    if gc.get_threshold() != CPYTHON_GC_DEFAULTS:
        return False
    gc.set_threshold(*MANY_IN_FLIGHT_GC_THRESHOLDS)
    return True
