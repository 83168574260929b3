"""Coding environments, registered under the ``code/`` namespace.

Model-written code never runs in the env's process: both envs execute it in a sandbox from
the ``sandboxes`` package (``sandbox_backend="local"`` by default; ``"docker"``/``"e2b"``
where available).
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register every coding env with the envhub registry (called by the registry itself)."""
    from envhub.registry import register

    register(
        "code/humaneval-v0",
        "envs.code.programming:ProgrammingEnv",
        description=(
            "Write a function; hidden tests run in a sandbox; revise from failures "
            "(HumanEval, or your JSONL)."
        ),
        variants={"binary": {"reward_mode": "binary"}, "single": {"max_revisions": 0}},
    )
    register(
        "code/terminal-v0",
        "envs.code.terminal:TerminalEnv",
        max_turns=12,
        description=(
            "Reach a goal with shell commands in a persistent sandboxed bash session; "
            "a checker script verifies it."
        ),
    )
