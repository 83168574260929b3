"""Measure the tensor memory a piece of code allocates on the CPU: ``peak_allocated_bytes(fn)``.

torch's profiler (``profile_memory=True``) records every CPU allocation and free made while it
runs, each with the allocator's running total of bytes allocated inside the profiled window.
The largest total is the peak of tensor memory ``fn`` needed on top of what already existed:
exact bytes, independent of the process's RSS, of malloc caching and of the machine's load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["peak_allocated_bytes"]


def peak_allocated_bytes(fn: Callable[[], Any]) -> int:
    """The peak of tensor bytes allocated (net of frees) while ``fn()`` runs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    peak = 0
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        fields = node.extra_fields
        if isinstance(fields, torch._C._profiler._ExtraFields_Allocation):
            peak = max(peak, fields.total_allocated)
        pending.extend(node.children)
    return peak
