"""Keep a dataset's scorer from running the model's answer as code.

Some reasoning-gym scorers read the answer with ``eval(answer)`` (a Python literal was meant:
a matrix, a list of strings) or sympy's ``parse_expr(answer)`` (an expression was meant; it
ends in ``eval`` too), in the env's own process. An answer ``__import__('os').system(...)``
then runs on the rollout host, and ``setattr(...)`` on the adapter gives itself reward 1.

``guard_scorer(dataset_class)`` rebinds those names in the module of the class's
``score_answer``, where that method uses them:

- ``eval`` -> ``literal``: ``ast.literal_eval`` (numbers, strings, lists, tuples, dicts, sets);
- ``parse_expr`` (imported by name, or reached as ``sympy.parse_expr`` / ``sp.parse_expr``) ->
  ``screened_parse_expr``: the answer must first be arithmetic over numbers, free symbols and
  common math functions (``check_expression``: no attributes, strings, subscripts, underscores,
  no name of sympy's or Python's namespace but those, powers of bounded size), then sympy
  parses it as before.

A scorer that uses any other way of running text (``exec``, ``compile``, ``sympify``) is
refused by ``guard_scorer`` (``UnsafeScorer``), so a new dataset with a new sink is not played
unguarded.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["UnsafeScorer", "check_expression", "guard_scorer", "literal", "screened_parse_expr"]

MAX_ANSWER = 10_000
"""Longest answer text either guard reads."""
MAX_EXPONENT = 1_000
"""Largest literal exponent an expression may raise to (``2**10**9`` would hang sympy)."""
MAX_INTEGER = 10**100
FUNCTIONS = frozenset(
    {
        "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot",
        "sinh", "cosh", "tanh", "exp", "log", "ln", "sqrt", "Abs", "abs", "floor", "ceiling",
        "sign", "Rational",
    }
)  # fmt: skip
"""Functions an expression may call."""
CONSTANTS = frozenset({"pi", "E", "I", "oo"})
_NODES = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv,
    ast.Mod, ast.Pow, ast.USub, ast.UAdd, ast.Load, ast.Name, ast.Call, ast.Constant,
)  # fmt: skip
_SINK = re.compile(r"(?:(?<![\w.])(eval|exec|compile|S)|\b(sympify|parse_expr))\s*\(")
"""Calls that run text as code (``S("...")`` is sympify; ``re.compile`` is not one)."""
_GUARDED = frozenset({"eval", "parse_expr"})


class UnsafeScorer(RuntimeError):
    """A scorer runs answer text as code in a way ``guard_scorer`` cannot make safe."""


def literal(source: Any, globals: Any = None, locals: Any = None) -> Any:
    """``eval`` for scorers that meant a Python literal: ``ast.literal_eval``, nothing else."""
    if not isinstance(source, str) or len(source) > MAX_ANSWER:
        raise ValueError("the answer is not a literal of at most 10,000 characters")
    return ast.literal_eval(source)


def check_expression(text: str, names: Iterable[str] = ()) -> None:
    """ValueError unless ``text`` (``^`` read as ``**``) is arithmetic over numbers, symbols,
    ``FUNCTIONS``, ``CONSTANTS`` and ``names`` (the scorer's own variables)."""
    if len(text) > MAX_ANSWER:
        raise ValueError(f"the expression is longer than {MAX_ANSWER} characters")
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise ValueError(f"not an expression: {error}") from None
    known = set(names) | FUNCTIONS | CONSTANTS
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            raise ValueError(f"{type(node).__name__} is not arithmetic")  # noqa: TRY004
        if isinstance(node, ast.Name) and (
            node.id.startswith("_") or (node.id in _namespace() and node.id not in known)
        ):
            raise ValueError(f"{node.id!r} is not a symbol or a math function")
        if isinstance(node, ast.Call) and (
            node.keywords or not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS
        ):
            raise ValueError("only math functions may be called, without keywords")
        if isinstance(node, ast.Constant) and (
            type(node.value) not in (int, float)
            or (type(node.value) is int and abs(node.value) > MAX_INTEGER)
        ):
            raise ValueError(f"{node.value!r:.40} is not a number of a sensible size")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exponent = node.right
            if any(isinstance(n, ast.Pow) for n in ast.walk(exponent)) or (
                isinstance(exponent, ast.Constant)
                and isinstance(exponent.value, int | float)
                and abs(exponent.value) > MAX_EXPONENT
            ):
                raise ValueError(f"exponents are at most {MAX_EXPONENT}, not powers")


def screened_parse_expr(parse_expr: Callable[..., Any]) -> Callable[..., Any]:
    """``parse_expr`` that first ``check_expression``s the text (the scorer's ``local_dict``
    names are its variables)."""

    @functools.wraps(parse_expr)
    def parse(s: str, local_dict: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        check_expression(s, names=local_dict or ())
        return parse_expr(s, local_dict, *args, **kwargs)

    parse.guarded = True  # type: ignore[attr-defined]
    return parse


class _Sympy(types.ModuleType):
    """sympy as one dataset module sees it: ``parse_expr`` screened, the rest sympy's own."""

    def __init__(self, sympy: types.ModuleType) -> None:
        super().__init__(sympy.__name__)
        self.parse_expr = screened_parse_expr(sympy.parse_expr)
        self._sympy = sympy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sympy, name)


def guard_scorer(cls: type) -> None:
    """Rebind the code-running names ``cls.score_answer`` uses (see the module docstring);
    ``UnsafeScorer`` if it uses one that cannot be guarded. Idempotent."""
    method = getattr(cls, "score_answer", None)
    if method is None:
        return
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        raise UnsafeScorer(f"{cls.__name__}.score_answer has no source to check") from None
    sinks = {match.group(1) or match.group(2) for match in _SINK.finditer(source)}
    if not sinks:
        return
    if sinks - _GUARDED:
        raise UnsafeScorer(
            f"{cls.__name__}.score_answer runs answer text through {sorted(sinks - _GUARDED)}, "
            "which envhub cannot make safe; this dataset is not offered"
        )
    module = sys.modules[method.__module__]
    if "eval" in sinks and getattr(module, "eval", None) is not literal:
        module.eval = literal  # type: ignore[attr-defined]
    if "parse_expr" in sinks:
        for name, value in list(vars(module).items()):
            if name == "parse_expr" and not getattr(value, "guarded", False):
                setattr(module, name, screened_parse_expr(value))
            elif isinstance(value, types.ModuleType) and value.__name__ == "sympy":
                setattr(module, name, value if isinstance(value, _Sympy) else _Sympy(value))


@functools.cache
def _namespace() -> frozenset[str]:
    """Names an expression's text could reach in sympy's parser: Python's builtins and
    ``from sympy import *``."""
    import sympy

    return frozenset(vars(builtins)) | frozenset(getattr(sympy, "__all__", dir(sympy)))
