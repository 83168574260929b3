"""Look two codes up and report them: ``tools/lookup-v0``, the smallest task that needs tools.

Each episode hides a fresh table mapping eight names (colours) to one-digit codes. The question
names two of them; the only way to know their codes is to call ``lookup`` for each (two tool
calls) and then answer with both results in order, ``<answer>3 7</answer>``. Guessing wins one
time in a hundred. The answer is graded per code (0.5 each), so half-right answers are told
apart from wrong ones; an answer that is not exactly two codes scores 0.

It is meant for tiny policies that train on a CPU in minutes: the tool calls are a handful of
distinct strings and the answer copies two digits from the tool messages, so what RL has to
learn is *to use the tools* rather than to guess. A user dataset is JSONL of
``{"names": [a, b], "table": {name: code, ...}}``.

``named=True`` labels every code with its name, in the tool's answer (``red=3``) and in the
answer asked for (``<answer>red=3 blue=7</answer>``). The copy then is the pattern a two-layer
model learns most reliably (an *induction head*: after ``red=`` comes what followed ``red=``
before) instead of "the digit of the first tool message, then of the second", which a tiny
model learns on some seeds only; the task is otherwise the same (two calls, both codes).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import numpy as np

from envhub.core import function_tool
from envhub.parsing import format_tool_call
from envs.datasets import Task
from envs.tools.answers import normalise
from envs.tools.base import ToolEnv, ToolError

__all__ = ["NAMES", "LookupEnv", "make_task"]

_SEPARATORS = re.compile(r"(?:[\s,;]|\band\b)+")
"""What may stand between the two codes of an answer (``3 7``, ``3, 7``, ``3,7``, ``3 and 7``)."""
NAMES = ("red", "blue", "green", "black", "white", "pink", "gold", "grey")


def make_task(index: int, seed: int) -> Task:
    """Task ``index``: a random code per name and two distinct names to ask about."""
    rng = np.random.default_rng(seed)
    table = {name: str(int(rng.integers(0, 10))) for name in NAMES}
    first, second = (str(n) for n in rng.choice(NAMES, size=2, replace=False))
    return {"id": f"lookup-{index:04d}", "names": [first, second], "table": table}


class LookupEnv(ToolEnv):
    """Two lookups, then the two codes as the answer (see the module docstring)."""

    tool_schemas: ClassVar[list[dict[str, Any]]] = [
        function_tool(
            "lookup",
            "The secret one-digit code of a name.",
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": list(NAMES)}},
                "required": ["name"],
            },
        )
    ]
    required_fields = ("names", "table")
    intro = "Find the codes with the lookup tool; do not guess."

    def __init__(self, *, num_builtin: int = 2_000, named: bool = False, **options: Any) -> None:
        self.num_builtin = num_builtin
        self.named = named
        options.setdefault("max_turns", 4)
        super().__init__(**options)

    def builtin_key(self) -> tuple[int]:
        return (self.num_builtin,)

    def builtin_tasks(self) -> list[Task]:
        return [make_task(i, seed=20_000 + i) for i in range(self.num_builtin)]

    def start(self, task: Task) -> str:
        first, second = task["names"]
        form = f"{first}=code {second}=code" if self.named else "code code"
        return f"What are the codes of {first} and {second}? Answer: <answer>{form}</answer>"

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        key = str(arguments.get("name", ""))
        table = self.task["table"]
        if key not in table:
            raise ToolError(f"no code for {key!r}; names: {', '.join(table)}")
        return f"{key}={table[key]}" if self.named else str(table[key])

    def grade(self, answer: str) -> float:
        """0.5 per code in its place; the codes may be separated by blanks, commas,
        semicolons or "and" (``3, 7``), and an answer of more than two codes scores 0."""
        given = [part for part in _SEPARATORS.split(normalise(answer)) if part]
        wanted = [self._code(name) for name in self.task["names"]]
        if len(given) != len(wanted):  # the two codes and nothing else: no credit for rambling
            return 0.0
        return sum(g == w for g, w in zip(given, wanted, strict=True)) / len(wanted)

    def plan(self) -> list[str]:
        calls = [format_tool_call("lookup", {"name": name}) for name in self.task["names"]]
        codes = " ".join(self._code(name) for name in self.task["names"])
        return [*calls, f"<answer>{codes}</answer>"]

    def _code(self, name: str) -> str:
        """``name``'s code as the answer writes it (``3``, or ``red=3`` when ``named``)."""
        code = str(self.task["table"][name])
        return f"{name}={code}" if self.named else code

    def random_call(self, np_random: np.random.Generator) -> str:
        return format_tool_call("lookup", {"name": str(np_random.choice(NAMES))})
