"""A small, deterministic MCP server (written with the official ``mcp`` SDK) for ``tools/mcp-v0``.

It plays a warehouse: stock counts and prices of fictional items, and fixed currency rates,
so the bridge env has tasks with known answers. Every tool only reads (each is marked
``readOnlyHint``), so the env never has to restart this server between episodes. Two extra
tools exist to test robustness:
``slow_echo`` (takes as long as asked, for timeouts) and ``flood`` (returns a huge text, for
output truncation). Run it::

    python -m envs.tools.mcp_demo_server                         # stdio (what the env spawns)
    python -m envs.tools.mcp_demo_server --http --port 8765      # streamable HTTP on 127.0.0.1

The SDK's ``FastMCP`` class is called ``MCPServer`` since mcp 2.0; both are supported.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

__all__ = ["INVENTORY", "PRICES_USD", "RATES", "build_server", "main"]

INVENTORY: dict[str, int] = {
    "widget": 1284,
    "gizmo": 317,
    "sprocket": 2045,
    "flange": 96,
    "gasket": 731,
    "doohickey": 58,
}
PRICES_USD: dict[str, float] = {
    "widget": 3.75,
    "gizmo": 19.99,
    "sprocket": 0.62,
    "flange": 48.5,
    "gasket": 1.15,
    "doohickey": 129.0,
}
RATES: dict[str, float] = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.3}
"""Units of each currency per US dollar."""


def _sdk() -> tuple[Any, type[Exception]]:
    """The server class and the exception whose message reaches the client."""
    try:
        from mcp.server.mcpserver import MCPServer
        from mcp.server.mcpserver.exceptions import ToolError

        return MCPServer, ToolError
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP  # type: ignore[attr-defined]
        from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef]

        return FastMCP, ToolError


def build_server() -> Any:
    """The demo server with its tools registered (not started)."""
    from mcp.types import ToolAnnotations

    server_class, ToolError = _sdk()
    server = server_class("envhub-warehouse", log_level="CRITICAL")
    # nothing an episode does changes the server (by alias: mcp 1.x names the field so)
    read_only = ToolAnnotations.model_validate({"readOnlyHint": True})

    @server.tool(annotations=read_only)
    def get_inventory(item: str) -> str:
        """How many units of an item are in stock."""
        if item.lower() not in INVENTORY:
            raise ToolError(f"unknown item {item!r}; items: {', '.join(INVENTORY)}")
        return str(INVENTORY[item.lower()])

    @server.tool(annotations=read_only)
    def get_price(item: str) -> str:
        """The unit price of an item in US dollars."""
        if item.lower() not in PRICES_USD:
            raise ToolError(f"unknown item {item!r}; items: {', '.join(PRICES_USD)}")
        return str(PRICES_USD[item.lower()])

    @server.tool(annotations=read_only)
    def convert_currency(amount: float, from_currency: str, to_currency: str) -> str:
        """Convert an amount between currencies (USD, EUR, GBP, JPY); rounded to 2 decimals."""
        for code in (from_currency, to_currency):
            if code.upper() not in RATES:
                raise ToolError(f"unknown currency {code!r}; use one of {', '.join(RATES)}")
        return f"{amount / RATES[from_currency.upper()] * RATES[to_currency.upper()]:.2f}"

    @server.tool(annotations=read_only)
    def list_items() -> str:
        """Every item the warehouse stocks."""
        return ", ".join(INVENTORY)

    @server.tool(annotations=read_only)
    async def slow_echo(text: str, seconds: float) -> str:
        """Echo text after waiting (for timeout tests)."""
        await anyio.sleep(min(max(seconds, 0.0), 3600.0))
        return text

    @server.tool(annotations=read_only)
    def flood(size: int) -> str:
        """Return a text of `size` characters (for truncation tests)."""
        return "x" * max(0, min(size, 10_000_000))

    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--http", action="store_true", help="serve streamable HTTP instead of stdio"
    )
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    server = build_server()
    if args.http:
        server.run(transport="streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
