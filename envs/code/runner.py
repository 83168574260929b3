"""The test runner the code envs run inside their sandbox (``python3 -I runner.py``); stdlib only.

The submitted code is the adversary, and reward is what it wants: anything in the process that
runs it can be patched, read or forged by it. So two processes share the work:

- the *solution process* is forked first, before anything secret is read. It runs the submitted
  code, then answers calls: a function name and plain-value arguments in, a plain value (or
  the exception raised) out. Its output goes to a pipe; it has neither the tests nor the token.
- the *judge* (this process, which never runs submitted code) then reads the one-time token and
  the task from stdin, runs the task's prompt (its helper functions: the tests use those, not
  the solution's versions of them), binds the entry point to a proxy that calls into the
  solution process, runs each test, decides pass or fail itself, and prints ``<token> <json
  report>``. It is made non-dumpable first, so a process of the same uid (the solution) cannot
  read its memory or reopen its stdin / stdout through ``/proc``.

Only plain values cross (``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
``bytes``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, checked by exact type; an
object with ``tolist()``, a numpy value, is sent as that): a returned object cannot decide
its own equality, and the judge compares what it rebuilt from data. No other name of the
solution reaches the tests (a solution's own ``abs`` or ``sorted`` would decide comparisons).
What this costs a task: tests call the entry point with plain values and get plain values
back (one that returns an object of its own fails the test, saying so), and an argument the
solution mutates in place is not seen mutated by the test.

Report: ``{"solution_error", "results": [{"test", "passed", "error", "kind"}], "output"}``:
the solution's output capped at ``output_cap`` bytes; one hung test ends the run (the rest are
"not run"), as does the solution process's end. ``kind`` says whose failure a test's is:
``"passed"``; ``"raised"``, the solution raised (``error`` is its own traceback); ``"wrong"``,
the test's check failed on what the solution returned (``error`` is the test's traceback, which
may quote the test's expected value: the env decides what to show); ``"stopped"``, a time
limit or the solution process's end (``error`` says which).
"""

from __future__ import annotations

import builtins
import json
import os
import select
import signal
import struct
import sys
import traceback
from typing import Any, NoReturn  # (before the fork: the prompt and the solution import it too)

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 16 << 20
"""Largest message either side accepts (a bigger one ends the solution process)."""
MAX_DEPTH = 100
"""Deepest nesting of a plain value."""
TRACEBACK_CHARS = 4000
"""The solution process's tracebacks are cut to this (the judge cuts them further)."""
_INT_TEXT = 4000
"""Integers with more digits travel in hex (decimal text of those is refused by Python)."""
_SCALARS = (type(None), bool, float, str)
_NOT_RAISED = (SystemExit, KeyboardInterrupt, GeneratorExit)
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)
"""Raised inside a test's ``map()``/``filter()`` (C iterators, outside PEP 479) these would end
the iteration early and pass the test: the judge raises them as ``SolutionError``."""


# ---- plain values ------------------------------------------------------------------------------
def encode(value: Any, depth: int = 0) -> Any:
    """``value`` as a JSON tree (containers tagged: ``{"tuple": [...]}``); TypeError for
    anything that is not a plain value, by exact type (a subclass could redefine ``==``)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"the value is nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is int:
        return value if value.bit_length() < _INT_TEXT * 3 else {"int": hex(value)}
    if kind in (list, tuple, set, frozenset):
        return {kind.__name__: [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    tolist = getattr(kind, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        return encode(tolist(value), depth + 1)
    raise TypeError(f"a {kind.__name__} object is not a plain value")


_BUILD = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def decode(tree: Any, depth: int = 0) -> Any:
    """The plain value ``encode`` made ``tree`` from; ValueError for anything else."""
    if depth > MAX_DEPTH:
        raise ValueError("too deep")
    if type(tree) in _SCALARS or type(tree) is int:
        return tree
    if type(tree) is not dict or len(tree) != 1:
        raise ValueError("not an encoded value")
    ((tag, body),) = tree.items()
    if tag in _BUILD and type(body) is list:
        return _BUILD[tag](decode(item, depth + 1) for item in body)
    if tag == "dict" and type(body) is list:
        pairs = [(decode(p[0], depth + 1), decode(p[1], depth + 1)) for p in body if _pair(p)]
        if len(pairs) != len(body):
            raise ValueError("a dict entry is not a pair")
        return dict(pairs)
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "int" and type(body) is str:
        return int(body, 16)
    if tag == "complex" and type(body) is list and len(body) == 2:
        return complex(*(float(part) for part in body))
    raise ValueError(f"unknown tag {tag!r}")


def _pair(item: Any) -> bool:
    return type(item) is list and len(item) == 2


def send(fd: int, message: Any) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"the value takes {len(data)} bytes, over {MAX_MESSAGE}")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def short_traceback(exc: BaseException, limit_chars: int) -> str:
    """The traceback without this file's frames, cut to its last ``limit_chars``."""
    try:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        text = "".join(line for line in lines if "runner.py" not in line)
    except BaseException:  # noqa: BLE001 - e.g. a recursion limit the solution changed
        text = f"{type(exc).__name__}\n"
    return text if len(text) <= limit_chars else "... " + text[-limit_chars:]


