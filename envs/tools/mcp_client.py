"""A synchronous handle on one MCP server, over stdio or streamable HTTP.

Environments are synchronous; the ``mcp`` SDK is async and its transports must be entered
and left in the same task. ``McpConnection`` therefore runs one event loop in a daemon
thread: a single long-lived coroutine opens the transport and the ``ClientSession`` and
holds them until ``close()``; calls are submitted to that loop and waited for with a
timeout, so a tool that never returns costs the caller ``call_timeout_s`` seconds, never a
hang. Closing leaves the contexts in order, which stops a stdio server process (the SDK
closes its stdin, then terminates its process group); ``close`` waits for that before it
stops the loop.

The handshake (``initialize`` and the tool list) is bounded by ``connect_timeout_s``, counted
from the start. A stdio server that has not finished it by then (a wrong entry point, an
npx/uvx server still installing itself) is killed with every process it started, found by a
marker in their environment (``ENVHUB_MCP_SERVER``), before the constructor raises: a failed
connect leaves nothing running and costs about ``connect_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

__all__ = ["McpConnection", "McpError", "McpToolResult"]

MARKER_VAR = "ENVHUB_MCP_SERVER"
"""Set in a stdio server's environment (a value per connection), so the connection can find
the server and everything it started when it must kill them."""
_UNWIND_S = 10.0
"""How long the constructor waits, past ``connect_timeout_s``, for a failed connect to unwind
(the SDK's shutdown is bounded itself; this only guards against a stuck loop)."""


class McpError(RuntimeError):
    """The MCP server could not be reached, or it broke the connection."""


@dataclass(frozen=True)
class McpToolResult:
    text: str
    is_error: bool
    timed_out: bool = False
    """The call did not return within its timeout (the server may still be running it)."""


def _result_text(result: Any) -> str:
    parts = []
    for block in getattr(result, "content", []) or []:
        kind = getattr(block, "type", "")
        parts.append(block.text if kind == "text" else f"[{kind} content]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(str(result.structured_content))
    return "\n".join(parts)


class McpConnection:
    """One live client session with an MCP server (see the module docstring).

    ``command`` starts a stdio server (``["python", "server.py"]``); ``url`` reaches a
    streamable-HTTP server (``"http://127.0.0.1:8765/mcp"``). Give exactly one.
    """

    def __init__(
        self,
        *,
        command: Sequence[str] | None = None,
        url: str | None = None,
        env: dict[str, str] | None = None,
        connect_timeout_s: float = 30.0,
        call_timeout_s: float = 10.0,
    ) -> None:
        if (command is None) == (url is None):
            raise ValueError(
                "give exactly one of command=[...] (stdio server) "
                "or url='http://...' (streamable HTTP)"
            )
        if command is not None and (isinstance(command, str) or not command):
            raise ValueError(
                f"command must be a non-empty list like ['python', 'server.py'], got {command!r}"
            )
        self.command = list(command) if command is not None else None
        self.url = url
        self.env = env
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        self._marker = uuid.uuid4().hex
        self._loop = asyncio.new_event_loop()
        self._session: Any = None
        self._stop = asyncio.Event()
        self._ready = threading.Event()  # connected, or failed (and unwound)
        self._finished = threading.Event()  # ``_hold`` has left the session and transport
        self._error: BaseException | None = None
        self._timed_out = False
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._run_loop, name="envhub-mcp", daemon=True)
        self._lifetime: Any = None
        self.tools: list[Any] = []
        self._thread.start()
        self._lifetime = asyncio.run_coroutine_threadsafe(self._hold(), self._loop)
        if not self._ready.wait(connect_timeout_s + _UNWIND_S):
            self._timed_out = True
        if self._timed_out:
            self.close()
            raise McpError(
                f"the MCP server ({self.describe()}) did not complete the MCP handshake within "
                f"{connect_timeout_s:g}s, so it was stopped. If it is only slow to start (an "
                "npx/uvx server installs itself on its first run), raise connect_timeout_s."
            )
        if self._error is not None:
            error = self._error
            self.close()
            raise McpError(
                f"cannot connect to the MCP server ({self.describe()}): "
                f"{type(error).__name__}: {error}"
            ) from error

    def describe(self) -> str:
        return " ".join(self.command) if self.command else str(self.url)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _transport(self) -> Any:
        if self.command is not None:
            from mcp.client.stdio import (
                StdioServerParameters,
                get_default_environment,
                stdio_client,
            )

            # the SDK's default environment, as before: the marker must not replace it
            env = {**get_default_environment(), **(self.env or {}), MARKER_VAR: self._marker}
            params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=env)
            return stdio_client(params)
        from mcp.client.streamable_http import streamable_http_client

        if self.url is None:
            raise ValueError("an MCP server needs a command or a url")
        return streamable_http_client(self.url)

    async def _hold(self) -> None:
        import anyio
        from mcp import ClientSession

        deadline = time.monotonic() + self.connect_timeout_s
        try:
            async with self._transport() as streams:
                read_stream, write_stream = streams[0], streams[1]
                async with ClientSession(read_stream, write_stream) as session:
                    try:
                        with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                            await session.initialize()
                            listing = await session.list_tools()
                    except TimeoutError:
                        self._timed_out = True
                        self._kill_server()  # before the SDK's polite shutdown waits on it
                        raise
                    self.tools = list(listing.tools)
                    self._session = session
                    self._ready.set()
                    await self._stop.wait()
        except BaseException as exc:  # reported to the caller of __init__ or of call_tool
            self._error = exc
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise
        finally:
            self._session = None
            self._finished.set()
            self._ready.set()

    def _kill_server(self) -> None:
        """SIGKILL the stdio server and every process it started (those that carry this
        connection's marker, and their descendants), and wait until each has exited."""
        if self.command is None:
            return
        import psutil

        found: dict[int, Any] = {}
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.environ().get(MARKER_VAR) == self._marker:
                    for member in (process, *process.children(recursive=True)):
                        found[member.pid] = member
        for process in found.values():
            with contextlib.suppress(psutil.Error):
                process.kill()
        # polled, not waited for: reaping the server would steal its exit from the SDK's watcher
        deadline = time.monotonic() + 5
        waiting = [p for p in found.values() if _running(p)]
        while waiting and time.monotonic() < deadline:
            time.sleep(0.02)
            waiting = [p for p in waiting if _running(p)]

    @property
    def alive(self) -> bool:
        return (
            self._broken is None
            and self._session is not None
            and self._lifetime is not None
            and not self._lifetime.done()
        )

    def call_tool(
        self, name: str, arguments: dict[str, Any], timeout_s: float | None = None
    ) -> McpToolResult:
        """Call a tool; a timeout or server error comes back as an error result, not a raise."""
        if not self.alive:
            reason = f": {type(self._error).__name__}: {self._error}" if self._error else ""
            raise McpError(f"the MCP connection to {self.describe()} is closed{reason}")
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        future = asyncio.run_coroutine_threadsafe(
            self._session.call_tool(name, arguments), self._loop
        )
        try:
            result = future.result(timeout)
        except FutureTimeout:
            future.cancel()
            return McpToolResult(
                f"the tool {name!r} did not return within {timeout:g}s", True, timed_out=True
            )
        except Exception as exc:  # protocol error from the server, e.g. invalid params
            if "connection closed" in str(exc).lower():
                self._broken = exc
            if not self.alive:
                raise McpError(f"the MCP server {self.describe()} went away: {exc}") from exc
            return McpToolResult(f"{type(exc).__name__}: {exc}", True)
        return McpToolResult(_result_text(result), bool(getattr(result, "is_error", False)))

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave the session and transport (stopping a stdio server), then the loop thread.

        The loop stops only once ``_hold`` has left its contexts: the SDK's shutdown of a stdio
        server (close its stdin, then terminate its process group) needs the loop to run. A
        ``_hold`` that does not finish within ``timeout_s`` is cancelled, which runs the same
        shutdown."""
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        if not self._finished.wait(timeout_s) and self._lifetime is not None:
            self._lifetime.cancel()
            self._finished.wait(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()


def _running(process: Any) -> bool:
    """``process`` (a ``psutil.Process``) runs: neither gone nor a zombie nobody reaped yet."""
    import psutil

    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
