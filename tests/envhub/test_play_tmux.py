"""`envhub play` in a real terminal: tmux runs it, types keys, and reads the screen."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.tmux,
    pytest.mark.skipif(
        shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)"
    ),
]


class Terminal:
    """One tmux server of its own per terminal (``-L``): a shared server may be exiting after the
    previous test killed its last session, and a new session started then fails."""

    def __init__(self, command: str) -> None:
        self.name = f"envhub-{uuid.uuid4().hex[:8]}"
        self.tmux = ["tmux", "-L", self.name]
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-s", self.name, "-x", "120", "-y", "50", command],
            check=True,
        )
        subprocess.run(
            [*self.tmux, "set-option", "-t", self.name, "remain-on-exit", "on"], check=True
        )

    def screen(self) -> str:
        return subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-J", "-S", "-200", "-t", self.name],
            capture_output=True,
            text=True,
            check=False,
        ).stdout

    def type(self, text: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", self.name, "-l", text], check=True)
        subprocess.run([*self.tmux, "send-keys", "-t", self.name, "Enter"], check=True)

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if len(re.findall(pattern, screen)) >= count:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} (x{count}) never appeared on screen:\n{self.screen()}")

    def exited(self) -> bool:
        out = subprocess.run(
            [*self.tmux, "display-message", "-p", "-t", self.name, "#{pane_dead}"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return out.strip() == "1"

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True, check=False)


@pytest.fixture
def terminal():
    opened: list[Terminal] = []

    def open_terminal(command: str) -> Terminal:
        opened.append(Terminal(command))
        return opened[-1]

    yield open_terminal
    for t in opened:
        t.close()


ENVHUB = str(Path(sys.executable).with_name("envhub"))


def test_a_person_solves_guess_number_with_hints(terminal):
    term = terminal(f"{ENVHUB} play games/guess-number-easy-v0 --seed 3")
    term.wait_for(r"between 1 and 20")
    term.wait_for(r"action> ")
    for turn in range(1, 8):
        term.type(":hint")
        screen = term.wait_for(r"hint: <answer>\d+</answer>", count=turn)
        guess = re.findall(r"hint: <answer>(\d+)</answer>", screen)[-1]
        term.type(guess)
        term.wait_for(r"reward [+-]\d", count=turn)
        # the turn is over once play waits for input again: the next action, or a new game
        screen = term.wait_for(r"(action>|Play again\? \[Y/n\])\s*\Z")
        if "Episode over: solved" in screen:
            break
    screen = term.wait_for(r"Play again\? \[Y/n\]")
    assert "Correct! The number was" in screen
    assert re.search(r"Episode over: solved\. Return \+1\.00 in \d+ turns\.", screen)
    term.type("n")
    term.wait_for(r"bye")
    deadline = time.monotonic() + 10
    while not term.exited() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert term.exited(), term.screen()


def test_invalid_action_shows_feedback_and_play_continues(terminal):
    term = terminal(f"{ENVHUB} play games/sokoban-v0 --seed 1")
    term.wait_for(r"action> ")
    term.type("jump over the box")
    screen = term.wait_for(r"\(invalid action\)")
    assert "reward -0.10" in screen
    term.type("up")
    term.wait_for(r"turn 2")
    term.type(":quit")
    term.wait_for(r"bye")
