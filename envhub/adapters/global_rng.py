"""Python's and NumPy's global RNGs, one copy per env, for libraries that draw from them.

TextArena and GEM seed and draw from ``random`` (and some games from ``numpy.random``) at
module level. In one process that runs several of their envs (the trainer's ``LocalEnvSource``
plays many episodes at once, in threads when a step timeout is set), each reset would reseed
the stream the others draw from: an episode would depend on what else ran, not on its seed.

``GlobalRNG`` gives each env its own copy of both streams. Every call into the library runs
inside ``with rng.active():``, which takes one process-wide lock, saves the caller's global
states, puts the env's in, and on the way out stores the env's back and restores the caller's.

Guarantees, for the code that calls the library only inside ``active()``:

1. An env's draws come from its own streams, which ``seed(s)`` sets: the same seed and the
   same calls give the same draws, whatever other such envs (in this thread or others) do.
2. The caller's global streams are as they were: a draw after ``active()`` returns is the one
   it would have been without it.
3. Calls of such envs run one at a time in the process (the lock); nesting ``active()`` of the
   same env in one thread is a no-op, of another env is allowed (and correct).

Not covered: a thread that draws from ``random`` or ``numpy.random`` *without* ``active()``
while a library call runs (another library in the process, user code): its draws and the
env's share the stream for that moment. Callers keep slow calls that draw nothing (a sandbox
run, a model request) outside ``active()``, so envs do not wait on one another's.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["GlobalRNG"]

_LOCK = threading.RLock()
"""Held by the thread whose env's streams are in the globals now."""
_ACTIVE: list[GlobalRNG] = []
"""The envs whose ``active()`` is open, innermost last (only the lock's holder touches it)."""


class GlobalRNG:
    """One env's copy of ``random``'s and ``numpy.random``'s global states (module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        self._python: Any = None
        self._numpy: Any = None
        self.seed(seed)

    def seed(self, seed: int) -> None:
        """Set both streams as ``random.seed(seed)`` and ``numpy.random.seed(seed)`` would."""
        self._python = random.Random(seed).getstate()
        self._numpy = np.random.RandomState(seed % 2**32).get_state()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the body with this env's streams as the globals (module docstring). Entered
        inside another env's ``active()``, that env's streams are kept as they are now and
        put back after."""
        with _LOCK:
            if _ACTIVE and _ACTIVE[-1] is self:
                yield
                return
            outer = _ACTIVE[-1] if _ACTIVE else None
            saved = None if outer is not None else (random.getstate(), np.random.get_state())
            if outer is not None:
                outer._keep()
            random.setstate(self._python)
            np.random.set_state(self._numpy)
            _ACTIVE.append(self)
            try:
                yield
            finally:
                _ACTIVE.pop()
                self._keep()
                if outer is not None:
                    random.setstate(outer._python)
                    np.random.set_state(outer._numpy)
                elif saved is not None:
                    random.setstate(saved[0])
                    np.random.set_state(saved[1])

    def _keep(self) -> None:
        """The globals are this env's streams: store them as they are now."""
        self._python, self._numpy = random.getstate(), np.random.get_state()