# ---- the solution process ----------------------------------------------------------------------
def solution_process(calls: int, answers: int) -> NoReturn:
    """Run ``solution.py``, say which functions it defined, then answer calls until the judge
    hangs up."""
    limit_chars = TRACEBACK_CHARS
    namespace: dict[str, Any] = {"__name__": "solution"}
    try:
        with open("solution.py", encoding="utf-8", errors="replace") as source:
            exec(compile(source.read(), "solution.py", "exec"), namespace)  # noqa: S102
        error = None
    except SystemExit as exc:
        error = f"SystemExit({exc.code!r})"
    except BaseException as exc:  # noqa: BLE001 - reported to the judge
        error = short_traceback(exc, limit_chars)
    functions = [name for name, value in list(namespace.items()) if callable(value)]
    _flush()
    send(answers, {"error": error, "functions": functions})
    reader = _Reader(calls)
    while True:
        call = reader.message(None)
        if call is None:
            os._exit(0)
        try:
            value = namespace[call["call"]](*decode(call["args"]), **decode(call["kwargs"]))
        except BaseException as exc:  # noqa: BLE001 - the test decides what it means
            answer: dict[str, Any] = _raised(exc, limit_chars)
        else:
            try:
                answer = {"value": encode(value)}
            except BaseException as exc:  # noqa: BLE001 - not a plain value
                answer = _not_plain(call["call"], value, exc)
        _flush()
        try:
            send(answers, answer)
        except ValueError as exc:  # too big to send
            send(answers, _not_plain(call["call"], value, exc))


def _not_plain(name: str, value: Any, why: BaseException) -> dict[str, Any]:
    if isinstance(why, TypeError):
        what = f"{name} returned a {type(value).__name__} object; the tests take plain values "
        what += "(numbers, strings, bytes, lists, tuples, dicts, sets, None)"
    else:
        what = f"{name} returned a value the tests cannot take: {why}"
    return {"raised": "TypeError", "message": what, "traceback": f"TypeError: {what}\n"}


def _raised(exc: BaseException, limit_chars: int) -> dict[str, Any]:
    try:
        message = str(exc)[:limit_chars]
    except BaseException:  # noqa: BLE001 - a hostile __str__
        message = ""
    return {
        "raised": type(exc).__name__,
        "message": message,
        "traceback": short_traceback(exc, limit_chars),
    }


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001, S110 - the solution's streams
            pass


class _Reader:
    """Length-prefixed JSON messages from a pipe; with ``output``, the solution's output is
    drained (and capped) while waiting, so a chatty solution cannot block on a full pipe."""

    def __init__(self, fd: int, output: _Output | None = None) -> None:
        self.fd, self.output, self.buffer = fd, output, b""

    def message(self, limit: int | None) -> Any:
        """The next message (None at end of file); ValueError for a malformed one."""
        want = _HEADER.size
        while True:
            if len(self.buffer) >= want:
                if want == _HEADER.size:
                    (size,) = _HEADER.unpack(self.buffer[: _HEADER.size])
                    if size > (limit or MAX_MESSAGE):
                        raise ValueError(f"a message of {size} bytes")
                    want += size
                    continue
                data, self.buffer = self.buffer[_HEADER.size : want], self.buffer[want:]
                return json.loads(data)
            if not self._read():
                return None

    def _read(self) -> bool:
        fds = [self.fd] if self.output is None else [self.fd, self.output.fd]
        while True:
            ready, _, _ = select.select(fds, [], [])
            if self.output is not None and self.output.fd in ready:
                self.output.drain()
            if self.fd in ready:
                chunk = os.read(self.fd, 1 << 16)
                self.buffer += chunk
                return bool(chunk)


