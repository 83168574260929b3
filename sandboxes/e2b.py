"""``e2b``: the same contract over E2B cloud sandboxes (Firecracker micro-VMs), via the official
``e2b-code-interpreter`` SDK (``pip install 'envhub[e2b]'``, key in ``E2B_API_KEY``).

Untested live here: this machine cannot reach the E2B cloud. The adapter's request/response
handling is tested against a local fake of the E2B API, envd (Connect RPC) and the code
interpreter (``tests/sandboxes/test_e2b.py``); ``test_e2b_live`` (marker ``e2b``) runs the
adversarial basics for real when ``E2B_API_KEY`` is set.

What protects you, and who enforces it:

- **Isolation from your host** (host files, host processes, host env vars, writes outside the
  VM): total, by construction — the code runs in a VM in E2B's cloud. ``env=`` is sent, the
  local environment never is
  (``test_run_sends_a_quoted_command_with_limits_cwd_and_only_the_given_env``).
- **Wall time and output size**: enforced by this adapter (stream deadline, then the command
  is killed with SIGKILL through envd; output past ``max_output_bytes`` kills it too:
  ``test_timeout_kills_the_remote_process``, ``test_output_flood_is_cut_and_killed``).
- **Network**: ``Limits.network=False`` creates the sandbox with
  ``allow_internet_access=False`` (E2B denies egress to 0.0.0.0/0;
  ``test_create_request_carries_key_template_and_network_off``).
- **Memory, CPU, processes, disk**: bounded by the VM size of the *template* you choose, not
  by ``Limits`` (the adapter does not apply ``memory_mb``, ``max_processes``, ``disk_mb``);
  ``cpu_time_s`` and ``max_file_size_mb`` are applied with ``ulimit`` in front of each command.
  A fork or memory bomb exhausts the VM, not your machine; ``oom_killed`` is reported only
  as exit 137 without a timeout (E2B does not say why a process died).
- **Orphans**: killing a timed-out command signals its process only; what a run leaves
  behind (background processes) lives on while the same caller keeps the sandbox, until
  ``reset()`` or ``stop()`` kills the VM.
- **stdin**: written to a file of an unguessable name in scratch, which the command opens as
  its stdin and deletes before the program starts: it is in no command line and not left in
  scratch (``test_checker_secrets.py::test_e2b_stdin_leaves_no_file_and_no_command_line_behind``).
  A process left running in the VM (an orphan, a session's) that watches scratch can still read
  it in that moment, and the template's user may have sudo: inside one VM nothing is private
  from another process of that VM.
- **Reuse by the next user** (``reset()``, which :class:`~sandboxes.SandboxPool` calls
  between users): the VM is killed and a new one created from the template, so no process,
  file (``/home/user``, ``/tmp``, ``/var/tmp``, ``/dev/shm``, unreadable dirs included) or
  root-level change of one user reaches the next. Scrubbing the VM in place could not promise
  that: the template's user may have sudo, so a run can leave state that no cleanup run as
  that user undoes. A reset costs one VM creation; when it fails, ``reset()`` raises
  :class:`~sandboxes.SandboxUnavailableError` and a pool replaces the sandbox
  (``test_reset_kills_background_processes``, ``test_reset_leaves_no_files_anywhere``).
- **Lifetime**: E2B kills a VM ``lifetime_s`` after it was created or last extended. Each
  run, file operation or session call extends it when less than half is left (or less than
  the run's timeout plus a margin), so a sandbox in use never expires under a run. A VM that
  expired while idle is replaced quietly if nothing was done in it since its creation or
  reset (an idle pooled sandbox); otherwise the call raises :class:`~sandboxes.SandboxError`
  naming ``lifetime_s``, since the VM's files are gone (``test_runs_keep_a_busy_sandbox_alive``,
  ``test_idle_pooled_sandbox_past_its_lifetime_is_replaced_not_handed_out_dead``,
  ``test_used_sandbox_past_its_lifetime_fails_clearly``).
- **Leaked VMs**: each VM carries the sandbox's id in its metadata; when ``Sandbox.create``
  fails on this side after E2B made the VM (a timeout, an unreadable reply), the adapter lists
  the VMs with that id and kills them (``test_create_failing_after_the_vm_exists_kills_it``).

``workdir`` is ``/home/user``. Sessions use code-interpreter contexts (Jupyter kernels):
``python`` keeps state; ``bash`` runs in a bash kernel when the template has one. A cell that
runs past its timeout, or prints more than ``max_output_bytes`` to a stream (counted as it
streams: the SDK holds at most the cap plus one message), is cut off and the kernel restarted,
which stops the cell and loses the session's state (``Session.restarts`` counts it); any other
failure of the SDK raises :class:`~sandboxes.SessionError`
(``test_session_timeout_restarts_the_kernel``, ``test_session_output_flood_is_cut_and_stopped``,
``test_session_sdk_failures_are_session_errors``).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shlex
import time
from typing import Any

from sandboxes.base import ExecResult, Limits, Protection, Sandbox, Session
from sandboxes.errors import (
    SandboxConfigError,
    SandboxError,
    SandboxFileError,
    SandboxUnavailableError,
)

__all__ = ["E2BSandbox"]

_API_OPTIONS = ("domain", "api_url", "request_timeout", "debug", "headers")
"""The ``connection`` options that also apply to control-plane calls (list, kill)."""

_now = time.monotonic
"""The clock of the lifetime bookkeeping (when E2B's timer of a VM runs out). Read through this
name, so tests move it forward together with the fake E2B's clock instead of sleeping."""


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
    defaults to ``E2B_API_KEY``. ``lifetime_s``: how long E2B keeps the VM alive without a
    call (each call extends it; see "Lifetime" above). ``connection``: extra
    ``ConnectionConfig`` options passed to the SDK (``domain``, ``api_url``, ``sandbox_url``,
    ``request_timeout``) — tests point these at a local fake.
    """

    backend = "e2b"
    workdir = "/home/user"
    PROTECTS = tuple(
        Protection(name, how, tuple(f"tests/sandboxes/test_e2b.py::{t}" for t in tests))
        for name, how, tests in (
            (
                "host files, processes, env vars",
                "the code runs in an E2B VM; only env= is sent",
                ("test_run_sends_a_quoted_command_with_limits_cwd_and_only_the_given_env",),
            ),
            (
                "infinite loops",
                "stream deadline, then SIGKILL through envd",
                ("test_timeout_kills_the_remote_process",),
            ),
            (
                "output floods",
                "cut at max_output_bytes as it streams, then killed (sessions: kernel restart)",
                (
                    "test_output_flood_is_cut_and_killed",
                    "test_session_output_flood_is_cut_and_stopped",
                ),
            ),
            (
                "network egress",
                "allow_internet_access=False when Limits.network is False",
                ("test_create_request_carries_key_template_and_network_off",),
            ),
            (
                "what one user leaves for the next",
                "reset() kills the VM and creates a new one (holds even with sudo in the VM)",
                ("test_reset_kills_background_processes", "test_reset_leaves_no_files_anywhere"),
            ),
            (
                "VM expiry",
                "each call extends E2B's timer; an idle VM that expired is replaced if unused",
                (
                    "test_runs_keep_a_busy_sandbox_alive",
                    "test_idle_pooled_sandbox_past_its_lifetime_is_replaced_not_handed_out_dead",
                    "test_used_sandbox_past_its_lifetime_fails_clearly",
                ),
            ),
            (
                "hung session cells",
                "the kernel is restarted (state lost, Session.restarts counts it)",
                ("test_session_timeout_restarts_the_kernel",),
            ),
            (
                "leaked VMs",
                "a failed create kills the VMs tagged with the sandbox's id",
                ("test_create_failing_after_the_vm_exists_kills_it",),
            ),
        )
    )
    NOT_PROTECTED = (
        "memory, processes and disk: bounded only by the template's VM size, not by Limits",
        "orphans between the runs of one user: they live until reset() or stop()",
        (
            "stdin travels as a file in scratch (a random name, deleted before the program "
            "starts): a process left running in the VM can read it in that moment"
        ),
        "the live E2B path is untested here (no route to E2B); tests use a local fake",
    )

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
        if isinstance(lifetime_s, bool) or not isinstance(lifetime_s, int) or lifetime_s <= 0:
            raise SandboxConfigError(
                f"lifetime_s must be a positive int (seconds), got {lifetime_s!r}"
            )
        self.template, self.lifetime_s, self.user = template, lifetime_s, user
        self._api_key = api_key
        self._connection = connection
        self.remote: Any = None
        self._deadline = 0.0
        """``_now()`` by which E2B will have killed the VM unless extended."""
        self._pristine = True
        """Nothing was done in the VM since it was created: replacing it loses nothing."""

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        self._create()

    def _create(self) -> None:
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
        asked = _now()
        try:
            self.remote = sdk.Sandbox.create(**kwargs)
        except Exception as e:  # auth, quota, network: all "cannot start"
            leak = self._kill_tagged_vms(sdk, key)
            raise SandboxUnavailableError(
                f"could not create an E2B sandbox: {type(e).__name__}: {e}{leak}"
            ) from e
        self._deadline, self._pristine = asked + self.lifetime_s, True

    def _kill_tagged_vms(self, sdk: Any, key: str) -> str:
        """Kill every VM tagged with this sandbox's id: a create can fail on this side after
        E2B made the VM, which would then run (and bill) unseen until ``lifetime_s``.
        Returns "" or, when that cleanup failed, a note for the error message."""
        from e2b import SandboxQuery

        api = {k: v for k, v in self._connection.items() if k in _API_OPTIONS}
        try:
            query = SandboxQuery(metadata={"envhub.sandbox": self.id})
            for info in sdk.Sandbox.list(query=query, api_key=key, **api).next_items():
                sdk.Sandbox.kill(info.sandbox_id, api_key=key, **api)
        except Exception as e:  # noqa: BLE001 - reported in the caller's error
            return (
                f" (a VM it may have made could not be found and killed: {type(e).__name__}: "
                f"{e}; E2B kills it after lifetime_s={self.lifetime_s} s)"
            )
        return ""

    def _stop(self) -> None:
        if self.remote is not None:
            with contextlib.suppress(Exception):
                self.remote.kill()
            self.remote = None

    def _reset(self) -> None:
        """A new VM: nothing of the last user (processes, files anywhere, root-level changes
        made with sudo) can survive, which no cleanup inside the old VM could promise."""
        if self._pristine and self.remote is not None and self._deadline > _now() + 1:
            return  # nothing ran in this VM since it was created
        self._stop()  # a VM whose kill failed is unreachable from the new one; E2B's timer ends it
        self._create()

    def _use(self, need_s: float) -> Any:
        """The remote VM, alive for at least ``need_s`` more seconds (see "Lifetime")."""
        with self._lock:  # sessions call this outside ``run``'s lock
            return self._use_locked(need_s)

    def _use_locked(self, need_s: float) -> Any:
        if self.remote is None:
            raise SandboxError(
                f"{self!r} has no E2B VM (a reset could not create one); make a new sandbox"
            )
        if self._deadline - _now() < 1.0:  # E2B's timer has fired, or is about to
            if not self._pristine:
                raise SandboxError(
                    f"E2B killed the VM of {self!r}, with its files, after lifetime_s="
                    f"{self.lifetime_s} s without a call; pass a larger lifetime_s= or reset()"
                )
            self._stop()
            self._create()
        margin = min(10.0, self.lifetime_s / 2)
        left = self._deadline - _now()
        if left < max(self.lifetime_s / 2, need_s + margin):
            extend = max(self.lifetime_s, math.ceil(need_s + margin))
            asked = _now()
            try:
                self.remote.set_timeout(extend)
            except Exception as e:
                raise SandboxError(
                    f"could not extend the life of the E2B VM of {self!r} by {extend} s: "
                    f"{type(e).__name__}: {e}"
                ) from e
            self._deadline = asked + extend
        self._pristine = False
        return self.remote

    # ---- exec ------------------------------------------------------------------------------
    def _shell_command(self, argv: list[str], stdin_path: str | None) -> str:
        """The shell line that runs ``argv`` with the limits; ``stdin_path`` is opened as its
        stdin and deleted before ``argv`` starts (a check's script, say, is not left in scratch
        for the sandbox's other processes to read)."""
        lim = self.limits
        cpu = max(1, math.ceil(lim.cpu_time_s))
        ulimits = f"ulimit -t {cpu} -f {lim.max_file_size_mb * 2048} 2>/dev/null; "
        if stdin_path is None:
            return ulimits + "exec " + shlex.join(argv) + " < /dev/null"
        path = shlex.quote(stdin_path)
        return ulimits + f"exec 0< {path} && rm -f -- {path} && exec " + shlex.join(argv)

    def _exec(
        self, argv: list[str], *, timeout: float, stdin: bytes | None, env: dict[str, str]
    ) -> ExecResult:
        from e2b import CommandExitException

        remote = self._use(timeout)
        stdin_path = None
        if stdin is not None:  # an unguessable name: nothing can be planted there beforehand
            stdin_path = f"{self.workdir}/.envhub/stdin-{secrets.token_hex(16)}"
            try:
                remote.files.write(stdin_path, stdin, user=self.user)
            except Exception as e:
                raise SandboxError(f"E2B could not write stdin for {argv[0]!r}: {e}") from e
        cap = self.limits.max_output_bytes
        out: list[str] = []
        err: list[str] = []
        sizes = [0, 0]
        timed_out = truncated = False
        t0 = time.monotonic()
        try:
            handle = remote.commands.run(
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
        except Exception as e:  # before the deadline (a 502 from a dead VM reads as a
            # TimeoutException too), a dropped stream is the machinery failing
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
        remote = self._use(0)
        try:
            remote.files.write(path, data, user=self.user)
        except Exception as e:
            raise SandboxFileError(f"could not write {path!r} in {self!r}: {e}") from e

    def _read_bytes(self, parts: tuple[str, ...]) -> bytes:
        path = "/".join((self.workdir, *parts))
        remote = self._use(0)
        try:
            return bytes(remote.files.read(path, format="bytes", user=self.user))
        except Exception as e:  # NotFoundException and friends
            raise SandboxFileError(f"could not read {path!r} in {self!r}: {e}") from e

    # ---- sessions --------------------------------------------------------------------------
    def _open_session(self, language: str) -> Session:
        from sandboxes._e2b_session import ContextSession

        return ContextSession(self, language)
