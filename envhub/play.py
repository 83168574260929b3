"""``envhub play``: a person plays an environment in the terminal, as the model would.

The loop shows each observation, reads one line as the action, and shows the reward and,
at the end, the outcome. Lines starting with ``:`` are commands, never actions:
``:hint`` (the env's expert action, if any), ``:reset``, ``:help`` and ``:quit``.
End of input (Ctrl-D) quits cleanly.

An error the env raises (in ``reset``, ``step`` or ``expert_action``) is one line naming it and
where it was raised, as ``envhub check`` says it; the session goes on, so the player can
``:reset`` or ``:quit``. A message longer than ``MAX_SHOWN_CHARS`` shows its start and a note.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from envhub.core import Observation
from envhub.errors import describe_error

__all__ = ["MAX_SHOWN_CHARS", "describe_env_error", "play"]

MAX_SHOWN_CHARS = 20_000
"""Characters of one observation shown; an env's observation may be megabytes long."""

HELP = (
    "Type your action and press Enter (e.g. 'up' or '<answer>up</answer>').\n"
    "Commands: :hint  show the expert's move   :reset  new episode   :help   :quit"
)
_STYLE = {"system": "magenta", "user": "cyan", "tool": "yellow", "assistant": "green"}


def describe_env_error(error: BaseException, call: str) -> str:
    """One line for an error the env raised in ``call``: ``"the env's step() raised KeyError:
    'best' (at envs.py:12)"`` (``envhub.errors.describe_error``, at most 500 characters)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"the env's {call} raised {describe_error(error)}{where}"


def _show(console: Console, messages: Observation) -> None:
    """Show an observation's messages, at most ``MAX_SHOWN_CHARS`` characters in all: a longer
    message is cut short and the messages after it left out, each time with a note."""
    budget = MAX_SHOWN_CHARS
    for shown, message in enumerate(messages):
        if budget <= 0:
            left = len(messages) - shown
            console.print(Text(f"({left} more message(s) not shown: too long)", style="dim"))
            return
        role = message.get("role", "user")
        title = "environment" if role == "user" else role
        content = str(message.get("content", ""))
        console.print(
            Panel(Text(content[:budget]), title=title, border_style=_STYLE.get(role, "white"))
        )
        if len(content) > budget:
            console.print(
                Text(
                    f"(message truncated: showing the first {budget:,} of {len(content):,} "
                    "characters)",
                    style="dim",
                )
            )
        budget -= len(content)


def _say_error(console: Console, error: BaseException, call: str, then: str) -> None:
    console.print(
        Text(f"{describe_env_error(error, call)}; {then}", style="bold red"), soft_wrap=True
    )


def _start(env: Any, seed: int | None, console: Console) -> bool:
    """Reset ``env`` and show the opening observation; ``False`` (said) if reset raised."""
    try:
        messages, info = env.reset(seed=seed)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - the env's error, said in one line
        _say_error(console, error, f"reset(seed={seed})", "type :reset to try again, or :quit")
        return False
    if info.get("tools"):
        console.print(
            Text(
                f"Tools: {', '.join(t['function']['name'] for t in info['tools'])}",
                style="yellow",
            )
        )
    _show(console, messages)
    return True


def _hint(env: Any, console: Console) -> None:
    try:
        hint = getattr(env.unwrapped, "expert_action", lambda: None)()
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - the env's error, said in one line
        _say_error(console, error, "expert_action()", "play on without a hint")
        return
    console.print(Text(f"hint: {hint}" if hint else "this environment has no expert", style="dim"))


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
        running = _start(env, episode_seed, console)
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
            if not running:
                console.print(Text("no episode is running: :reset starts one, :quit leaves"))
                continue
            if command == ":hint":
                _hint(env, console)
                continue
            try:
                messages, reward, terminated, truncated, info = env.step(line)
            except KeyboardInterrupt:
                raise
            except BaseException as error:  # noqa: BLE001 - the env's error, said in one line
                _say_error(console, error, "step()", "this episode cannot go on: :reset or :quit")
                running = False
                continue
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
