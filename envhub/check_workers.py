"""``check_ids``: registered ids checked in worker processes, each within a time limit.

``envhub check`` checks every id in a process of its own (``jobs`` at a time), so nothing one
env does stops the others being checked. What the env does, and what its report says:

- building it raises (a missing package, bad data, any error, picklable or not): a failed
  ``make`` result naming the error (and, for a missing package, the command that installs it);
- it calls ``sys.exit`` or raises in a check: that check fails (``check_env`` says so);
- it runs past ``timeout`` seconds: its process group (the worker and whatever the env started,
  a browser say) is killed, and the check it was in fails, saying so;
- it takes the interpreter down (``os._exit``, a segfault): the check it was in fails.

The first id of each entry point (variants and sibling families share its code) also replays one
episode in a new Python interpreter with another ``PYTHONHASHSEED`` (``check_new_process``); an
id that a new process cannot see (registered at run time, not through a plugin) skips that
check.

Guarantees: each id gets exactly one report; results stream to ``on_result`` as each check
ends; a worker leads a process group of its own, and whatever ends ``check_ids`` (its last
report, an error, ``KeyboardInterrupt``, a ``SystemExit`` raised by a SIGTERM handler, closing
the generator) kills the groups still running, so no worker or its children outlive it.
Not covered: a process an env moves to a group or session of its own (``start_new_session``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, cast

from envhub.checker import (
    CHECKS,
    CheckFailed,
    CheckReport,
    CheckResult,
    CheckSkipped,
    check_env,
    check_gymnasium,
    describe_error,
    transcript,
)
from envhub.extras import install_command, missing_module

__all__ = ["check_ids", "why_build_failed"]

EXIT_GRACE = 5.0
"""Seconds a worker that sent its report gets to exit before its process group is killed."""

MAKE = "make"
"""The result name for building the env, which comes before the first check."""


def check_ids(
    env_ids: list[str],
    *,
    jobs: int,
    kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    gymnasium_checks: bool = True,
    timeout: float | None,
    on_result: Callable[[str, CheckResult], None] | None = None,
) -> Generator[CheckReport, None, None]:
    """Check registered ids, ``jobs`` worker processes at a time; yield each report when done.

    ``timeout`` bounds each id's checks (``None``: no bound); ``on_result(env_id, result)`` is
    called in this process as each check of each id ends (the CLI prints them live).
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds (or None), got {timeout}")
    options = (kwargs or {}, seed, gymnasium_checks)
    replayed_on = _first_of_each_entry_point(env_ids)
    waiting = list(env_ids)
    running: dict[Connection, _Worker] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                with _signals_deferred():  # forked and not yet in ``running``: nobody would kill it
                    env_id = waiting.pop(0)
                    worker = _start(env_id, (*options, replayed_on[env_id]), timeout)
                    running[worker.connection] = worker
            ready = wait(list(running), timeout=_until_next_deadline(running))
            for connection in cast(list[Connection], ready):
                report = running[connection].receive(on_result)
                if report is not None:
                    _stop(running[connection], grace=EXIT_GRACE)
                    del running[connection]  # (after _stop: an interrupted stop is redone below)
                    yield report
            for connection, worker in list(running.items()):
                if worker.deadline is not None and time.monotonic() >= worker.deadline:
                    _stop(worker, grace=0)
                    del running[connection]
                    yield worker.failed(
                        f"did not finish within {timeout:g} s, so the checker stopped it here; "
                        "an env must answer every reset() and step() (raise --timeout if it is "
                        "just slow)"
                    )
    finally:
        with _signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            for worker in running.values():
                _stop(worker, grace=0)


