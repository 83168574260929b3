"""Small envs for tests: importable (hence picklable) by the name tests.helpers."""

from __future__ import annotations

import os

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


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs; a zombie, or one that vanishes while we look, is dead.

    Reading ``/proc/PID/stat`` of a process reaped a moment ago raises ``ProcessLookupError``
    (ESRCH) or ``FileNotFoundError`` depending on when it goes; both mean it is gone.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def host_command_lines() -> dict[int, list[str]]:
    """The argv of every process on this host (that may vanish mid-scan; those are skipped)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read().decode(errors="replace").split("\0")[:-1]
            except OSError:
                continue
    return found


def host_processes_with(fragment: str) -> list[str]:
    """``"PID: command line"`` for each host process whose command line contains ``fragment``."""
    lines = {pid: " ".join(argv) for pid, argv in host_command_lines().items()}
    return [f"{pid}: {line}" for pid, line in lines.items() if fragment in line]


class CrashingEnv(CountdownEnv):
    """Takes its whole process down on the first step (a native crash, as far as anyone sees)."""

    def on_step(self, action):
        os._exit(70)
