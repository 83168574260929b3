"""Small envs for tests: importable (hence picklable) by the name tests.helpers."""

from __future__ import annotations

import envhub

SHOUT = envhub.function_tool(
    "shout", "Shout a word.", {"type": "object", "properties": {"word": {"type": "string"}}}
)
"""The one tool ``CountdownEnv`` offers (it never calls it; tests see it in ``info``)."""


class CountdownEnv(envhub.TextEnv):
    """Say 'go' to finish; anything else is invalid. Small enough to reason about by hand."""

    def __init__(
        self, *, goal: str = "go", max_turns: int | None = 3, system_prompt: str | None = None
    ) -> None:
        super().__init__(max_turns=max_turns)
        self.goal = goal
        self.system_prompt = system_prompt
        self.tools = [SHOUT]

    def on_reset(self, options):
        self.secret = int(self.np_random.integers(0, 1000))
        return f"Say {self.goal}. Secret {self.secret}.", {"secret": self.secret}

    def on_step(self, action):
        if action.strip() == self.goal:
            return envhub.Turn("Done.", reward=1.0, terminated=True, success=True)
        return self.invalid_action(f"{action!r} is not {self.goal!r}.")


def register_countdown() -> None:
    """A plugin callable, as a third-party package's entry point would name it."""
    envhub.register("helpers/countdown-v0", "tests.helpers:CountdownEnv", max_turns=3)


def _missing_ray_command():
    import click

    @click.command("needs-ray")
    def needs_ray() -> None:
        raise ModuleNotFoundError("No module named 'ray'", name="ray")

    return needs_ray


missing_ray_command = _missing_ray_command()
"""A subsystem command whose optional dependency is absent (for the CLI's message)."""
