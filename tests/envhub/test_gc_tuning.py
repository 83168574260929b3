"""``relax_gc``: the hub server and the rollout driver collect cycles less often (see
``envhub.gc_tuning`` for why), unless the program chose its own thresholds."""

from __future__ import annotations

import gc

from envhub.gc_tuning import CPYTHON_GC_DEFAULTS, MANY_IN_FLIGHT_GC_THRESHOLDS, relax_gc


def test_many_in_flight_processes_collect_cycles_less_often_unless_told_otherwise() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(*CPYTHON_GC_DEFAULTS)
        assert relax_gc() and gc.get_threshold() == MANY_IN_FLIGHT_GC_THRESHOLDS
        gc.set_threshold(1000, 5, 5)  # a process's own choice stays
        assert not relax_gc() and gc.get_threshold() == (1000, 5, 5)
    finally:
        gc.set_threshold(*before)
