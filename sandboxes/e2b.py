"""``e2b``: the same contract over E2B cloud sandboxes (Firecracker micro-VMs), via the official
``e2b-code-interpreter`` SDK (``pip install 'envhub[e2b]'``, key in ``E2B_API_KEY``).

Untested live here: this machine cannot reach the E2B cloud. The adapter's request/response
handling is tested against a local fake of the E2B API, envd (Connect RPC) and the code
interpreter (``tests/sandboxes/test_e2b.py``); ``test_e2b_live`` (marker ``e2b``) runs the
adversarial basics for real when ``E2B_API_KEY`` is set.

What protects you, and who enforces it:

- **Isolation from your host** (host files, host processes, host env vars, writes outside the
  VM): total, by construction — the code runs in a VM in E2B's cloud. ``env=`` is sent, the
  local environment never is.
- **Wall time and output size**: enforced by this adapter (stream deadline, then the command
  is killed with SIGKILL through envd; output past ``max_output_bytes`` kills it too).
- **Network**: ``Limits.network=False`` creates the sandbox with
  ``allow_internet_access=False`` (E2B denies egress to 0.0.0.0/0).
- **Memory, CPU, processes, disk**: bounded by the VM size of the *template* you choose, not
  by ``Limits`` (the adapter does not apply ``memory_mb``, ``max_processes``, ``disk_mb``);
  ``cpu_time_s`` and ``max_file_size_mb`` are applied with ``ulimit`` in front of each command.
  A fork or memory bomb exhausts the VM, not your machine; ``oom_killed`` is reported only
  as exit 137 without a timeout (E2B does not say why a process died).
- **Orphans**: killing a timed-out command signals its process only; leftovers live until
  ``stop()`` kills the VM.

``workdir`` is ``/home/user``. Sessions use code-interpreter contexts (Jupyter kernels):
``python`` keeps state; ``bash`` runs in a bash kernel when the template has one.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import time
from typing import Any

from sandboxes.base import ExecResult, Limits, Sandbox, Session
from sandboxes.errors import (
    SandboxConfigError,
    SandboxError,
    SandboxFileError,
    SandboxUnavailableError,
    SessionError,
)

__all__ = ["E2BSandbox"]


def _sdk() -> Any:
    try:
        import e2b_code_interpreter
    except ImportError:
        raise SandboxUnavailableError(
            "the e2b backend needs the E2B SDK: "
            "pip install 'envhub[e2b]' (or pip install e2b-code-interpreter)"
        ) from None
    return e2b_code_interpreter


class E2BSandbox(Sandbox):
    """One E2B cloud sandbox. See the module docstring for what is enforced where.

    ``template``: the E2B template (default: the code-interpreter template). ``api_key``:
    defaults to ``E2B_API_KEY``. ``lifetime_s``: E2B's own kill timer for the VM.
    ``connection``: extra ``ConnectionConfig`` options passed to the SDK (``domain``,
    ``api_url``, ``sandbox_url``, ``request_timeout``) — tests point these at a local fake.
    """

    backend = "e2b"
    workdir = "/home/user"

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        template: str | None = None,
        api_key: str | None = None,
        lifetime_s: int = 600,
        user: str = "user",
        **connection: Any,
    ) -> None:
        super().__init__(limits=limits)
        allowed = {"domain", "api_url", "sandbox_url", "request_timeout", "debug", "headers"}
        if unknown := set(connection) - allowed:
            raise SandboxConfigError(
                f"unknown e2b option(s) {sorted(unknown)}; accepted: {sorted(allowed)}"
            )
        if not isinstance(lifetime_s, int) or lifetime_s <= 0:
            raise SandboxConfigError(
                f"lifetime_s must be a positive int (seconds), got {lifetime_s!r}"
            )
        self.template, self.lifetime_s, self.user = template, lifetime_s, user
        self._api_key = api_key
        self._connection = connection
        self.remote: Any = None
        self._stdin_count = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        sdk = _sdk()
        key = self._api_key or os.environ.get("E2B_API_KEY")
        if not key:
            raise SandboxUnavailableError(
                "the e2b backend needs an API key: set E2B_API_KEY or pass api_key="
            )
        kwargs: dict[str, Any] = dict(
            timeout=self.lifetime_s,
            api_key=key,
            metadata={"envhub.sandbox": self.id},
            allow_internet_access=self.limits.network,
            **self._connection,
        )
        if self.template:
            kwargs["template"] = self.template
        try:
            self.remote = sdk.Sandbox.create(**kwargs)
        except Exception as e:  # auth, quota, network: all "cannot start"
            raise SandboxUnavailableError(
                f"could not create an E2B sandbox: {type(e).__name__}: {e}"
            ) from e

    def _stop(self) -> None:
        if self.remote is not None:
            with contextlib.suppress(Exception):
                self.remote.kill()
            self.remote = None

    def _reset(self) -> None:
        r = self._exec(
            ["sh", "-c", f"find {self.workdir} /tmp -mindepth 1 -delete 2>/dev/null; true"],
            timeout=60,
            stdin=None,
            env=self._env({}),
        )
        if not r.ok:
            raise SandboxError(f"could not empty {self.workdir} in {self!r}: {r.describe()}")

    # ---- exec ------------------------------------------------------------------------------
    def _shell_command(self, argv: list[str], stdin_path: str | None) -> str:
        lim = self.limits
        cpu = max(1, math.ceil(lim.cpu_time_s))
        ulimits = f"ulimit -t {cpu} -f {lim.max_file_size_mb * 2048} 2>/dev/null; "
        redirect = f" < {shlex.quote(stdin_path)}" if stdin_path else " < /dev/null"
        return ulimits + "exec " + shlex.join(argv) + redirect

    def _exec(
        self, argv: list[str], *, timeout: float, stdin: bytes | None, env: dict[str, str]
    ) -> ExecResult:
        from e2b import CommandExitException, TimeoutException

        stdin_path = None
        if stdin is not None:
            self._stdin_count += 1
            stdin_path = f"{self.workdir}/.envhub/stdin-{self._stdin_count}"
            self.remote.files.write(stdin_path, stdin, user=self.user)
        cap = self.limits.max_output_bytes
        out: list[str] = []
        err: list[str] = []
        sizes = [0, 0]
        timed_out = truncated = False
        t0 = time.monotonic()
        try:
            handle = self.remote.commands.run(
                self._shell_command(argv, stdin_path),
                background=True,
                envs=env,
                cwd=self.workdir,
                user=self.user,
                timeout=timeout,
            )
        except Exception as e:
            raise SandboxError(f"E2B could not start {argv[0]!r}: {type(e).__name__}: {e}") from e
        try:
            for stdout, stderr, _ in handle:
                for i, (chunk, sink) in enumerate(((stdout, out), (stderr, err))):
                    if chunk:
                        room = cap - sizes[i]
                        sink.append(chunk[: max(0, room)])
                        sizes[i] += len(chunk)
                        truncated = truncated or len(chunk) > room
                if truncated:
                    break
        except TimeoutException:
            timed_out = True
        except Exception as e:  # a dropped stream is the machinery failing
            if time.monotonic() - t0 < timeout:
                raise SandboxError(f"E2B command stream failed: {type(e).__name__}: {e}") from e
            timed_out = True
        if timed_out or truncated:
            with contextlib.suppress(Exception):
                handle.kill()
            code = 137
        else:
            try:
                code = handle.wait().exit_code
            except CommandExitException as e:
                code = e.exit_code
        code = 128 - code if code < 0 else code
        return ExecResult(
            exit_code=code,
            stdout="".join(out),
            stderr="".join(err),
            wall_time_s=time.monotonic() - t0,
            timed_out=timed_out,
            output_truncated=truncated,
            oom_killed=code == 137 and not (timed_out or truncated),
            cpu_time_exceeded=code == 152 and not timed_out,
        )

    # ---- files -----------------------------------------------------------------------------
    def _write_bytes(self, parts: tuple[str, ...], data: bytes) -> None:
        path = "/".join((self.workdir, *parts))
        try:
            self.remote.files.write(path, data, user=self.user)
        except Exception as e:
            raise SandboxFileError(f"could not write {path!r} in {self!r}: {e}") from e

    def _read_bytes(self, parts: tuple[str, ...]) -> bytes:
        path = "/".join((self.workdir, *parts))
        try:
            return bytes(self.remote.files.read(path, format="bytes", user=self.user))
        except Exception as e:  # NotFoundException and friends
            raise SandboxFileError(f"could not read {path!r} in {self!r}: {e}") from e

    # ---- sessions --------------------------------------------------------------------------
    def _open_session(self, language: str) -> Session:
        return _ContextSession(self, language)


class _ContextSession(Session):
    """A code-interpreter context: a Jupyter kernel whose state persists between ``run`` calls."""

    def __init__(self, sandbox: E2BSandbox, language: str) -> None:
        self.language, self._sandbox = language, sandbox
        try:
            self._context = sandbox.remote.create_code_context(
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
        t0 = time.monotonic()
        try:
            execution = self._sandbox.remote.run_code(code, context=self._context, timeout=wall)
        except TimeoutException:
            return ExecResult(exit_code=137, wall_time_s=time.monotonic() - t0, timed_out=True)
        stdout = "".join(execution.logs.stdout) + "".join(
            f"{r.text}\n" for r in execution.results if r.text
        )
        stderr = "".join(execution.logs.stderr)
        if execution.error is not None:
            stderr += (
                f"{execution.error.name}: {execution.error.value}\n{execution.error.traceback}"
            )
        cap = self._sandbox.limits.max_output_bytes
        return ExecResult(
            exit_code=1 if execution.error is not None else 0,
            stdout=stdout[:cap],
            stderr=stderr[:cap],
            wall_time_s=time.monotonic() - t0,
            output_truncated=max(len(stdout), len(stderr)) > cap,
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self._sandbox.remote.remove_code_context(self._context)
