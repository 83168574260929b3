"""The exceptions envhub raises.

Every message says what failed, the offending value, and how to fix it; tests pin the
wording of the ones users meet most (unknown id, bad kwargs, step after the end).

    EnvhubError
    ├── RegistryError
    │   ├── UnknownEnvError        unknown id, with a "did you mean ...?" hint
    │   ├── EnvKwargsError         make() got kwargs the env does not accept
    │   └── RegistrationError      a malformed id or a conflicting register() call
    ├── EpisodeError
    │   ├── ResetNeededError       step() before the first reset()
    │   └── EpisodeOverError       step() after terminated/truncated
    ├── ActionParseError           model text could not be parsed (envs turn it into feedback)
    ├── ToolSchemaError            an env's tool schemas are malformed (lists every problem)
    ├── EnvCheckError              check_env() found problems (lists all of them)
    └── SourceError                an adapted ecosystem (envhub.adapters) cannot serve the env
        ├── SourceNotInstalledError   its package is missing (names the extra to install)
        ├── SourceConfigError         a name or config the source does not have (did you mean)
        └── SourceConnectionError     a remote source (an OpenEnv server) is down or speaks
                                      another protocol version
"""

from __future__ import annotations

__all__ = [
    "ActionParseError",
    "EnvCheckError",
    "EnvKwargsError",
    "EnvhubError",
    "EpisodeError",
    "EpisodeOverError",
    "EvalOutputError",
    "RegistrationError",
    "RegistryError",
    "ResetNeededError",
    "SourceConfigError",
    "SourceConnectionError",
    "SourceError",
    "SourceNotInstalledError",
    "ToolSchemaError",
    "UnknownEnvError",
    "describe_error",
]


class EnvhubError(Exception):
    """Base class of every error envhub raises on purpose."""


class RegistryError(EnvhubError, KeyError):
    """A registry lookup or registration failed.

    Subclasses ``KeyError`` too, so code written for dict-like registries keeps working, but
    overrides ``__str__`` so the message is not shown wrapped in quotes.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownEnvError(RegistryError):
    """No environment is registered under the requested id."""


class EnvKwargsError(RegistryError, TypeError):
    """``make()`` was given keyword arguments the environment does not accept."""


class RegistrationError(RegistryError, ValueError):
    """``register()`` was called with a malformed id or one that is already taken."""


class EpisodeError(EnvhubError, RuntimeError):
    """An env method was called in the wrong episode state."""


class ResetNeededError(EpisodeError):
    """``step()`` was called before ``reset()``."""


class EpisodeOverError(EpisodeError):
    """``step()`` was called after the episode terminated or was truncated."""


class ActionParseError(EnvhubError, ValueError):
    """The model's text holds no action in the expected format.

    Environments never let this escape ``step()``: they catch it, give a penalty, and send
    ``feedback`` back to the model as the next observation so it can correct itself.
    """

    def __init__(self, message: str, *, feedback: str | None = None) -> None:
        super().__init__(message)
        self.feedback = feedback or message


class ToolSchemaError(EnvhubError, ValueError):
    """An env's tool schemas are malformed (``envhub.tool_schemas``); the message lists every
    problem with its place (``tools[2] 'search'.parameters.properties.k.type``) and the fix."""


class EnvCheckError(EnvhubError, AssertionError):
    """``check_env`` found one or more problems; ``problems`` lists every one of them."""

    def __init__(self, env_name: str, problems: list[str]) -> None:
        self.env_name = env_name
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{env_name} failed {len(self.problems)} check(s):\n{lines}")


class EvalOutputError(EnvhubError, ValueError):
    """``envhub eval --out`` names a folder that cannot take the run (unwritable, or holding
    another run: ``--resume`` or ``--overwrite``)."""


class SourceError(EnvhubError):
    """An adapted ecosystem (TextArena, GEM, reasoning-gym, OpenEnv) cannot serve the env."""


class SourceNotInstalledError(SourceError, ImportError):
    """The source's package is not installed; the message names the envhub extra to install."""


class SourceConfigError(SourceError, ValueError):
    """A dataset/game name or a config field the source does not have (with "did you mean")."""


class SourceConnectionError(SourceError, ConnectionError):
    """A remote source (an OpenEnv server) is unreachable, or answers in another protocol."""


def describe_error(exc: BaseException, limit: int = 500) -> str:
    """How envhub quotes an exception raised by an env's or an agent's code: ``"ValueError:
    bad"``, the type alone when there is no message, that the code called ``sys.exit`` for a
    ``SystemExit``; at most ``limit`` characters (a message may hold a whole observation)."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: it called sys.exit({exc.code!r})"[:limit]
    text = str(exc)
    return f"{type(exc).__name__}: {text}"[:limit] if text else type(exc).__name__
