"""``tools/mcp-v0``: the tools of any MCP server, offered to the model as function tools.

The env connects to an MCP server with the official ``mcp`` SDK, over stdio
(``command=["python", "my_server.py"]``) or streamable HTTP (``url="http://127.0.0.1:8000/mcp"``),
lists its tools, publishes them as OpenAI-format schemas and forwards every parsed
``<tool_call>`` to the server; results come back as ``tool`` messages. Calls are bounded by
``call_timeout_s``. A server that dies mid-episode fails the episode: ``step`` raises
``McpError``, which ``envhub eval``, pool workers and the trainer all record as a failed
episode (``env_error``), never as a reward-0 loss; the next ``reset`` starts it again.

Episodes are independent: with ``restart_server="episode"`` (the default) nothing one episode
leaves in a stdio server (notes, files, rows, a graded answer) reaches the next, because
``reset`` restarts the server after an episode that called any tool the server does not mark
read-only (``readOnlyHint``) or a call that did not return in time. A restart costs one server
start (~0.5 s for a Python server written with the SDK); an episode of read-only calls costs
none (every tool of the built-in server is read-only). ``restart_server="never"`` keeps one
server for the env's life. A ``url=`` server is not ours to restart: "episode" opens a new
session instead, and whatever the server keeps itself is shared by every env and episode
that uses it (reset it in the server if your tasks need that).

Tasks are ``{"question", "answer"}`` records (``dataset=``); an optional ``"plan"`` — a list
of ``{"name", "arguments"}`` calls — lets the oracle solve them. With no server given, the
env spawns the built-in warehouse server (``envs.tools.mcp_demo_server``) and uses its tasks.
The connection opens on the first ``reset`` and is dropped when the env is pickled.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from envhub.core import Message, Turn, function_tool
from envhub.parsing import format_tool_call
from envs.datasets import Task
from envs.tools.answers import normalise, number, number_matches
from envs.tools.base import ToolEnv, ToolError
from envs.tools.mcp_client import McpConnection, McpError
from envs.tools.mcp_demo_server import INVENTORY, PRICES_USD, RATES

__all__ = ["McpEnv", "demo_tasks"]

_log = logging.getLogger(__name__)

DEMO_COMMAND = [sys.executable, "-m", "envs.tools.mcp_demo_server"]


def demo_tasks() -> list[Task]:
    """Questions about the demo warehouse, each with the oracle's call plan."""
    tasks: list[Task] = []
    items = list(INVENTORY)
    for i, item in enumerate(items):
        for currency in ("EUR", "GBP"):
            value_usd = round(INVENTORY[item] * PRICES_USD[item], 2)
            answer = f"{value_usd / RATES['USD'] * RATES[currency]:.2f}"
            tasks.append(
                {
                    "id": f"value-{item}-{currency.lower()}",
                    "question": (
                        f"What is the total value in {currency} of all {item}s in stock? "
                        "Round to cents."
                    ),
                    "answer": answer,
                    "plan": [
                        {"name": "get_inventory", "arguments": {"item": item}},
                        {"name": "get_price", "arguments": {"item": item}},
                        {
                            "name": "convert_currency",
                            "arguments": {
                                "amount": value_usd,
                                "from_currency": "USD",
                                "to_currency": currency,
                            },
                        },
                    ],
                }
            )
        other = items[(i + 1) % len(items)]
        tasks.append(
            {
                "id": f"stock-{item}-{other}",
                "question": (
                    f"How many more units of {item} than of {other} are in stock? "
                    "(Negative if fewer.)"
                ),
                "answer": str(INVENTORY[item] - INVENTORY[other]),
                "plan": [
                    {"name": "get_inventory", "arguments": {"item": item}},
                    {"name": "get_inventory", "arguments": {"item": other}},
                ],
            }
        )
    return tasks


