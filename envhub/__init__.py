"""envhub: a Gym-style hub of multi-turn text environments for language-model agents.

Quick start::

    import envhub
    env = envhub.make("games/sokoban-v0")
    messages, info = env.reset(seed=0)
    messages, reward, terminated, truncated, info = env.step("<answer>up</answer>")

Names are imported lazily, so ``import envhub`` is cheap and has no side effects; the
registry discovers environments (built-in and ``envhub.envs`` plugins) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "ActionParser",
    "ChatSpace",
    "CheckReport",
    "EnvSpec",
    "Message",
    "Observation",
    "TextEnv",
    "TextSpace",
    "Turn",
    "__version__",
    "check_env",
    "errors",
    "evaluate",
    "function_tool",
    "list_envs",
    "load_plugins",
    "make",
    "messages_to_text",
    "plugin_errors",
    "register",
    "spec",
]

_LAZY: dict[str, str] = {
    "TextEnv": "envhub.core",
    "Turn": "envhub.core",
    "ChatSpace": "envhub.core",
    "TextSpace": "envhub.core",
    "Message": "envhub.core",
    "Observation": "envhub.core",
    "function_tool": "envhub.core",
    "messages_to_text": "envhub.core",
    "ActionParser": "envhub.parsing",
    "register": "envhub.registry",
    "make": "envhub.registry",
    "spec": "envhub.registry",
    "list_envs": "envhub.registry",
    "load_plugins": "envhub.registry",
    "plugin_errors": "envhub.registry",
    "EnvSpec": "envhub.registry",
    "check_env": "envhub.checker",
    "CheckReport": "envhub.checker",
    "evaluate": "envhub.evaluation",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from envhub import errors
    from envhub.checker import CheckReport, check_env
    from envhub.core import (
        ChatSpace,
        Message,
        Observation,
        TextEnv,
        TextSpace,
        Turn,
        function_tool,
        messages_to_text,
    )
    from envhub.evaluation import evaluate
    from envhub.parsing import ActionParser
    from envhub.registry import (
        EnvSpec,
        list_envs,
        load_plugins,
        make,
        plugin_errors,
        register,
        spec,
    )


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("envhub.errors")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'envhub' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
