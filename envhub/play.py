"""``envhub play``: a person plays an environment in the terminal, as the model would.

The loop shows each observation, reads one line as the action, and shows the reward and,
at the end, the outcome. Lines starting with ``:`` are commands, never actions:
``:hint`` (the env's expert action, if any), ``:reset``, ``:help`` and ``:quit``.
End of input (Ctrl-D) quits cleanly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from envhub.core import Observation

__all__ = ["play"]

HELP = (
    "Type your action and press Enter (e.g. 'up' or '<answer>up</answer>').\n"
    "Commands: :hint  show the expert's move   :reset  new episode   :help   :quit"
)
_STYLE = {"system": "magenta", "user": "cyan", "tool": "yellow", "assistant": "green"}


def _show(console: Console, messages: Observation) -> None:
    for message in messages:
        role = message.get("role", "user")
        title = "environment" if role == "user" else role
        console.print(
            Panel(
                Text(str(message.get("content", ""))),
                title=title,
                border_style=_STYLE.get(role, "white"),
            )
        )


def play(
    env: Any,
    *,
    seed: int | None = None,
    console: Console | None = None,
    read_line: Callable[[str], str] | None = None,
) -> list[dict[str, Any]]:
    """Play episodes until the player quits; return one outcome dict per finished episode."""
    console = console or Console()
    read_line = read_line or (lambda prompt: console.input(prompt))
    outcomes: list[dict[str, Any]] = []
    episode_seed = seed
    console.print(Text(HELP, style="dim"))
    while True:
        messages, info = env.reset(seed=episode_seed)
        if info.get("tools"):
            console.print(
                Text(
                    f"Tools: {', '.join(t['function']['name'] for t in info['tools'])}",
                    style="yellow",
                )
            )
        _show(console, messages)
        episode_return, done = 0.0, False
        while not done:
            try:
                line = read_line("action> ")
            except (EOFError, KeyboardInterrupt):
                console.print("\nbye")
                return outcomes
            command = line.strip().lower()
            if command in (":q", ":quit", ":exit"):
                console.print("bye")
                return outcomes
            if command in (":h", ":help"):
                console.print(Text(HELP, style="dim"))
                continue
            if command in (":r", ":reset"):
                break
            if command == ":hint":
                hint = getattr(env.unwrapped, "expert_action", lambda: None)()
                console.print(
                    Text(f"hint: {hint}" if hint else "this environment has no expert", style="dim")
                )
                continue
            messages, reward, terminated, truncated, info = env.step(line)
            episode_return += reward
            _show(console, messages)
            flag = "  (invalid action)" if info.get("invalid_action") else ""
            console.print(
                Text(
                    (
                        f"reward {reward:+.2f}   return {episode_return:+.2f}   turn "
                        f"{info.get('turn')}{flag}"
                    ),
                    style="bold",
                )
            )
            done = terminated or truncated
            if done:
                how = (
                    "solved"
                    if info.get("success")
                    else ("out of turns" if truncated else "episode over")
                )
                console.print(
                    Text(
                        (
                            f"Episode over: {how}. Return {episode_return:+.2f} in "
                            f"{info.get('turn')} turns."
                        ),
                        style="bold green" if info.get("success") else "bold red",
                    )
                )
                outcomes.append(
                    {
                        "return": episode_return,
                        "turns": info.get("turn"),
                        "success": bool(info.get("success")),
                        "truncated": truncated,
                    }
                )
        if done:
            try:
                again = read_line("Play again? [Y/n] ").strip().lower()
            except (EOFError, KeyboardInterrupt):
                return outcomes
            if again in ("n", "no", "q", ":q", ":quit"):
                console.print("bye")
                return outcomes
        episode_seed = None if episode_seed is None else episode_seed + 1
