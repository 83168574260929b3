"""A stateful MCP server for ``test_mcp_lifecycle.py``: ``remember`` stores a note that ``recall``
(marked read-only) reads back: the state one episode must not pass to the next."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("notes", log_level="CRITICAL")
notes: list[str] = []


@server.tool()
def remember(note: str) -> str:
    """Store a note."""
    notes.append(note)
    return "stored"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def recall() -> str:
    """Every note stored so far."""
    return "; ".join(notes) or "(no notes)"


if __name__ == "__main__":
    server.run()
