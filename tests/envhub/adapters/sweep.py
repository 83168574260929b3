"""`envhub check` over many adapted ids, for the slow sweeps that pin the README's counts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import envhub
from envhub.errors import SourceError


def failing(specs: Iterable[Any], name: Callable[[Any], str]) -> dict[str, list[str]]:
    """``{name(spec): problems}`` for every spec whose env fails the checker or cannot be built."""
    failed = {}
    for spec in specs:
        try:
            report = envhub.check_env(spec.make(), factory=spec.make, raise_on_failure=False)
            problems = [f"{r.name}: {r.message[:200]}" for r in report.failures]
        except SourceError as error:
            problems = [str(error)[:200]]
        if problems:
            failed[name(spec)] = problems
    return failed
