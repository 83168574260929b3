"""E2B sessions: code-interpreter contexts (Jupyter kernels) behind the ``Session`` contract.

A cell is cut off when it runs past its timeout or prints more than ``max_output_bytes`` to a
stream; then the kernel is restarted (the only way to stop a running cell: a kernel runs one
cell at a time, so the next one would otherwise queue behind it), and ``restarts`` counts the
state lost. Output is counted as it streams, so at most the cap plus one message is held.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from sandboxes.base import ExecResult, Session
from sandboxes.errors import SessionError

if TYPE_CHECKING:
    from sandboxes.e2b import E2BSandbox

__all__ = ["ContextSession"]


class _Cut(Exception):
    """Raised from an output callback to stop reading a cell: over its deadline or its cap."""

    def __init__(self, timed_out: bool) -> None:
        super().__init__("timed out" if timed_out else "output over the cap")
        self.timed_out = timed_out


class _Stream:
    """One output stream of a cell, kept up to ``cap`` characters; raises ``_Cut`` past the cap
    or the deadline, which ends the SDK's read of the cell."""

    def __init__(self, cap: int, deadline: float) -> None:
        self.cap, self.deadline = cap, deadline
        self.parts: list[str] = []
        self.size = 0

    def add(self, message: Any) -> None:
        text = str(message.line)
        room = self.cap - self.size
        self.parts.append(text[: max(0, room)])
        self.size += len(text)
        if len(text) > room:
            raise _Cut(timed_out=False)
        if time.monotonic() > self.deadline:
            raise _Cut(timed_out=True)

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ContextSession(Session):
    """A code-interpreter context: a Jupyter kernel whose state persists between ``run`` calls."""

    def __init__(self, sandbox: E2BSandbox, language: str) -> None:
        self.language, self._sandbox = language, sandbox
        try:
            self._context = sandbox._use(0).create_code_context(
                cwd=sandbox.workdir, language=language
            )
        except Exception as e:
            raise SessionError(f"E2B could not create a {language} context: {e}") from e
        self._closed = False
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return not self._closed

    def run(self, code: str, *, timeout: float | None = None) -> ExecResult:
        from e2b import TimeoutException

        if self._closed:
            raise SessionError(
                f"this {self.language} session is closed; open a new one with sandbox.session()"
            )
        wall = timeout if timeout is not None else self._sandbox.limits.wall_time_s
        cap = self._sandbox.limits.max_output_bytes
        remote = self._sandbox._use(wall)
        t0 = time.monotonic()
        out, err = _Stream(cap, t0 + wall), _Stream(cap, t0 + wall)
        try:
            execution = remote.run_code(
                code, context=self._context, timeout=wall, on_stdout=out.add, on_stderr=err.add
            )
        except _Cut as cut:
            return self._cut_off(out, err, t0, timed_out=cut.timed_out)
        except TimeoutException as e:
            if time.monotonic() - t0 >= wall:  # the SDK's read deadline: the cell hung
                return self._cut_off(out, err, t0, timed_out=True)
            raise self._failed(e) from e  # a 502 (VM gone) reads as a "timeout" in the SDK
        except Exception as e:
            raise self._failed(e) from e
        stdout = out.text + "".join(f"{r.text}\n" for r in execution.results if r.text)
        stderr = err.text
        if execution.error is not None:
            stderr += (
                f"{execution.error.name}: {execution.error.value}\n{execution.error.traceback}"
            )
        return ExecResult(
            exit_code=1 if execution.error is not None else 0,
            stdout=stdout[:cap],
            stderr=stderr[:cap],
            wall_time_s=time.monotonic() - t0,
            output_truncated=max(len(stdout), len(stderr)) > cap,
        )

    def _failed(self, e: Exception) -> SessionError:
        return SessionError(
            f"the E2B {self.language} session failed: {type(e).__name__}: {e}; "
            "open a new session (or sandbox) to go on"
        )

    def _cut_off(self, out: _Stream, err: _Stream, t0: float, *, timed_out: bool) -> ExecResult:
        """Restart the kernel (stops the cell, loses state) and report what the cell printed."""
        try:
            self._sandbox._use(0).restart_code_context(self._context)
        except Exception as e:
            self.close()
            raise SessionError(
                f"the E2B {self.language} kernel could not be restarted after a cell was cut "
                f"off: {type(e).__name__}: {e}; the session is closed, open a new one"
            ) from e
        self.restarts += 1
        return ExecResult(
            exit_code=137,
            stdout=out.text,
            stderr=err.text,
            wall_time_s=time.monotonic() - t0,
            timed_out=timed_out,
            output_truncated=not timed_out,
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self._sandbox.remote.remove_code_context(self._context)
