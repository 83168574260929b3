"""Which of a training strategy's states are on its device, and the moves that change that.

When AutoDeviceMapping colocates roles on the same devices (``trainer.devices``), the role
not in use gives the devices up: the pipeline offloads it before another role's phase and
reloads it before its own. What a role gives up is chosen per role in the config:

``roles.<role>.offload_params``     parameters (and gradients) go to host memory
``roles.<role>.offload_optimizer``  optimiser state (AdamW moments) goes to host memory

A strategy keeps one :class:`Residency`: ``offload(params=..., optimizer=...)`` moves what is
asked and records it, ``reload()`` brings back everything that is away, and ``require(...)``
(called by ``forward``/``train_step``/``full_weights``) reloads just what the call needs when
it is away - so a state is always restored before use, even if a phase forgot to reload it
(``forward`` needs the parameters only; ``train_step`` needs both).

On CPU the states already live in host memory, so nothing moves: the bookkeeping and the
``history`` are the same (tests read them), ``moved`` is False, and the first offload says so
in one log line. On CUDA the moves are real ``.to("cpu")``/``.to(device)`` copies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STATES", "Residency", "ResidencyEvent", "state_movers"]

log = logging.getLogger(__name__)

STATES = ("params", "optimizer")


@dataclass(frozen=True)
class ResidencyEvent:
    """One transition: ``action`` ("offload"/"reload") of ``state``; ``moved``: bytes moved."""

    action: str
    state: str
    moved: bool
    reason: str = "phase"
    """``phase``: asked by the colocation switch; ``use``: a call needed a state that was away."""


@dataclass
class Residency:
    """Offload/reload bookkeeping for one strategy (see the module docstring).

    ``movers`` maps a state name to a function that moves that state to a device string;
    a state without a mover (a frozen model has no optimiser) is never offloaded.
    """

    device: str
    movers: dict[str, Callable[[str], None]]
    owner: str = "strategy"
    away: set[str] = field(default_factory=set)
    history: list[ResidencyEvent] = field(default_factory=list)
    _said_noop: bool = False

    @property
    def moves(self) -> bool:
        """Whether offloading moves bytes (a CUDA device) or is bookkeeping only (CPU)."""
        return self.device.startswith("cuda")

    def offload(self, *, params: bool = True, optimizer: bool = True) -> None:
        """Move the asked states off the device (no-op moves on CPU; see the module docstring)."""
        wanted = {"params": params, "optimizer": optimizer}
        for state in STATES:
            if wanted[state] and state in self.movers and state not in self.away:
                if self.moves:
                    self.movers[state]("cpu")
                self.away.add(state)
                self.history.append(ResidencyEvent("offload", state, self.moves))
        if not self.moves and not self._said_noop and any(wanted.values()):
            self._said_noop = True
            log.info(
                "%s: offload/reload on device %r moves nothing (the state already lives in host "
                "memory); which states are offloaded is still tracked",
                self.owner,
                self.device,
            )

    def reload(self, *states: str, reason: str = "phase") -> None:
        """Bring ``states`` (default: every state that is away) back onto the device."""
        for state in states or STATES:
            if state in self.away:
                if self.moves:
                    self.movers[state](self.device)
                self.away.discard(state)
                self.history.append(ResidencyEvent("reload", state, self.moves, reason))

    def require(self, *states: str) -> None:
        """Make sure ``states`` are on the device before a call uses them."""
        missing = [s for s in states if s in self.away]
        if missing:
            self.reload(*missing, reason="use")


def state_movers(model: Any, optimizer: Any = None) -> dict[str, Callable[[str], None]]:
    """Movers for a strategy's ``model`` (parameters and their gradients) and optimiser state."""

    def move_params(device: str) -> None:
        model.to(device)
        _release_cuda_cache(device)

    def move_optimizer(device: str) -> None:
        import torch

        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        _release_cuda_cache(device)

    movers: dict[str, Callable[[str], None]] = {"params": move_params}
    if optimizer is not None:
        movers["optimizer"] = move_optimizer
    return movers


def _release_cuda_cache(device: str) -> None:
    import torch

    if device == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()
