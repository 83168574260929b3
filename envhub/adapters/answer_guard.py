"""Keep a dataset's scorer from running the model's answer as code, stalling on it, or
passing junk.

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

An answer the screen admits can still cost unbounded CPU (sympy simplifying the derivative of
``(x+1)**1000*(x+2)**1000*...``), so the adapter runs the scorer in a ``ScoringProcess``,
killed past its time limit. ``SCORE_FIXES`` replaces the scorers that give success to junk.
"""

from __future__ import annotations

import ast
import builtins
import cmath
import contextlib
import functools
import gc
import inspect
import math
import operator
import os
import pickle
import re
import resource
import signal
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from envhub import safe_ast
from envhub.errors import SourceError

__all__ = [
    "SCORE_FIXES",
    "ScorerError",
    "ScoringProcess",
    "UnsafeScorer",
    "check_expression",
    "guard_scorer",
    "literal",
    "screened_parse_expr",
]

MAX_ANSWER = 10_000
"""Longest answer text either guard reads."""
MAX_EXPONENT = 1_000
"""Largest exponent an expression may raise to, counting the exponents of a power it raises
(``(9**999)**999`` is ``9**998001``) and computing one made of numbers (``9**(999*999)``):
sympy would compute the ~10**6-digit integer eagerly."""
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
_ARITHMETIC: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}  # fmt: skip


class UnsafeScorer(RuntimeError):
    """A scorer runs answer text as code in a way ``guard_scorer`` cannot make safe."""


class ScorerError(RuntimeError):
    """The scorer raised on an answer, or its ``ScoringProcess`` died (the message says how)."""


def literal(source: Any, globals: Any = None, locals: Any = None) -> Any:
    """``eval`` for scorers that meant a Python literal: ``ast.literal_eval``, nothing else."""
    if not isinstance(source, str) or len(source) > MAX_ANSWER:
        raise ValueError("the answer is not a literal of at most 10,000 characters")
    return safe_ast.literal_eval(source)


def check_expression(text: str, names: Iterable[str] = ()) -> None:
    """ValueError unless ``text`` (``^`` read as ``**``) is arithmetic over numbers, symbols,
    ``FUNCTIONS``, ``CONSTANTS`` and ``names`` (the scorer's own variables)."""
    if len(text) > MAX_ANSWER:
        raise ValueError(f"the expression is longer than {MAX_ANSWER} characters")
    try:
        tree = safe_ast.parse(text.replace("^", "**"), mode="eval")
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
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Pow)
            and (
                any(isinstance(n, ast.Pow) for n in ast.walk(node.right))
                or not abs(_exponent(node)) <= MAX_EXPONENT  # NaN too
            )
        ):
            raise ValueError(
                f"exponents are at most {MAX_EXPONENT}, counting those of a power raised "
                "again, and are not powers"
            )


def _exponent(power: ast.BinOp) -> float:
    """The exponent ``power`` raises its innermost base to: its own (computed when made of
    numbers; 1 when it holds a symbol, which sympy leaves unevaluated) times that of a power it
    raises, so ``(9**999)**999`` gives 998001."""
    own = _constant(power.right)
    base = power.left
    while isinstance(base, ast.UnaryOp):
        base = base.operand
    inner = _exponent(base) if isinstance(base, ast.BinOp) and isinstance(base.op, ast.Pow) else 1
    return (1.0 if own is None else own) * inner


def _constant(node: ast.expr) -> float | None:
    """The value of arithmetic over numbers as a float: ``inf`` past a float's range or nested
    too deeply to compute (refused either way); None when ``node`` holds a symbol or a call,
    or divides by zero (sympy's ``zoo``, not a large number)."""
    try:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp):
            value = _constant(node.operand)
            return None if value is None else -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            left, right = _constant(node.left), _constant(node.right)
            if left is None or right is None:
                return None
            return _ARITHMETIC[type(node.op)](left, right)
    except ZeroDivisionError:
        return None
    except (OverflowError, RecursionError):
        return math.inf
    return None


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


