"""Isolated execution of model-written code: one ``Sandbox`` contract, three backends.

```python
from sandboxes import Limits, make_sandbox

with make_sandbox("local", limits=Limits(wall_time_s=5, memory_mb=256)) as sb:
    r = sb.run_code("print(2 + 2)")          # ExecResult(exit_code=0, stdout='4\\n', ...)
    sb.write_file("solution.py", code); r = sb.run(["python3", "solution.py"], timeout=5)
```

Backends (each module's docstring lists what it protects against and what it does not):

- ``local`` (:mod:`sandboxes.local`): Linux namespaces via bubblewrap (or ``unshare``),
  rlimits and cgroups, on this machine. The embedded default: a new sandbox process per run,
  or with ``warm_exec=True`` (pools, the code envs) a fork of a server inside the sandbox,
  which runs ``python3 -I`` code without starting an interpreter (figures in
  ``benchmarks/README.md``).
- ``docker`` (:mod:`sandboxes.docker`): one container per sandbox through a Docker engine.
- ``e2b`` (:mod:`sandboxes.e2b`): E2B cloud micro-VMs (needs ``E2B_API_KEY``).

:class:`SandboxPool` keeps sandboxes started so that a hot path pays no start-up.
Backend modules load lazily: ``import sandboxes`` imports neither docker nor e2b.
"""

from __future__ import annotations

from typing import Any

from sandboxes.base import ExecResult, Limits, Protection, Sandbox, Session
from sandboxes.errors import (
    PoolClosedError,
    SandboxConfigError,
    SandboxError,
    SandboxFileError,
    SandboxStateError,
    SandboxUnavailableError,
    ScratchFullError,
    SessionError,
)
from sandboxes.pool import SandboxPool

__all__ = [
    "BACKENDS",
    "ExecResult",
    "Limits",
    "PoolClosedError",
    "Protection",
    "Sandbox",
    "SandboxConfigError",
    "SandboxError",
    "SandboxFileError",
    "SandboxPool",
    "SandboxStateError",
    "SandboxUnavailableError",
    "ScratchFullError",
    "Session",
    "SessionError",
    "backend_class",
    "make_sandbox",
]

BACKENDS: dict[str, str] = {
    "local": "sandboxes.local:LocalSandbox",
    "docker": "sandboxes.docker:DockerSandbox",
    "e2b": "sandboxes.e2b:E2BSandbox",
}
"""Backend name -> "module:class"; imported only when asked for."""


def backend_class(backend: str) -> type[Sandbox]:
    """The class behind ``backend`` (imported now); unknown names fail with "did you mean"."""
    import importlib

    if backend not in BACKENDS:
        import difflib

        close = difflib.get_close_matches(str(backend), BACKENDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise SandboxConfigError(
            f"unknown sandbox backend {backend!r}; choose one of {sorted(BACKENDS)}.{hint}"
        )
    module_name, _, cls_name = BACKENDS[backend].partition(":")
    cls: type[Sandbox] = getattr(importlib.import_module(module_name), cls_name)
    return cls


def make_sandbox(backend: str = "local", *, limits: Limits | None = None, **kwargs: Any) -> Sandbox:
    """A new, not yet started sandbox of ``backend``; ``kwargs`` go to the backend's class.

    ``local``: ``isolation=``, ``ro_binds=``; ``docker``: ``image=``, ``client=``,
    ``volumes=``; ``e2b``: ``template=``, ``api_key=``. Start it with ``with sb:`` or
    ``sb.start()``.
    """
    cls = backend_class(backend)
    try:
        return cls(limits=limits, **kwargs)
    except TypeError as e:
        raise SandboxConfigError(f"bad arguments for the {backend!r} backend: {e}") from None
