"""Rollouts: multi-turn episodes as token sequences (``trajectory``), one episode loop per env
(``env_manager``), and which episodes a step plays (``groups``)."""

from __future__ import annotations

__all__ = ["env_manager", "groups", "trajectory"]
