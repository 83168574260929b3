"""A synchronous handle on one MCP server, over stdio or streamable HTTP.

Environments are synchronous; the ``mcp`` SDK is async and its transports must be entered
and left in the same task. ``McpConnection`` therefore runs one event loop in a daemon
thread: a single long-lived coroutine opens the transport and the ``ClientSession`` and
holds them until ``close()``; calls are submitted to that loop and waited for with a
timeout, so a tool that never returns costs the caller ``call_timeout_s`` seconds, never a
hang. Closing leaves the contexts in order, which stops a stdio server process.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

__all__ = ["McpConnection", "McpError", "McpToolResult"]


class McpError(RuntimeError):
    """The MCP server could not be reached, or it broke the connection."""


@dataclass(frozen=True)
class McpToolResult:
    text: str
    is_error: bool


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
        self._loop = asyncio.new_event_loop()
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._run_loop, name="envhub-mcp", daemon=True)
        self._lifetime: Any = None
        self.tools: list[Any] = []
        self._thread.start()
        self._lifetime = asyncio.run_coroutine_threadsafe(self._hold(), self._loop)
        if not self._ready.wait(connect_timeout_s):
            self.close()
            raise McpError(
                f"the MCP server ({self.describe()}) did not answer within {connect_timeout_s:.0f}s"
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
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(
                command=self.command[0], args=self.command[1:], env=self.env
            )
            return stdio_client(params)
        from mcp.client.streamable_http import streamable_http_client

        if self.url is None:
            raise ValueError("an MCP server needs a command or a url")
        return streamable_http_client(self.url)

    async def _hold(self) -> None:
        from mcp import ClientSession

        self._stop = asyncio.Event()
        try:
            async with self._transport() as streams:
                read_stream, write_stream = streams[0], streams[1]
                async with ClientSession(read_stream, write_stream) as session:
                    await session.initialize()
                    listing = await session.list_tools()
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
            self._ready.set()

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
            return McpToolResult(f"the tool {name!r} did not return within {timeout:g}s", True)
        except Exception as exc:  # protocol error from the server, e.g. invalid params
            if "connection closed" in str(exc).lower():
                self._broken = exc
            if not self.alive:
                raise McpError(f"the MCP server {self.describe()} went away: {exc}") from exc
            return McpToolResult(f"{type(exc).__name__}: {exc}", True)
        return McpToolResult(_result_text(result), bool(getattr(result, "is_error", False)))

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave the session and transport (stopping a stdio server) and the loop thread."""
        if not self._thread.is_alive():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        elif self._lifetime is not None:
            self._lifetime.cancel()
        if self._lifetime is not None:
            try:
                self._lifetime.result(timeout_s)
            except BaseException:  # noqa: BLE001 - already reported, or cancelled
                self._lifetime.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
