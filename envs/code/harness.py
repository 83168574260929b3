"""Turning a task's tests into individual checks, and the runner that executes them.

``split_tests(tests, entry_point)`` accepts the common formats — a list of assert strings
(MBPP's ``test_list``), a HumanEval-style ``def check(candidate): ...`` block, or plain
asserts — and returns ``(setup, [test, ...])``: setup code run once, then each test on its
own, so the reward can be the fraction passed. A statement that asserts something (other than
a constant) is a test; everything else is setup.

``fenced_blocks(text)`` lists a reply's fenced code blocks with their language labels; each
code env picks its code from them (``extract_code``, ``extract_command``).

``code_sandbox(backend, limits, options)`` starts the sandbox both code envs run in: a local
one is warm by default (``warm_exec=True``: a fork server inside the sandbox forks each run,
and runs ``python3 -I FILE`` in its own pre-imported interpreter, so a test run pays no
interpreter start-up).

``RUNNER`` is the program run inside the sandbox (``envs/code/runner.py``): the solution
runs in a process of its own that never sees the tests or the report channel, and the tests
run in a judge process that only exchanges plain values with it (see that module).
``runner_files(RUNNER)`` is what a run writes: a small loader, the runner compiled here, and its
source for a sandbox whose Python reads other bytecode. The loader runs in the directory it is
in, so the env writes each run's files (these and ``solution.py``) to a fresh directory of an
unguessable name: nothing an earlier run's code planted (a directory, FIFO or symlink at one of
these names) is in the way of the next.
"""

from __future__ import annotations

import ast
import functools
import marshal
import re
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envhub import safe_ast

__all__ = ["RUNNER", "code_sandbox", "fenced_blocks", "runner_files", "split_tests"]

_FENCE = re.compile(r"```[ \t]*([^\s`]*)[^\n`]*\n(.*?)```", re.DOTALL)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of ``text`` in order, each ``(label, body)``. An opening fence is
    ```` ``` ```` and an info string to the end of its line: the first word is the language
    (``label``, lower case, ``""`` when there is none; ``{.python}`` is ``python``), spaces
    before it and anything after it (```` ```python title=sol.py ````) are allowed and ignored.
    A block ends at the next ```` ``` ````, so fences pair up in order: the closing fence of a
    block in any language never opens a block, and the prose between blocks is never taken."""
    return [(info.strip("{}").lstrip(".").lower(), body) for info, body in _FENCE.findall(text)]


def code_sandbox(backend: str, limits: Any, options: Mapping[str, Any] | None = None) -> Any:
    """A started sandbox of ``backend`` (``options`` go to ``make_sandbox``); ``local`` ones
    default to ``warm_exec=True``, the fork server (see the module docstring)."""
    from sandboxes import make_sandbox

    kwargs = dict(options or {})
    if backend == "local":
        kwargs.setdefault("warm_exec", True)
    return make_sandbox(backend, limits=limits, **kwargs).start()


def _has_assert(node: ast.AST) -> bool:
    """``node`` asserts something that is not a constant (``assert True, "..."`` is filler
    some HumanEval tasks carry: counted as a test, it is free credit)."""
    return any(
        isinstance(child, ast.Assert) and not isinstance(child.test, ast.Constant)
        for child in ast.walk(node)
    )


def split_tests(tests: str | list[str], entry_point: str) -> tuple[str, list[str]]:
    """``(setup, tests)`` from any supported test format (see the module docstring)."""
    if isinstance(tests, list):
        return "", [str(t) for t in tests if str(t).strip()]
    try:
        module = safe_ast.parse(textwrap.dedent(tests))
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


RUNNER = (Path(__file__).parent / "runner.py").read_text(encoding="utf-8")
"""The source of ``envs.code.runner``."""

_LOADER = """import marshal, os, sys
os.chdir(os.path.dirname(os.path.abspath(__file__)))  # the run's own directory: its files
if sys.implementation.cache_tag == {tag!r}:
    with open("runner.bin", "rb") as compiled:
        code = marshal.loads(compiled.read())
else:
    with open("runner_source.py", encoding="utf-8") as source:
        code = compile(source.read(), "runner.py", "exec")
exec(code, {{"__name__": "__main__", "__builtins__": __builtins__}})
"""


@functools.cache
def runner_files(source: str) -> dict[str, bytes]:
    """The files that run ``source`` as ``python3 -I DIR/runner.py`` in a sandbox (in ``DIR``,
    where they are written, whatever the cwd): a loader, the source compiled here (a sandbox
    whose Python has this one's bytecode runs it without compiling it: that costs every run
    several milliseconds) and the source (for any other)."""
    return {
        "runner.py": _LOADER.format(tag=sys.implementation.cache_tag).encode(),
        "runner.bin": marshal.dumps(compile(source, "runner.py", "exec", dont_inherit=True)),
        "runner_source.py": source.encode(),
    }
