"""Turning a task's tests into individual checks, and the runner that executes them.

``split_tests(tests, entry_point)`` accepts the common formats — a list of assert strings
(MBPP's ``test_list``), a HumanEval-style ``def check(candidate): ...`` block, or plain
asserts — and returns ``(setup, [test, ...])``: setup code run once, then each test on its
own, so the reward can be the fraction passed. A statement that contains an ``assert`` is a
test; everything else is setup.

``code_sandbox(backend, limits, options)`` starts the sandbox both code envs run in: a local
one is warm by default (``warm_exec=True``: a fork server inside the sandbox forks each run,
and runs ``python3 -I FILE`` in its own pre-imported interpreter, so a test run pays no
interpreter start-up).

``RUNNER`` is the program run inside the sandbox. It reads a one-time token from stdin (so
the model's code, which runs after, cannot read it there), executes the solution with its
output captured and capped, runs every test with a per-test time limit, and prints one
line ``<token> <json results>``. What it does not stop: a solution that introspects the
runner's frames to forge results; rewards are only as strong as that assumption.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping
from typing import Any

__all__ = ["RUNNER", "code_sandbox", "split_tests"]


def code_sandbox(backend: str, limits: Any, options: Mapping[str, Any] | None = None) -> Any:
    """A started sandbox of ``backend`` (``options`` go to ``make_sandbox``); ``local`` ones
    default to ``warm_exec=True``, the fork server (see the module docstring)."""
    from sandboxes import make_sandbox

    kwargs = dict(options or {})
    if backend == "local":
        kwargs.setdefault("warm_exec", True)
    return make_sandbox(backend, limits=limits, **kwargs).start()


def _has_assert(node: ast.AST) -> bool:
    return any(isinstance(child, ast.Assert) for child in ast.walk(node))


def split_tests(tests: str | list[str], entry_point: str) -> tuple[str, list[str]]:
    """``(setup, tests)`` from any supported test format (see the module docstring)."""
    if isinstance(tests, list):
        return "", [str(t) for t in tests if str(t).strip()]
    try:
        module = ast.parse(textwrap.dedent(tests))
    except SyntaxError as exc:
        raise ValueError(
            f"the task's tests are not valid Python ({exc.msg} at line {exc.lineno})"
        ) from None
    setup: list[str] = [f"candidate = {entry_point}"]
    found: list[str] = []
    for statement in module.body:
        if isinstance(statement, ast.FunctionDef) and statement.name == "check":
            argument = statement.args.args[0].arg if statement.args.args else "candidate"
            setup.append(f"{argument} = {entry_point}")
            for inner in statement.body:
                (found if _has_assert(inner) else setup).append(ast.unparse(inner))
        elif _has_assert(statement):
            found.append(ast.unparse(statement))
        else:
            setup.append(ast.unparse(statement))
    if not found:
        raise ValueError(
            "the task's tests contain no assert statements; "
            "write tests as asserts or a check(candidate) function"
        )
    return "\n".join(setup), found


RUNNER = r"""
import io, json, signal, sys, traceback

token = sys.stdin.readline().strip()
spec = json.loads(open("tests.json").read())
OUTPUT_CAP = spec["output_cap"]

class Capped(io.TextIOBase):
    def __init__(self):
        self.parts, self.size = [], 0
    def write(self, text):
        if self.size < OUTPUT_CAP:
            self.parts.append(text[: OUTPUT_CAP - self.size])
        self.size += len(text)
        return len(text)
    def text(self):
        more = f"\n... [{self.size - OUTPUT_CAP} more characters]" if self.size > OUTPUT_CAP else ""
        return "".join(self.parts) + more

class TestTimeout(BaseException):
    pass

def on_alarm(signum, frame):
    raise TestTimeout()

signal.signal(signal.SIGALRM, on_alarm)
real_stdout = sys.stdout
captured = Capped()

def short_traceback(exc, limit_chars):
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    lines = [l for l in lines if "runner.py" not in l]
    text = "".join(lines)
    return text if len(text) <= limit_chars else "... " + text[-limit_chars:]

def run(source, namespace, filename, seconds):
    sys.stdout = sys.stderr = captured
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        exec(compile(source, filename, "exec"), namespace)
        return None
    except TestTimeout:
        return f"timed out after {seconds:g}s"
    except SystemExit as exc:
        return f"SystemExit({exc.code!r})"
    except BaseException as exc:
        return short_traceback(exc, spec["traceback_chars"])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout, sys.stderr = real_stdout, sys.__stderr__

namespace = {"__name__": "solution"}
solution_error = run(
    open("solution.py").read(), namespace, "solution.py", spec["solution_timeout_s"]
)
results = []
if solution_error is None and spec["entry_point"] not in namespace:
    solution_error = f"your code does not define {spec['entry_point']!r}"
if solution_error is None:
    setup_error = run(spec["setup"], namespace, "tests.py", spec["test_timeout_s"])
    timed_out = False
    for test in spec["tests"]:
        if timed_out:  # one hung test bounds the run: the rest are not tried
            error = "not run: an earlier test timed out"
            results.append({"test": test, "passed": False, "error": error})
            continue
        error = setup_error or run(test, namespace, "tests.py", spec["test_timeout_s"])
        timed_out = error is not None and error.startswith("timed out")
        results.append({"test": test, "passed": error is None, "error": error})
report = {"solution_error": solution_error, "results": results, "output": captured.text()}
print(token + " " + json.dumps(report), file=real_stdout, flush=True)
"""
