"""Rewards the envs do not give (or that replace theirs): rule-based verifiers, user functions
and an LLM judge, routed per task domain and run by the ``reward`` role while generation goes on.

- ``verifiers``: ``exact_match``, ``numeric_match`` on the episode's final answer.
- ``judge``: ``LLMJudge`` asks a model, through any ``InferenceEngine``, to grade a transcript.
- ``router``: ``RewardRouter`` picks the scorers whose ``domain`` matches an episode's env id
  and awaits them on the ``reward`` cluster when the episode ends.
"""

from __future__ import annotations

__all__ = ["judge", "router", "verifiers"]
