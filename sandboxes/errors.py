"""Errors raised by ``sandboxes``: each says what failed, the bad value, and the fix.

Everything derives from :class:`SandboxError`, so a caller that only wants "the sandbox could
not do it" catches one class. What the *sandboxed program* did (crashed, timed out, ran out of
memory) is never an exception: it is data in :class:`sandboxes.ExecResult`.
"""

from __future__ import annotations

__all__ = [
    "PoolClosedError",
    "SandboxConfigError",
    "SandboxError",
    "SandboxFileError",
    "SandboxStateError",
    "SandboxUnavailableError",
    "ScratchFullError",
    "SessionError",
]


class SandboxError(RuntimeError):
    """Base class: the sandbox machinery (not the sandboxed program) failed."""


class SandboxConfigError(SandboxError, ValueError):
    """A bad argument: an unknown backend, a negative limit, a malformed env var."""


class SandboxUnavailableError(SandboxError):
    """The backend cannot run on this host (tool missing, no permission, no engine, no key)."""


class SandboxStateError(SandboxError):
    """The sandbox is in the wrong state for the call (not started, already stopped)."""


class SandboxFileError(SandboxError):
    """A file path is outside the scratch directory, missing, or not a regular file; or a
    write failed (e2b, docker: for any reason, a network error or a dead VM included)."""


class ScratchFullError(SandboxFileError):
    """A write failed because scratch is full (``ENOSPC``; ``Limits.disk_mb`` reached).

    Its own class because, unlike the other write failures, it can be the sandboxed program's
    doing: code that filled scratch. A caller that scores programs (``code/humaneval-v0``)
    blames the program for this one only, and treats every other ``SandboxFileError`` as the
    machinery's failure. Raised by the ``local`` and ``docker`` backends; ``e2b`` cannot tell
    a full disk from its other write errors and raises plain ``SandboxFileError``.
    """


class SessionError(SandboxError):
    """A persistent session died or could not be started."""


class PoolClosedError(SandboxError):
    """``SandboxPool.acquire`` was called after ``close()``."""
