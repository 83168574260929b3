"""What keyword arguments an env's entry point takes, read from its signatures.

``EnvSpec.constructor_kwargs`` refuses a kwarg the env does not take (with "did you mean"),
before the env is built, and the trainer's config check does the same for ``env.kwargs``. Only
signatures are read, never the env run: a class's ``**kwargs`` that its ``__init__`` passes on
to another ``__init__`` (``super().__init__(**kwargs)``, found in its source; assumed when there
is no source) adds the parents' parameters up the MRO; one the class keeps for itself
(``def __init__(self, max_turns=None, **config)``, never passed on) accepts any keyword, as a
function's ``**kwargs`` does. An author whose class is misread registers a function taking
``**kwargs`` that builds the env.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from envhub import safe_ast

__all__ = ["accepted_keywords"]


def accepted_keywords(target: Callable[..., Any]) -> tuple[list[str] | None, bool]:
    """The keywords ``target`` (a class or function) accepts (``None``: any), and whether the
    answer was inferred by following a ``**kwargs`` up the MRO (messages then say so). Read once
    per target (``make`` asks for every env it builds: rollouts build one per episode, and the
    source parse runs under ``safe_ast``'s process-wide lock)."""
    try:
        names, followed = _accepted(target)
    except TypeError:  # an unhashable callable: read it each time
        names, followed = _accepted.__wrapped__(target)
    return (list(names) if names is not None else None), followed


@functools.lru_cache(maxsize=512)
def _accepted(target: Callable[..., Any]) -> tuple[tuple[str, ...] | None, bool]:
    names, followed = _read(target)
    return (tuple(names) if names is not None else None), followed


def _read(target: Callable[..., Any]) -> tuple[list[str] | None, bool]:
    if not inspect.isclass(target):
        names, var_keyword = _parameters(target)
        return (names if var_keyword is None else None), False
    accepted: list[str] = []
    followed = False
    for klass in target.__mro__:
        initialiser = klass.__dict__.get("__init__")
        if initialiser is None or klass is object:
            continue
        names, var_keyword = _parameters(initialiser)
        accepted += [n for n in names if n not in accepted]
        if var_keyword is None:
            return accepted, followed
        if not _passes_on(initialiser, var_keyword):
            return None, False
        followed = True
    return accepted, followed


def _parameters(function: Callable[..., Any]) -> tuple[list[str], str | None]:
    """The parameters ``function`` takes by keyword, and the name of its ``**`` parameter
    (``None`` if it has none)."""
    names: list[str] = []
    var_keyword = None
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = parameter.name
        elif parameter.kind in (
            inspect.Parameter.KEYWORD_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ) and parameter.name not in ("self", *names):
            names.append(parameter.name)
    return names, var_keyword


def _passes_on(initialiser: Callable[..., Any], var_keyword: str) -> bool:
    """Whether an ``__init__`` passes its ``**var_keyword`` to another ``__init__`` (a
    ``super().__init__(..., **x)`` call in its source); ``True`` when there is no source."""
    try:
        tree = safe_ast.parse(textwrap.dedent(inspect.getsource(initialiser)))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "__init__"
        and any(keyword.arg is None for keyword in node.keywords)
        for node in ast.walk(tree)
    )
