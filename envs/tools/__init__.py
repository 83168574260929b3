"""Function-calling environments, registered under the ``tools/`` namespace.

Every env publishes OpenAI-format tool schemas (in ``reset`` info and ``env.tools``), reads
calls as JSON in ``<tool_call>...</tool_call>`` tags, answers each with a ``tool`` message,
and ends on a graded ``<answer>...</answer>``. ``tools/mcp-v0`` exposes the tools of any MCP
server (stdio or streamable HTTP) the same way.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register every tool-use env with the envhub registry (called by the registry itself)."""
    from envhub.registry import register

    register(
        "tools/calculator-v0",
        "envs.tools.calculator:CalculatorEnv",
        max_turns=10,
        description="Multi-step maths word problems solved with a calculate tool.",
    )
    register(
        "tools/lookup-v0",
        "envs.tools.lookup:LookupEnv",
        max_turns=4,
        description="Look two codes up with a tool and report both: the smallest tool task.",
    )
    register(
        "tools/sql-v0",
        "envs.tools.sql:SqlEnv",
        max_turns=10,
        description="Answer questions about a generated company database with SQLite tools.",
    )
    register(
        "tools/retrieval-v0",
        "envs.tools.retrieval:RetrievalEnv",
        max_turns=12,
        description="Multi-hop questions over a local encyclopedia with search and read tools.",
    )
    register(
        "tools/mcp-v0",
        "envs.tools.mcp_bridge:McpEnv",
        max_turns=12,
        description=(
            "Tasks solved with the tools of an MCP server (stdio or streamable HTTP); "
            "demo server built in."
        ),
    )