# ---- the judge ---------------------------------------------------------------------------------
class _Output:
    """The solution's output: the first ``cap`` bytes kept, the rest counted."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap, self.kept, self.size = fd, cap, b"", 0
        os.set_blocking(fd, False)

    def drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.kept += chunk[: max(0, self.cap - len(self.kept))]
            self.size += len(chunk)

    def text(self) -> str:
        self.drain()
        more = self.size - len(self.kept)
        return self.kept.decode(errors="replace") + (f"\n... [{more} more bytes]" if more else "")


class TestTimeout(BaseException):
    """SIGALRM in the judge: the test (or the solution's start) ran out of time."""


class SolutionError(Exception):
    """The solution raised an exception that is not a builtin one (its name is the message)."""


class SolutionGone(Exception):
    """The solution process ended, or sent what no solution process sends."""


class Solution:
    """The judge's end of the solution process."""

    def __init__(self, pid: int, calls: int, answers: int, output: _Output) -> None:
        self.pid, self.calls, self.reader = pid, calls, _Reader(answers, output)
        self.gone: str | None = None

    def ready(self) -> dict[str, Any]:
        """The solution's start-up report: ``{"error", "functions"}``."""
        hello = self._answer()
        error, functions = hello.get("error"), hello.get("functions")
        if type(functions) is not list or not (error is None or type(error) is str):
            raise self._end("sent an unreadable start-up report")
        return hello

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.gone is not None:
            raise SolutionGone(self.gone)
        try:
            request = {"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)}
        except (TypeError, ValueError) as exc:
            raise TypeError(f"this test passes the solution something it cannot send: {exc}")
        try:
            send(self.calls, request)
        except OSError:
            raise self._end("was not there to take the call") from None
        answer = self._answer()
        if "value" in answer:
            try:
                return decode(answer["value"])
            except (ValueError, TypeError, RecursionError):
                raise self._end("sent an unreadable value") from None
        raise _as_exception(answer)

    def _answer(self) -> dict[str, Any]:
        try:
            answer = self.reader.message(MAX_MESSAGE)
        except (ValueError, RecursionError):
            raise self._end("sent an unreadable answer") from None
        except TestTimeout:
            self._end("was stopped: it ran out of time")
            raise
        if answer is None:
            raise self._end(self._exit_status())
        if type(answer) is not dict:
            raise self._end("sent an unreadable answer")
        return answer

    def _exit_status(self) -> str:
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            return "ended"
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            return f"was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
        return f"exited with code {os.waitstatus_to_exitcode(status)}"

    def _end(self, why: str) -> SolutionGone:
        """Stop the solution process for good; the error to raise."""
        if self.gone is None:
            self.gone = f"your code's process {why}"
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        return SolutionGone(self.gone)


class Remote:
    """A function of the solution, as the tests call it."""

    def __init__(self, solution: Solution, name: str) -> None:
        self.solution, self.__name__ = solution, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.solution.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<function {self.__name__}>"


def _as_exception(answer: dict[str, Any]) -> BaseException:
    """The exception the solution raised, as the test can catch it: a builtin exception of the
    same type, else ``SolutionError`` (always for ``_CONTROL_FLOW``); it carries the solution's
    traceback for the report."""
    name, message = str(answer.get("raised")), str(answer.get("message", ""))
    kind = getattr(builtins, name, None)
    exc: BaseException = SolutionError(f"{name}: {message}")
    if (
        isinstance(kind, type)
        and issubclass(kind, Exception)
        and not issubclass(kind, _NOT_RAISED + _CONTROL_FLOW)
    ):
        try:
            exc = kind(message)
        except BaseException:  # noqa: BLE001, S110 - a constructor with other arguments
            pass
    exc.solution_traceback = str(answer.get("traceback", ""))[:4000]  # type: ignore[attr-defined]
    return exc


def _on_alarm(signum: int, frame: Any) -> None:
    raise TestTimeout()


def judge(pid: int, calls: int, answers: int, out: int) -> None:
    """Read the token and the task, run the tests against the solution process, print the
    report (see the module docstring)."""
    token = sys.stdin.readline().strip()
    spec = json.loads(sys.stdin.readline())
    chars = spec["traceback_chars"]
    output = _Output(out, cap=spec["output_cap"])
    solution = Solution(pid, calls, answers, output)
    real_stdout = sys.stdout
    signal.signal(signal.SIGALRM, _on_alarm)

    def run(step: Any, seconds: float) -> tuple[str | None, str]:
        """``step``'s error (None if it ran) and its kind (see the module docstring)."""
        sys.stdout = sys.stderr = _Discard()
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            step()
            return None, "passed"
        except TestTimeout:
            solution._end("was stopped: it ran out of time")
            return f"timed out after {seconds:g}s", "stopped"
        except SolutionGone as exc:
            return str(exc), "stopped"
        except BaseException as exc:  # noqa: BLE001 - the test's failure
            raised = getattr(exc, "solution_traceback", None)
            text = raised or short_traceback(exc, chars)
            text = text if len(text) <= chars else "... " + text[-chars:]
            return text, "raised" if raised else "wrong"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout, sys.stderr = real_stdout, sys.__stderr__

    hello: dict[str, Any] = {}
    solution_error, _ = run(lambda: hello.update(solution.ready()), spec["solution_timeout_s"])
    results = []
    if solution_error is None and hello["error"] is not None:
        solution_error = str(hello["error"])[-chars:]
    if solution_error is None and spec["entry_point"] not in hello["functions"]:
        solution_error = f"your code does not define {spec['entry_point']!r}"
    if solution_error is None:
        namespace: dict[str, Any] = {"__name__": "tests"}

        def code(source: str) -> Any:
            return lambda: exec(compile(source, "tests.py", "exec"), namespace)  # noqa: S102

        # the task's own helpers (the tests call them), then the solution's entry point
        run(code(spec.get("prompt") or ""), spec["test_timeout_s"])
        namespace[spec["entry_point"]] = Remote(solution, spec["entry_point"])
        setup = run(code(spec["setup"]), spec["test_timeout_s"])
        stopped = None
        for test in spec["tests"]:
            if stopped is not None:  # one hung test (or the solution's end) ends the run
                results.append({"test": test, "passed": False, "error": stopped, "kind": "stopped"})
                continue
            error, kind = setup if setup[0] is not None else run(code(test), spec["test_timeout_s"])
            if error is not None and error.startswith("timed out"):
                stopped = "not run: an earlier test timed out"
            elif solution.gone is not None:
                stopped = f"not run: {solution.gone} in an earlier test"
            results.append({"test": test, "passed": error is None, "error": error, "kind": kind})
    report = {"solution_error": solution_error, "results": results, "output": output.text()}
    print(token + " " + json.dumps(report), file=real_stdout, flush=True)


class _Discard:
    """Where the tests' own prints go (the judge's stdout carries only its report)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _undumpable() -> None:
    """``PR_SET_DUMPABLE`` 0: no process of this uid may read this one's memory, file
    descriptors or environment through ``/proc`` (or ``ptrace`` it)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass


def main() -> None:
    _undumpable()
    calls_r, calls_w = os.pipe()
    answers_r, answers_w = os.pipe()
    out_r, out_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the solution process: nothing secret has been read yet
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            for fd in (null, out_w, out_r, calls_w, answers_r):
                os.close(fd)
            solution_process(calls_r, answers_w)
        finally:
            os._exit(1)
    for fd in (calls_r, answers_w, out_w):
        os.close(fd)
    try:
        judge(pid, calls_w, answers_r, out_r)
    finally:  # and reaped: a run whose process is left for the sandbox to sweep ends later
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass


if __name__ == "__main__":
    main()
