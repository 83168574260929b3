"""``ast.parse`` and ``ast.literal_eval`` that many threads can call at once.

CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state: when two
threads turn parsed source into ``ast`` nodes at the same time (a garbage collection inside one
runs a finalizer that lets the other in), one of them raises ``SystemError: AST constructor
recursion depth mismatch`` (python/cpython#106905). Envs are made and stepped on many threads
at once (``envhub eval``'s workers, env pools, the trainer's env managers), and envhub parses
Python there: an env class's ``__init__`` source (``envhub.signatures``), calculator
expressions, a code task's tests, tool arguments written as Python literals. Every such parse
goes through one lock here; uncontended it costs well under a microsecond, nothing against the
parse itself. Code that only walks ready-made nodes needs no lock.
"""

from __future__ import annotations

import ast
import threading
from typing import Any, Literal, overload

__all__ = ["literal_eval", "parse"]

_LOCK = threading.RLock()  # re-entrant: a finalizer run by a parse may parse too


@overload
def parse(source: str, filename: str = ..., mode: Literal["exec"] = ...) -> ast.Module: ...
@overload
def parse(source: str, filename: str = ..., *, mode: Literal["eval"]) -> ast.Expression: ...


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
    """``ast.parse(source, filename, mode)``, one thread at a time."""
    with _LOCK:
        return ast.parse(source, filename, mode)


def literal_eval(node_or_string: str | ast.AST) -> Any:
    """``ast.literal_eval``, its parse (of a string) one thread at a time."""
    if isinstance(node_or_string, str):  # as ast.literal_eval reads a string
        node_or_string = parse(node_or_string.lstrip(" \t"), mode="eval")
    return ast.literal_eval(node_or_string)
