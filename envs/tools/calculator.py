"""Maths word problems solved with a calculator tool: ``tools/calculator-v0``.

Each built-in problem takes two to four arithmetic steps on awkward numbers (prices with
cents, percentages, compound interest), so a model that does the arithmetic in its head
drifts, and one that calls ``calculate`` for each step gets it right. The calculator is a
safe evaluator (an AST walk over numbers, operators and a few maths functions; no names,
no attribute access, bounded exponents, every number, argument and result within
``MAX_MAGNITUDE``, ``round``'s digits within ``MAX_ROUND_DIGITS``), so a model cannot run code
or hang the env with ``9**9**9`` or ``round(1, -10**9)``.

A user dataset is JSONL of ``{"question": str, "answer": number}`` (optional ``steps``: the
expressions the oracle should calculate, and ``tolerance``).
"""

from __future__ import annotations

import ast
import contextlib
import math
import operator
import re
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from envhub import safe_ast
from envhub.core import function_tool
from envhub.parsing import format_tool_call
from envs.datasets import Task
from envs.tools.answers import number_matches
from envs.tools.base import ToolEnv, ToolError

__all__ = ["CalculatorEnv", "make_problem", "safe_eval"]

MAX_EXPRESSION_CHARS = 500
MAX_MAGNITUDE = 1e100
MAX_ROUND_DIGITS = 20
"""``round(x, n)`` takes ``|n|`` up to this: CPython computes ``10**|n|``, so ``n=-10**9`` hangs."""
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "min": min,
    "max": max,
    "log": math.log,
    "exp": math.exp,
}


def safe_eval(expression: str) -> float | int:
    """Evaluate arithmetic; raise ``ToolError`` naming what is not allowed.

    Thousands commas (``1,234``): a comma outside every bracket cannot separate arguments, so
    there it is always read as a thousands separator. Inside brackets the expression is read
    as written, so ``max(2,500,3)`` is 500 and ``min(12,345)`` is 12, as in Python and as the
    tool's schema promises. Only when that reading has no value (``sqrt(1,000,000)`` does not
    parse, ``round(1,234.5678, 2)`` has one argument too many) is every thousands comma
    dropped and the expression read again: a reading that gives a number is never replaced.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(
            f"expression of {len(expression)} characters is too long (max {MAX_EXPRESSION_CHARS})"
        )
    written = _top_level_thousands(expression.replace("^", "**").replace("×", "*"))
    try:
        return _evaluate(written, expression)
    except ToolError as error:
        as_written = error  # the error its author can act on, if no other reading has a value
    without_commas = _THOUSANDS.sub("", written)
    if without_commas != written:
        with contextlib.suppress(ToolError):
            return _evaluate(without_commas, expression)
    raise as_written


def _top_level_thousands(expression: str) -> str:
    """``expression`` without the thousands commas that stand outside every bracket."""
    kept, depth = [], 0
    for index, char in enumerate(expression):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth <= 0 and _THOUSANDS.match(expression, index):
            continue
        kept.append(char)
    return "".join(kept)


def _evaluate(source: str, expression: str) -> float | int:
    """The value of ``source`` (``expression`` rewritten), or ``ToolError`` quoting
    ``expression`` as the model wrote it."""
    try:
        tree = safe_ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None
    except ValueError as exc:  # a lone surrogate (UnicodeEncodeError) or a NUL byte
        raise ToolError(f"cannot parse {expression!r}: {exc}") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as exc:
        raise ToolError(f"math error: {exc}") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return int(value)
    return value


def _in_range(value: Any) -> Any:
    """``value`` if it is a real number within ``MAX_MAGNITUDE``; else ``ToolError``."""
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"result out of range (the calculator works up to {MAX_MAGNITUDE:g})")
    return value


def _call(name: str, args: list[Any]) -> Any:
    """Apply an allowed function to range-checked arguments and range-check its result."""
    if name == "round" and len(args) == 2:
        ndigits = args[1]
        if not isinstance(ndigits, int) or abs(ndigits) > MAX_ROUND_DIGITS:
            raise ToolError(
                f"round's ndigits must be a whole number from {-MAX_ROUND_DIGITS} to "
                f"{MAX_ROUND_DIGITS}, got {ndigits!r:.40}"
            )
    return _in_range(_FUNCTIONS[name](*args))


def _eval(node: ast.AST) -> Any:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return _in_range(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (
            abs(right) > 100 or abs(left) > 1e6 and abs(right) > 10
        ):
            raise ToolError(f"exponent too large in {left}**{right}")
        return _in_range(_BINARY[type(node.op)](left, right))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _call(node.func.id, [_eval(arg) for arg in node.args])
    allowed = ", ".join(sorted(_FUNCTIONS))
    raise ToolError(
        f"{ast.unparse(node)!r} is not allowed; "
        f"use numbers, + - * / // % ** and the functions {allowed}"
    )


def _money(rng: np.random.Generator, low: float, high: float) -> float:
    return round(float(rng.uniform(low, high)), 2)


def make_problem(index: int, seed: int) -> Task:
    """Built-in problem ``index`` (its template is ``index % 5``), numbers drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    kind = index % 5
    if kind == 0:
        boxes, per_box, price, discount = (
            int(rng.integers(12, 90)),
            int(rng.integers(6, 25)),
            _money(rng, 0.35, 4.5),
            int(rng.integers(5, 30)),
        )
        question = (
            f"A bakery sells {boxes} boxes of {per_box} muffins. Each muffin costs ${price}. "
            f"A {discount}% discount applies to the whole order. "
            "What is the total price in dollars, rounded to cents?"
        )
        steps = [
            f"{boxes} * {per_box}",
            f"{boxes * per_box} * {price}",
            f"round({boxes * per_box} * {price} * (1 - {discount}/100), 2)",
        ]
    elif kind == 1:
        a, v1, b, v2 = (
            int(rng.integers(40, 400)),
            int(rng.integers(35, 140)),
            int(rng.integers(40, 400)),
            int(rng.integers(35, 140)),
        )
        question = (
            f"A train travels {a} km at {v1} km/h, then {b} km at {v2} km/h. "
            "What is its average speed over the whole trip in km/h, rounded to 2 decimals?"
        )
        steps = [f"{a} / {v1}", f"{b} / {v2}", f"round(({a} + {b}) / ({a} / {v1} + {b} / {v2}), 2)"]
    elif kind == 2:
        principal, rate, years, withdraw = (
            int(rng.integers(1_000, 50_000)),
            round(float(rng.uniform(1.5, 7.5)), 1),
            int(rng.integers(3, 15)),
            int(rng.integers(100, 900)),
        )
        question = (
            f"You deposit ${principal} at {rate}% annual interest, compounded yearly, "
            f"for {years} years, "
            f"then withdraw ${withdraw}. How many dollars remain, rounded to cents?"
        )
        steps = [
            f"{principal} * (1 + {rate}/100) ** {years}",
            f"round({principal} * (1 + {rate}/100) ** {years} - {withdraw}, 2)",
        ]
    elif kind == 3:
        length, width, height, coverage = (
            round(float(rng.uniform(3, 12)), 1),
            round(float(rng.uniform(2.5, 9)), 1),
            round(float(rng.uniform(2.2, 3.6)), 2),
            round(float(rng.uniform(6, 14)), 1),
        )
        question = (
            f"A room is {length} m long and {width} m wide with walls {height} m high. "
            f"One litre of paint covers {coverage} square metres. "
            "How many whole litres are needed to paint the four walls once?"
        )
        steps = [
            f"2 * ({length} + {width}) * {height}",
            f"ceil(2 * ({length} + {width}) * {height} / {coverage})",
        ]
    else:
        workers, rate, hours, units = (
            int(rng.integers(3, 40)),
            int(rng.integers(4, 30)),
            int(rng.integers(5, 11)),
            int(rng.integers(5_000, 90_000)),
        )
        question = (
            f"{workers} workers each assemble {rate} units per hour and work {hours} hours a day. "
            f"How many whole days does it take to finish an order of {units} units?"
        )
        steps = [f"{workers} * {rate} * {hours}", f"ceil({units} / ({workers} * {rate} * {hours}))"]
    answer = safe_eval(steps[-1])
    return {
        "id": f"calc-{index:04d}",
        "question": question,
        "answer": answer,
        "steps": steps,
        "seed": seed,
    }


