"""The README's and the guides' Python snippets run: they are the first code users copy.

Every ```python block of README.md and docs/**/*.md runs in a fresh interpreter (so what one
registers cannot leak into another or into this process), as a script, with top-level ``await``
allowed the way ``python -m asyncio`` allows it (the EnvPool snippet is written for that REPL).
Names a snippet takes from the surrounding prose are defined first (``PRELUDES``). A block whose
first line is ``# doc-test: skip (reason)`` is not run; the reason is the skip message, and such
skips are allowed in CI only for the reasons listed in ``SKIPPED`` (anything else fails there).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
SKIP = re.compile(r"^# doc-test: skip \((.+)\)\n")

PRELUDES = {
    'files={"solution.py": code}': (
        "code = 'print(42)\\n'  # the model's solution the prose speaks of\n"
    ),
}
"""A fragment of a snippet -> code defining the names it uses without defining them."""

SKIPPED: dict[str, str] = {}
"""The README's doc-test skips and why each is acceptable (checked below: the list stays true)."""

HUB = "ws://127.0.0.1:8000"
"""A snippet that connects to the README's ``envhub serve`` runs against a real one, started on a
free port (``tests.envhub.server.hubtools.envhub_serve``), with ``token`` defined."""

MODEL = "http://127.0.0.1:8000/v1"
"""A snippet that calls the README's model server runs against a scripted OpenAI-compatible one
(``tests.envhub.openai_servers``) that answers every turn with a (wrong) final answer."""

RUN = '"runs/quickstart"'
"""A snippet that opens the README's run folder reads a real trajectory store written here
(``tests.envhub.test_runs.write_run``: training and eval parts, metrics)."""

RUNNER = """
import ast, asyncio, sys, types
source = sys.stdin.read()
code = compile(source, "README.md snippet", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
namespace = sys.modules["__main__"].__dict__  # as a script would: its classes pickle as __main__.X
if code.co_flags & 0x80:  # CO_COROUTINE: the snippet awaits at top level
    asyncio.run(types.FunctionType(code, namespace)())
else:
    exec(code, namespace)
"""


DOCS = sorted((README.parent / "docs").rglob("*.md"))
"""The guides beside the README: their snippets are copied as often."""


def snippets() -> list[tuple[str, str]]:
    """``(file:line, source)`` of every python block of the README and the docs."""
    found = []
    for path in [README, *DOCS]:
        text = path.read_text()
        name = path.relative_to(README.parent)
        found += [
            (f"{name}:{text.count(chr(10), 0, match.start()) + 2}", match.group(1))
            for match in BLOCK.finditer(text)
        ]
    return found


SNIPPETS = snippets()


def test_the_readme_has_python_snippets_and_every_skip_is_known() -> None:
    assert len(SNIPPETS) >= 5
    reasons = [m.group(1) for _, source in SNIPPETS if (m := SKIP.match(source))]
    assert all(any(known in reason for known in SKIPPED) for reason in reasons), reasons


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("where", "source"), SNIPPETS, ids=[where for where, _ in SNIPPETS])
def test_readme_snippet_runs(where: str, source: str, tmp_path: Path) -> None:
    skip = SKIP.match(source)
    if skip:
        pytest.skip(f"{where}: {skip.group(1)}")
    prelude = "".join(code for fragment, code in PRELUDES.items() if fragment in source)
    with contextlib.ExitStack() as stack:
        if HUB in source:  # the README's hub, for real
            from tests.envhub.server.hubtools import TOKEN, envhub_serve

            _, port = stack.enter_context(envhub_serve("--env", "games/sokoban-v0"))
            prelude += f"import envhub\ntoken = {TOKEN!r}\n"
            source = source.replace(HUB, f"ws://127.0.0.1:{port}")
        if MODEL in source:
            from tests.envhub.openai_servers import completion, scripted_server

            wrong = completion("<answer>0</answer>")
            server = stack.enter_context(scripted_server(lambda _: wrong))
            source = source.replace(MODEL, server.url)
        if RUN in source:
            from tests.envhub.test_runs import write_run

            write_run(tmp_path)
            source = source.replace(RUN, repr(str(tmp_path)))
        run_snippet(where, prelude + source)


def run_snippet(where: str, source: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=source,
        capture_output=True,
        text=True,
        cwd=README.parent,
        timeout=170,
        check=False,  # the assert below shows the output
    )
    assert proc.returncode == 0, f"the snippet at {where} failed:\n{source}\n{proc.stderr[-3000:]}"


def test_the_served_policy_is_evaluated_on_the_trainers_evaluation_seeds() -> None:
    """The README's ``envhub eval`` of a served quickstart policy plays the seeds the trainer's
    ``eval/success`` is measured on (from ``EVAL_SEED_BASE``; training seeds stay below it),
    as many as the quickstart evaluates, so the two figures compare."""
    from trainer.config import load_config
    from trainer.rollout.groups import EVAL_SEED_BASE

    text = README.read_text()
    start = text.index("**Serve the policy you trained.**")
    command = text[start : text.index("```\n", text.index("```console", start) + 10)]
    episodes = load_config(README.parent / "examples" / "quickstart.yaml").eval.episodes
    assert f"--seed {EVAL_SEED_BASE} --episodes {episodes}" in command, command