def _first_of_each_entry_point(env_ids: list[str]) -> dict[str, str]:
    """Each id -> the id whose new-process check covers it: the first of its entry point (a new
    interpreter costs a fraction of a second, a browser env's seconds; ids of one entry point
    share its code and differ in kwargs only)."""
    from envhub.registry import spec

    first: dict[Any, str] = {}
    covered: dict[str, str] = {}
    for env_id in env_ids:
        try:
            code: Any = spec(env_id).entry_point
            hash(code)
        except Exception:  # noqa: BLE001 - its worker reports why it cannot be loaded
            code = env_id
        covered[env_id] = first.setdefault(code, env_id)
    return covered


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM arriving in the block are acted on when it ends (by the handlers there
    were before). Only the main thread can set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {
        signum: signal.signal(signum, lambda signum, frame: arrived.append(signum))
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if arrived:
            signal.raise_signal(arrived[0])


@dataclass
class _Worker:
    """One id being checked in a process of its own, and what it has reported so far."""

    env_id: str
    process: BaseProcess
    connection: Connection
    checks: list[str]
    """The names of the checks the worker runs, in order."""
    deadline: float | None
    built: bool = False
    results: list[CheckResult] = field(default_factory=list)

    def receive(self, on_result: Callable[[str, CheckResult], None] | None) -> CheckReport | None:
        """Take one message from the worker; return its report once it is complete."""
        try:
            kind, payload = self.connection.recv()
        except (EOFError, OSError):
            self.process.join(EXIT_GRACE)
            return self.failed(
                "the checker process died while checking this id (the env crashed the "
                f"interpreter, exit code {self.process.exitcode}); see its error output: "
                f"envhub check {self.env_id}"
            )
        if kind == "built":
            self.built = True
        elif kind == "result":
            self.results.append(payload)
            if on_result is not None:
                on_result(self.env_id, payload)
        else:
            return payload
        return None

    def failed(self, message: str) -> CheckReport:
        """The report so far, with the step it was in (building, or the next check) failed."""
        current = (
            MAKE if not self.built else self.checks[min(len(self.results), len(self.checks) - 1)]
        )
        return CheckReport(self.env_id, [*self.results, CheckResult(current, False, message)])


def _until_next_deadline(running: dict[Connection, _Worker]) -> float | None:
    deadlines = [w.deadline for w in running.values() if w.deadline is not None]
    return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None


def _start(
    env_id: str, options: tuple[dict[str, Any], int, bool, str], timeout: float | None
) -> _Worker:
    # fork: the worker inherits this process's registry (ids registered at run time included)
    context: Any = multiprocessing.get_context(
        "fork" if sys.platform.startswith("linux") else "spawn"
    )
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_work, args=(sender, env_id, *options), name=env_id)
    process.start()
    sender.close()  # the worker holds the only sender: its death reads as end-of-file here
    if hasattr(os, "setpgid"):
        try:  # (the worker does the same; whichever runs first wins the race)
            os.setpgid(process.pid, process.pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = None if timeout is None else time.monotonic() + timeout
    checks = [c.__name__ for c in CHECKS if options[2] or c is not check_gymnasium]
    return _Worker(env_id, process, receiver, checks, deadline)


def _stop(worker: _Worker, *, grace: float) -> None:
    """Let the worker exit for up to ``grace`` s, then kill its process group and reap it."""
    worker.process.join(grace)
    if hasattr(os, "killpg"):
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        except (ProcessLookupError, PermissionError):
            pass
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join()
    worker.connection.close()


def _work(
    connection: Connection,
    env_id: str,
    kwargs: dict[str, Any],
    seed: int,
    gymnasium_checks: bool,
    replayed_on: str,
) -> None:
    """The worker process: check ``env_id``, sending ("built" | "result" | "report", payload)."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # a group of its own: the parent kills it and everything the env starts
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (the parent's handlers are not for workers)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from envhub.registry import spec

    try:
        factory = functools.partial(spec(env_id).make, **kwargs)
        env = factory()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - any build error is this id's failed report
        report = CheckReport(env_id, [CheckResult(MAKE, False, why_build_failed(exc))])
        connection.send(("report", report))
        return
    connection.send(("built", None))
    replay = (
        _NewProcessReplay(env_id, kwargs, seed)
        if replayed_on == env_id
        else functools.partial(_replayed_on, replayed_on)
    )
    try:
        report = check_env(
            env,
            factory=factory,
            seed=seed,
            raise_on_failure=False,
            gymnasium_checks=gymnasium_checks,
            on_result=lambda result: connection.send(("result", result)),
            replay=replay,
        )
    finally:
        if isinstance(replay, _NewProcessReplay):
            replay.close()
    report.env_name = env_id
    connection.send(("report", report))


def why_build_failed(exc: BaseException) -> str:
    """Why building the env failed, naming the error, where it was raised, and the fix (``check``,
    ``play`` and ``info`` say it alike)."""
    module = missing_module(exc)
    if module is not None:
        return (
            f"building the env needs the optional package {module!r}, which is not installed; "
            f"install it with: {install_command(module)}"
        )
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return (
        f"building the env raised {describe_error(exc)}{where}; fix its constructor, or the -k "
        "overrides given to it"
    )


_REPLAY_MARK = "envhub-replay:"
"""Starts the one line of the new process's stdout that holds its answer (an env may print)."""


class _NewProcessReplay:
    """``check_new_process``'s ``Replay``: ``transcript`` of an id at a seed, played by a new
    interpreter whose ``PYTHONHASHSEED`` differs from this one's. It starts when the worker
    does and plays beside the other checks (an MCP or browser env's start is mostly waiting);
    it imports what this process can (its ``sys.path``), inherits ``ENVHUB_PLUGINS``, and dies
    with the worker's process group, or at ``close``."""

    def __init__(self, env_id: str, kwargs: dict[str, Any], seed: int) -> None:
        from envhub.registry import spec

        self.process: subprocess.Popen[str] | None = None
        self.why_not = ""
        ours = os.environ.get("PYTHONHASHSEED", "")
        self.hash_seed = str((int(ours) + 1) % 4_294_967_295) if ours.isdigit() else "0"
        found = spec(env_id)
        # a "module:attr" entry point is built directly: no plugin discovery (a third of a second)
        entry_point = found.entry_point if isinstance(found.entry_point, str) else None
        try:
            built_with = found.constructor_kwargs(kwargs) if entry_point else kwargs
            request = json.dumps(
                {"id": env_id, "entry_point": entry_point, "kwargs": built_with, "seed": seed}
            )
        except (TypeError, ValueError):
            self.why_not = "the env's kwargs are not JSON, so a new process cannot get them"
            return
        environ = {
            **os.environ,
            "PYTHONHASHSEED": self.hash_seed,
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        code = "from envhub.check_workers import replay_main; replay_main()"
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, request],
                env=environ,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as error:  # (no process to spare; the other checks still run)
            self.why_not = f"a new process could not be started ({error})"

    def __call__(self, seed: int) -> str:
        if self.process is None:
            raise CheckSkipped(self.why_not)
        out, err = self.process.communicate()
        answers = [line for line in out.splitlines() if line.startswith(_REPLAY_MARK)]
        if not answers:
            tail = err.strip().splitlines()[-1:] or ["(no error output)"]
            raise CheckFailed(
                f"the new process (PYTHONHASHSEED={self.hash_seed}) exited with code "
                f"{self.process.returncode} before playing seed={seed}: {tail[0][:300]}"
            )
        answer = json.loads(answers[-1].removeprefix(_REPLAY_MARK))
        if "unknown" in answer:
            raise CheckSkipped(
                "the id is registered only in this process (not by a plugin), so a new process "
                "cannot build it; register it from an entry point or ENVHUB_PLUGINS to check this"
            )
        if "error" in answer:
            raise CheckFailed(
                f"in a new process (PYTHONHASHSEED={self.hash_seed}), seed={seed} raised "
                f"{answer['error']}; the env must not depend on the process it runs in"
            )
        return str(answer["transcript"])

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def _replayed_on(env_id: str, seed: int) -> str:
    raise CheckSkipped(f"once per entry point: {env_id} shares this id's code and is checked")


def replay_main() -> None:
    """The new process of ``_NewProcessReplay``: read the request (its argument), play, answer
    one marked line on stdout."""
    from envhub.errors import UnknownEnvError
    from envhub.registry import import_target, spec

    request = json.loads(sys.argv[1])
    answer: dict[str, str]
    try:
        entry_point = request["entry_point"]
        build = import_target(entry_point) if entry_point else spec(request["id"]).make
        env = build(**request["kwargs"])
        try:
            answer = {"transcript": transcript(env, int(request["seed"]))}
        finally:
            env.close()
    except UnknownEnvError as error:
        answer = {"unknown": str(error)}
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - its error is the answer
        answer = {"error": describe_error(exc)}
    print(_REPLAY_MARK + json.dumps(answer), flush=True)