class CalculatorEnv(ToolEnv):
    """Multi-step maths word problems with a ``calculate`` tool (see the module docstring)."""

    tool_schemas: ClassVar[list[dict[str, Any]]] = [
        function_tool(
            "calculate",
            "Evaluate an arithmetic expression exactly and return the number. "
            "Supports + - * / // % ** "
            "and sqrt, abs, round, floor, ceil, min, max, log, exp.",
            {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "e.g. '17 * 24 * 0.35'"}
                },
                "required": ["expression"],
            },
        )
    ]
    required_fields = ("question", "answer")
    intro = (
        "Solve the maths word problem. "
        "Use the calculator for every arithmetic step; do not compute in your head."
    )

    def __init__(self, *, num_builtin: int = 200, **options: Any) -> None:
        self.num_builtin = num_builtin
        super().__init__(**options)

    def builtin_key(self) -> tuple[int]:
        return (self.num_builtin,)

    def builtin_tasks(self) -> list[Task]:
        return [make_problem(i, seed=10_000 + i) for i in range(self.num_builtin)]

    def start(self, task: Task) -> str:
        return str(task["question"])

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        return str(safe_eval(arguments["expression"]))

    def grade(self, answer: str) -> float:
        """1.0 when the answer's one value (``$1,234.50``, ``**345.6**``; numbers the question
        states are ignored) is within the task's ``tolerance`` (0.01) of the expected one."""
        target = float(self.task["answer"])
        tolerance = max(float(self.task.get("tolerance", 0.01)), abs(target) * 1e-6)
        matched = number_matches(answer, target, stated=self.question, tolerance=tolerance)
        return 1.0 if matched else 0.0

    def plan(self) -> list[str]:
        calls = [
            format_tool_call("calculate", {"expression": step})
            for step in self.task.get("steps", [])
        ]
        return [*calls, f"<answer>{self.task['answer']}</answer>"]

    def random_call(self, np_random: np.random.Generator) -> str:
        a, b = (int(x) for x in np_random.integers(1, 1000, size=2))
        op = str(np_random.choice(["+", "-", "*", "/"]))
        return format_tool_call("calculate", {"expression": f"{a} {op} {b}"})