class ScoringProcess:
    """``score(answer, entry)`` run in a helper process that is killed when it runs too long.

    A scorer can take unbounded CPU on a crafted answer, and Python cannot stop a thread (a
    bigint power in sympy does not even release the GIL). So the first call forks a child of
    this process, which shares the dataset copy-on-write (nothing to rebuild or pickle), and
    every call sends it ``(answer, entry)`` over a pipe: a round trip of 50-150 us. One object
    may serve many envs of a dataset, from any thread (calls take turns).

    Guarantees:

    1. **A call returns within its ``time_limit_s``** (plus the round trip, and the turn of a
       call from another thread). Past it the child is SIGKILLed and reaped, the call returns
       ``None``, and the next call forks a fresh child.
    2. **The scorer's failures raise ``ScorerError``**: an exception it raises, or its child
       dying (a crash, the OOM killer), named in the message; a dead child is replaced.
    3. **No child outlives its use**: ``close()``, collecting this object and interpreter exit
       kill it. An orphaned child stops on its own: when idle, at the end of its pipe; inside
       a call, at its CPU limit (``RLIMIT_CPU``: the call's limit + 1 s). Ctrl-C is left to
       the parent (the child ignores SIGINT).
    4. **A child serves the process that forked it**: in a forked copy of this process, the
       object forks a child of its own.

    Not covered: memory (an answer may allocate what it can in its time; and the child keeps
    this process's memory as it was at the fork, so what this process frees or rewrites later
    stays resident in the child while it lives); the limit is wall clock, so it counts time the
    child waits for a busy CPU (set it with headroom); fork-unsafe state (a lock another thread
    held at fork time stays held in the child: scorers, pure Python over sympy, take none that
    matters). POSIX only: it needs ``os.fork``.
    """

    def __init__(self, score: Callable[[Any, Any], Any]) -> None:
        self.score = score
        self._conn: Connection | None = None
        self._reaper: weakref.finalize[Any, Any] | None = None
        self._pid: int | None = None
        self._owner: int | None = None
        """The process that forked the child (a forked copy of this object must not use it)."""
        self._lock, self._lock_owner = threading.Lock(), os.getpid()

    @property
    def pid(self) -> int | None:
        """This process's child's id; None until a call starts one (or after ``close()``)."""
        return self._pid if self._owner == os.getpid() else None

    def __call__(self, answer: Any, entry: Any, time_limit_s: float) -> float | None:
        """``score(answer, entry)`` as a float, or None when it ran past ``time_limit_s``."""
        try:
            request = pickle.dumps((answer, entry, time_limit_s))
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            raise SourceError(
                f"the task entry cannot be sent to the scoring process ({error}); make its "
                "fields plain data (str, numbers, lists, dicts), as JSON would"
            ) from None
        if self._lock_owner != os.getpid():  # forked while another thread may have held it
            self._lock, self._lock_owner = threading.Lock(), os.getpid()
        with self._lock:
            return self._ask(request, time_limit_s)

    def close(self) -> str:
        """Kill and reap the child, if this process has one; how it ended ('' if none)."""
        reaper, self._reaper, self._conn, self._owner = self._reaper, None, None, None
        return (reaper() or "") if reaper is not None else ""

    def _ask(self, request: bytes, time_limit_s: float) -> float | None:
        conn = self._child()
        try:
            conn.send_bytes(request)
        except OSError:  # it died while idle: a fresh one takes the call
            self.close()
            conn = self._child()
            conn.send_bytes(request)
        if not conn.poll(time_limit_s):
            self.close()
            return None
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            raise ScorerError(f"the scoring process died ({self.close()})") from None
        if kind == "raised":
            raise ScorerError(value)
        return float(value)

    def _child(self) -> Connection:
        """The pipe to this process's child, forking one if there is none."""
        if self._conn is not None and self._owner == os.getpid():
            return self._conn
        self.close()  # a forked copy of this object holds another process's child
        ours, theirs = Pipe()
        pid = os.fork()
        if pid == 0:  # the child: serve until the pipe closes, and never return to the caller
            try:
                ours.close()
                _serve(theirs, self.score)
            finally:
                os._exit(0)
        theirs.close()
        self._conn, self._pid, self._owner = ours, pid, os.getpid()
        self._reaper = weakref.finalize(self, _kill, pid, ours, self._owner)
        return ours


def _serve(conn: Connection, score: Callable[[Any, Any], Any]) -> None:
    """The child's loop: reply to each ``(answer, entry, time_limit_s)`` with
    ``("score", value)`` or ``("raised", message)`` until the pipe closes."""
    gc.freeze()  # the parent's garbage is the parent's: no finalizer of it runs here
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    while True:
        try:
            answer, entry, time_limit_s = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        _allow_cpu(time_limit_s + 1.0)
        try:
            reply: tuple[str, Any] = ("score", float(score(answer, entry)))
        except Exception as error:  # noqa: BLE001 - the caller raises it as ScorerError
            reply = ("raised", f"{type(error).__name__}: {error}"[:500])
        conn.send(reply)


def _allow_cpu(seconds: float) -> None:
    """Let this process use ``seconds`` more CPU time before the kernel ends it (SIGXCPU)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _kill(pid: int, conn: Connection, owner: int) -> str:
    """SIGKILL and reap child ``pid`` if this process (``owner``) forked it; how it ended."""
    conn.close()
    if os.getpid() != owner:
        return ""
    from envhub.pool.procs import describe_exit

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "reaped elsewhere"
    return describe_exit(os.waitstatus_to_exitcode(status))


# ---- scorers that give success to junk ------------------------------------------------------
def _game_of_life_halting(dataset: Any, answer: str | None, entry: dict[str, Any]) -> float:
    """Upstream compares bool(answer) with bool('True'/'False'): any non-empty text matched."""
    expected = str(entry["answer"]).strip().casefold()
    return float(answer is not None and answer.strip().casefold() == expected)


def _complex_arithmetic(dataset: Any, answer: str | None, entry: dict[str, Any]) -> float:
    """Upstream scores min(1.0, exp(-|answer - result|)), and min(1.0, nan) is 1.0: 'nan'
    scored 1. A number that is not finite scores 0."""
    parsed = dataset.parse_string_to_complex(answer) if answer is not None else None
    if isinstance(parsed, complex) and not cmath.isfinite(parsed):
        return 0.0
    return float(dataset.score_answer(answer, entry))


SCORE_FIXES: dict[str, Callable[[Any, str | None, dict[str, Any]], float]] = {
    "game_of_life_halting": _game_of_life_halting,
    "complex_arithmetic": _complex_arithmetic,
}
"""reasoning-gym dataset name -> ``fix(dataset, answer, entry)``, scored in place of the
dataset's ``score_answer`` (each fix's docstring says what upstream let through). Every
reference answer still scores 1 (tests/envhub/adapters/test_reasoning_gym.py)."""
