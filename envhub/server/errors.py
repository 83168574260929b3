"""The exceptions ``envhub.server`` and its client raise.

    EnvhubError
    └── HubError
        ├── HubConfigError     a server setting is invalid (names the flag and the fix)
        ├── SessionLimitError  a global or per-client session limit is reached
        └── RemoteError        the hub answered a client request with an error code
            └── SessionLostError  the session is gone (not resumable, reaped, hub shut down)

``RemoteEnv`` raises the foundation's ``ResetNeededError``/``EpisodeOverError`` for
``reset_needed``/``episode_over``, so remote and local envs fail the same way.
"""

from __future__ import annotations

from envhub.errors import EnvhubError

__all__ = ["HubConfigError", "HubError", "RemoteError", "SessionLimitError", "SessionLostError"]


class HubError(EnvhubError):
    """Base class of the hub's own errors."""


class HubConfigError(HubError, ValueError):
    """An invalid server setting."""


class SessionLimitError(HubError):
    """Too many sessions, globally or for one client; ``scope`` says which."""

    def __init__(self, message: str, scope: str) -> None:
        super().__init__(message)
        self.scope = scope


class RemoteError(HubError, RuntimeError):
    """The hub refused a request; ``code`` is the wire error code (see ``envhub.server.wire``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class SessionLostError(RemoteError):
    """The session is gone: it could not be resumed after a dropped connection (in time, or
    the hub no longer has it), or the hub closed it (``idle_timeout``, ``draining``); ``code``
    says which. ``RemoteEnv.reset()`` opens a new session where the hub no longer has this
    one."""