class McpEnv(ToolEnv):
    """Tasks solved with the tools of an MCP server (see the module docstring)."""

    required_fields = ("question", "answer")
    intro = "Answer the question using the tools of the connected MCP server."

    def __init__(
        self,
        *,
        command: Sequence[str] | None = None,
        url: str | None = None,
        server_env: dict[str, str] | None = None,
        dataset: str | Iterable[Mapping[str, Any]] | None = None,
        hidden_tools: Sequence[str] | None = None,
        call_timeout_s: float = 10.0,
        connect_timeout_s: float = 30.0,
        restart_server: Literal["episode", "never"] = "episode",
        **options: Any,
    ) -> None:
        if restart_server not in ("episode", "never"):
            raise ValueError(
                f"restart_server must be 'episode' or 'never', got {restart_server!r}: "
                "'episode' keeps episodes independent (the default), 'never' keeps one server"
            )
        if command is not None and url is not None:
            raise ValueError(
                "give command=[...] (stdio) or url='http://...' (streamable HTTP), not both"
            )
        builtin = command is None and url is None
        if not builtin and dataset is None:
            raise ValueError(
                "tools/mcp-v0 with your own MCP server needs dataset= "
                "(JSONL or list of {'question', 'answer'} tasks)"
            )
        self.command = None
        if url is None:
            self.command = list(DEMO_COMMAND if command is None else command)
        self.url = url
        self.server_env = server_env
        self.hidden_tools = set(
            hidden_tools
            if hidden_tools is not None
            else (("slow_echo", "flood") if builtin else ())
        )
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.restart_server = restart_server
        self._connection: McpConnection | None = None
        self._read_only: set[str] = set()
        """Tools the server marks read-only: calling them leaves nothing to undo."""
        self._dirty = False
        """This episode may have changed the server's state (a restart is due at reset)."""
        self._changed_by: str | None = None
        """The first tool not marked read-only that this episode called."""
        self._said_restart = False
        """Whether the restarts' warning was logged (once per env)."""
        self._failure: str | None = None
        """Why this episode's server failed (then every step raises until the next reset)."""
        super().__init__(dataset=dataset, **options)

    def builtin_tasks(self) -> list[Task]:
        return demo_tasks()

    # ------------------------------------------------------------------ connection
    def connection(self) -> McpConnection:
        """The live connection, opened (and the tool list read) on first use."""
        if self._connection is None or not self._connection.alive:
            if self._connection is not None:
                self._connection.close()
            self._connection = McpConnection(
                command=self.command,
                url=self.url,
                env=self.server_env,
                connect_timeout_s=self.connect_timeout_s,
                call_timeout_s=self.call_timeout_s,
            )
            tools = [
                function_tool(
                    t.name,
                    t.description or "",
                    t.input_schema or {"type": "object", "properties": {}},
                )
                for t in sorted(self._connection.tools, key=lambda t: t.name)
                if t.name not in self.hidden_tools
            ]
            self._read_only = {t.name for t in self._connection.tools if _read_only(t)}
            if tools != self.tools:  # (an unchanged list is not checked again at reset)
                self.tools = tools
                self.parser = dataclasses.replace(self.parser, tools=tuple(self.tools))
                self.system_prompt = self._system_prompt()
        return self._connection

    def start(self, task: Task) -> str:
        """Open the episode on a server no earlier episode changed (see the module docstring)."""
        self._failure = None
        if self._connection is not None and self._dirty and self.restart_server == "episode":
            if not self._said_restart and self._changed_by is not None:
                self._said_restart = True
                _log.warning(
                    "tools/mcp-v0: restarting the MCP server between episodes (one server start "
                    "each) because the episode called %r, which the server does not mark "
                    "read-only (readOnlyHint); mark the tools that change nothing so, or make "
                    "the env with restart_server='never' if episodes cannot change the server",
                    self._changed_by,
                )
            self._connection.close()
            self._connection = None
        self._dirty, self._changed_by = False, None
        self.connection()
        return str(task["question"])

    def on_message(self, message: Message) -> Turn:
        """``ToolEnv.on_message`` (which text actions reach through ``on_step`` too); a server
        that died fails the episode on both paths (``McpError``, see the module docstring)."""
        if self._failure is not None:
            raise McpError(
                f"tools/mcp-v0: {self._failure} earlier in this episode; "
                "call reset() to start a new one"
            )
        try:
            return super().on_message(message)
        except McpError as error:
            self._failure = f"the MCP server went away ({error})"
            raise McpError(
                f"tools/mcp-v0: {error}; the episode cannot go on. The next reset() starts "
                "the server again (or reconnects to it, for url=)."
            ) from error

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name not in self._read_only:
            self._dirty = True
            self._changed_by = self._changed_by or name
        result = self.connection_for_call().call_tool(name, arguments)
        if result.timed_out:  # it may still be running (or blocking the server)
            self._dirty = True
        if result.is_error:
            raise ToolError(result.text)
        return result.text

    def connection_for_call(self) -> McpConnection:
        if self._connection is None:  # e.g. an unpickled copy: connect now
            return self.connection()
        if not self._connection.alive:
            raise McpError(f"the MCP server {self._connection.describe()} went away")
        return self._connection

    def grade(self, answer: str) -> float:
        """1.0 for the expected answer (``envs.tools.answers``): a number as its one value within
        half a cent, anything else as the same text once normalised."""
        expected = str(self.task["answer"])
        target = number(expected)
        if target is not None:
            matched = number_matches(answer, target, stated=self.question, tolerance=0.005)
            return 1.0 if matched else 0.0
        return 1.0 if normalise(answer) == normalise(expected) else 0.0

    def plan(self) -> list[str]:
        calls = [
            format_tool_call(step["name"], step.get("arguments", {}))
            for step in self.task.get("plan", [])
        ]
        return [*calls, f"<answer>{self.task['answer']}</answer>"]

    def random_call(self, np_random: np.random.Generator) -> str:
        item = str(np_random.choice([*INVENTORY, "thingamajig"]))
        name = str(np_random.choice(["get_inventory", "get_price", "list_items"]))
        return format_tool_call(name, {} if name == "list_items" else {"item": item})

    # ------------------------------------------------------------------ lifecycle
    def on_close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_connection"] = None  # reconnected on the next reset
        return state


def _read_only(tool: Any) -> bool:
    """Whether the server marks ``tool`` read-only (``annotations.readOnlyHint``)."""
    annotations = getattr(tool, "annotations", None)
    hint = getattr(annotations, "read_only_hint", getattr(annotations, "readOnlyHint", None))
    return hint is True
