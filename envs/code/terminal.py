"""``code/terminal-v0``: reach a goal with shell commands in a persistent sandboxed shell.

Each episode starts in a fresh or freshly reset sandbox (``sandboxes`` package, ``local``
backend by default: no network, resource limits; warm, so the checker runs are forks of a
process inside it rather than new sandbox processes) holding the task's files, and one
persistent ``bash`` session in it: ``cd``, variables and files carry over between turns.
The model sends one command (or a short script) per turn — in a ```bash block,
``<answer>...</answer>``, or bare — and sees its output (truncated) and exit code. After
every command the task's checker script runs in the same sandbox; when it passes the
episode ends with reward 1. A command that runs too long is killed (``command_timeout_s``)
and reported; the shell stays usable. The checker gets its script on stdin, so the expected
values are in no process's command line, environment or open file that the agent's session
could read (``terminal_tasks`` says what that covers).

Built-in tasks (``terminal_tasks``): counting log errors, summing a CSV column, renaming
files, fixing a failing script, editing a config, deduplicating, extracting from JSON,
making a directory tree. ``dataset=`` takes records of ``{"instruction", "files", "check"}``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from envhub.core import TextEnv, Turn
from envhub.tool_calls import blank_thinking
from envs.code.harness import code_sandbox, fenced_blocks
from envs.code.terminal_tasks import TERMINAL_KINDS, make_terminal_task
from envs.datasets import Split, Task, TaskSet, TaskSetError, as_taskset

__all__ = ["TerminalEnv", "extract_command"]

TASK_FIELDS = ("instruction", "files", "check")
"""The fields of a task of a dataset (or ``reset(options={"task": ...})``); a built-in task is
``{"kind", "seed"}`` instead."""
_SHELL = ("bash", "sh", "shell", "zsh", "console", "shell-session")
"""The fence labels of a shell block, preferred to an unlabelled block."""
_TRANSCRIPTS = ("console", "shell-session")
"""The labels of a terminal transcript: ``$ `` opens each command line, other lines are output."""
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL | re.IGNORECASE)

_CHECK_FROM_STDIN = 'IFS= read -r -d "" _envhub_check; exec 0</dev/null; eval "$_envhub_check"'
"""The checker's whole command line: read the check script from stdin with a builtin (no
child process holds it), swap stdin for ``/dev/null``, run the script. ``/proc/PID/cmdline``
is readable by every process of a PID namespace (the docker backend's session shares the
checker's), so the expected values must not be in it; and with stdin empty and closed, a
program the check runs (the agent's, in ``fix-script``) cannot read the rest of the script from
it, nor reopen it through ``/proc/PID/fd/0``. The variable is not exported: no environment
holds it either."""


def extract_command(text: str) -> str:
    """The command in a reply: the last shell block (```` ```bash ````, ``sh``, ``shell``,
    ``zsh``, ``console``, ``shell-session``; the fence's first word is its language, the rest
    of the line is ignored), else the last unlabelled block (often the output a reply expects,
    so a labelled one wins), else an ``<answer>`` block, else the text; all outside its
    ``<think>...</think>`` blocks (blanked first): a command only drafted while thinking is
    never run, and a reply with no other command is an invalid action. Blocks in other
    languages are never run.

    ``console`` and ``shell-session`` blocks are transcripts by convention (``$ ls`` then what
    it printed): when such a block has ``$ `` lines, its command is those lines without the
    prompt, and the output lines are left out. Other shell blocks run as written (``$HOME``
    at a line's start is a variable there, not a prompt)."""
    text = blank_thinking(text, leading=False)  # no env knows whether the prompt opened one
    blocks = fenced_blocks(text)
    for labels in (_SHELL, ("",)):
        chosen = [(label, body) for label, body in blocks if label in labels]
        if chosen:
            label, body = chosen[-1]
            return (_commands(body) if label in _TRANSCRIPTS else body).strip()
    answer = _ANSWER.findall(text)
    return (answer[-1] if answer else text).strip()


def _commands(transcript: str) -> str:
    """The ``$ `` lines of a transcript without their prompt; the transcript itself if none."""
    lines = [line[2:] for line in transcript.splitlines() if line.startswith("$ ")]
    return "\n".join(lines) if lines else transcript


class TerminalEnv(TextEnv):
    """Shell tasks checked by scripts, in a persistent sandboxed session.

    See the module docstring for the task format and the checks.
    """

    def __init__(
        self,
        *,
        kinds: Iterable[str] = TERMINAL_KINDS,
        dataset: str | TaskSet | Iterable[Mapping[str, Any]] | None = None,
        split: Split = "all",
        sandbox_backend: str = "local",
        sandbox_options: Mapping[str, Any] | None = None,
        command_timeout_s: float = 10.0,
        memory_mb: int = 512,
        max_output_chars: int = 2_000,
        max_turns: int | None = 12,
        render_mode: Any = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        kinds = list(kinds)
        unknown = sorted(set(kinds) - set(TERMINAL_KINDS))
        if unknown:
            raise ValueError(
                f"unknown terminal task kind(s) {unknown}; use some of {list(TERMINAL_KINDS)}"
            )
        builtin = [
            {"id": f"{kind}-{i:03d}", "kind": kind, "seed": 50_000 + i}
            for i in range(50)
            for kind in kinds
        ]
        self.tasks = as_taskset(
            dataset,
            default=builtin,
            split=split,
            required=TASK_FIELDS if dataset is not None else (),
        )
        self.sandbox_backend, self.command_timeout_s, self.memory_mb = (
            sandbox_backend,
            command_timeout_s,
            memory_mb,
        )
        self.sandbox_options = dict(sandbox_options or {})
        """Keyword arguments for ``make_sandbox`` (``{"warm_exec": False}``: no fork server)."""
        self.max_output_chars = max_output_chars
        self.invalid_action_penalty = -0.05
        self.system_prompt = (
            "You are in a bash shell in an empty Linux sandbox (no network). "
            "Reach the goal by sending one shell command (or a short script) per turn "
            "in a ```bash block. You will see its output and exit code. "
            "The episode ends when the goal is reached."
        )
        self.task: Task = {}
        self._plan: list[str] = []
        self._plan_position = 0
        self._sandbox: Any = None
        self._session: Any = None

    # ------------------------------------------------------------------ sandbox
    def _fresh_sandbox(self) -> Any:
        if self._sandbox is None:
            from sandboxes import Limits

            limits = Limits(
                wall_time_s=self.command_timeout_s,
                cpu_time_s=self.command_timeout_s,
                memory_mb=self.memory_mb,
                network=False,
                max_output_bytes=100_000,
            )
            self._sandbox = code_sandbox(self.sandbox_backend, limits, self.sandbox_options)
        else:
            self._sandbox.reset()  # empty scratch, close the old session
        return self._sandbox

    def _checked(self) -> bool:
        """Whether the task's check passes now; its script (which holds the expected values)
        travels on stdin, never in a command line (see ``_CHECK_FROM_STDIN``)."""
        result = self._sandbox.run(
            ["bash", "-c", _CHECK_FROM_STDIN],
            stdin=self.task["check"],
            timeout=self.command_timeout_s,
        )
        return result.exit_code == 0 and not result.timed_out

    # ------------------------------------------------------------------ episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        chosen = self.tasks.select(
            options, self.np_random, required=TASK_FIELDS, generated=("kind",)
        )
        task = dict(chosen) if all(key in chosen for key in TASK_FIELDS) else self._built(chosen)
        self.task = {**task, "id": chosen["id"]}
        sandbox = self._fresh_sandbox()
        for path, text in self.task["files"].items():
            sandbox.write_file(path, text)
        self._session = sandbox.session(language="bash")
        self._plan, self._plan_position = list(self.task.get("solution", [])), 0
        listing = ", ".join(sorted(self.task["files"])) or "(none)"
        return f"Goal: {self.task['instruction']}\nFiles in the current directory: {listing}", {
            "task_id": chosen["id"]
        }

    @staticmethod
    def _built(chosen: Task) -> Task:
        """The built-in task ``chosen`` names by ``kind``, drawn from its seed."""
        if chosen["kind"] not in TERMINAL_KINDS:
            raise TaskSetError(
                f"unknown terminal task kind {chosen['kind']!r}; use one of {list(TERMINAL_KINDS)}"
            )
        return make_terminal_task(chosen["kind"], int(chosen["seed"]))

    def on_step(self, action: str) -> Turn:
        command = extract_command(action)
        if self._plan_position < len(self._plan) and command == self._plan[self._plan_position]:
            self._plan_position += 1
        if not command:
            return self.invalid_action("Send a shell command, e.g. ```bash\nls -la\n```")
        result = self._session.run(command, timeout=self.command_timeout_s)
        output = (result.stdout + result.stderr).rstrip()
        if len(output) > self.max_output_chars:
            output = (
                output[: self.max_output_chars]
                + f"\n... [output truncated; {len(output) - self.max_output_chars} more characters]"
            )
        status = f"[exit code {result.exit_code}]"
        if result.timed_out:
            status = f"[killed: the command ran longer than {self.command_timeout_s:g}s]"
        elif result.output_truncated:
            status += " [the output was cut off by the sandbox]"
        text = f"{output}\n{status}" if output else status
        if self._checked():
            return Turn(
                text + "\nGoal reached.",
                reward=1.0,
                terminated=True,
                success=True,
                info={"exit_code": result.exit_code},
            )
        return Turn(text, info={"exit_code": result.exit_code, "timed_out": result.timed_out})

    # ------------------------------------------------------------------ agents
    def expert_action(self) -> str | None:
        if self.done or not self._plan:
            return None
        return f"```bash\n{self._plan[min(self._plan_position, len(self._plan) - 1)]}\n```"

    def sample_action(self, np_random: np.random.Generator) -> str:
        commands = [
            "ls",
            "pwd",
            "cat *.txt",
            "echo hello > answer.txt",
            "rm -f *.txt",
            "wc -l *",
            "cd ..",
            "true",
            "ls -1 | head -3",
            "echo 0 > total.txt",
            "mkdir x",
            "python3 -c 'print(1)'",
        ]
        choice = int(np_random.integers(len(commands) + 1))
        return (
            "I will explore first."
            if choice == len(commands)
            else f"```bash\n{commands[choice]}\n```"
        )

    # ------------------------------------------------------------------ lifecycle
    def on_close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.stop()
            self._sandbox = self._session = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sandbox"] = state["_session"] = None  # a copy starts its own sandbox on reset
        return state
