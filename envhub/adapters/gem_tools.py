"""GEM's tools as envhub tool schemas: the model calls ``python`` the envhub way.

GEM wraps an env in ``ToolEnvWrapper([PythonCodeTool()])``; the model then writes code in
``<python>...</python>`` and GEM answers with ``Code execution result: ...``. An envhub env
instead publishes OpenAI function schemas and reads ``<tool_call>{"name": ..., "arguments":
...}</tool_call>`` (what the trainer's chat templates and ``envhub eval --model`` produce).
``GemTools`` sits between the two: it publishes the schema, turns an envhub call into GEM's
``<python>`` form for GEM's wrapper, and returns GEM's result as a ``role: tool`` message.
Text with GEM's own ``<python>`` tags still works. The code runs in an envhub sandbox
(``sandboxes``, the ``local`` backend by default: namespaces, no network, rlimits) instead of
GEM's runner, whose ``bwrap`` mode cannot find Python inside a virtual environment and whose
``none`` mode runs model code unisolated; parsing, instructions and the result text are GEM's.

Only GEM's Python tool is mapped: its search tools need a search server and its MCP tool an
MCP server, neither of which ships with GEM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envhub.adapters import did_you_mean, require
from envhub.core import Message, function_tool
from envhub.errors import ActionParseError, SourceConfigError
from envhub.parsing import ToolCallParser

__all__ = ["TOOLS", "GemTools", "SandboxedPython", "sandboxed_run_python"]

TOOLS: dict[str, dict[str, Any]] = {
    "python": function_tool(
        "python",
        "Run a complete Python script in GEM's sandbox and return what it printed (stdout, then "
        "stderr).",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The whole script."}},
            "required": ["code"],
        },
    )
}
"""The envhub schema of each GEM tool the adapter maps, by name."""


class GemTools:
    """The tools of one GEM env: schemas out, GEM's wrapper in (module docstring)."""

    def __init__(self, names: Sequence[str], *, sandbox: str = "local", timeout_s: int = 5) -> None:
        for name in names:
            if name not in TOOLS:
                raise SourceConfigError(
                    f"GEM tool {name!r} is not mapped.{did_you_mean(name, TOOLS)} The adapter "
                    f"maps: {', '.join(TOOLS)}"
                )
        self.names = list(names)
        self.schemas = [TOOLS[name] for name in self.names]
        self.parser = ToolCallParser(tools=tuple(self.schemas))
        self.sandbox, self.timeout_s = sandbox, timeout_s

    def wrap(self, env: Any) -> tuple[Any, SandboxedPython]:
        """``env`` inside GEM's own ``ToolEnvWrapper`` with the Python tool (which the caller
        closes with the env)."""
        wrapper = require("gem", "gem.tools.tool_env_wrapper").ToolEnvWrapper
        tool = SandboxedPython(self.sandbox, self.timeout_s)
        return wrapper(env, tools=[tool]), tool

    def translate(self, action: str) -> tuple[str, str | None]:
        """``(text for GEM, id of the envhub call in it or None)``; a malformed call raises
        ``ActionParseError`` with feedback for the model."""
        calls = self.parser.parse(action)
        if not calls:
            return action, None
        call = calls[0]
        if len(calls) > 1:
            raise ActionParseError(
                "more than one call", feedback="Call one tool at a time; GEM runs one per turn."
            )
        return f"<python>{call.arguments['code']}</python>", call.id

    @staticmethod
    def answer(observation: str, call_id: str | None) -> Message | str:
        """GEM's tool result as a ``tool`` message when it answered an envhub call."""
        if call_id is None:
            return observation
        return {"role": "tool", "name": "python", "tool_call_id": call_id, "content": observation}


class SandboxedPython:
    """GEM's Python tool (its parsing, instructions and result text) running code in an envhub
    sandbox; duck-typed to GEM's ``BaseTool``, which is all ``ToolEnvWrapper`` calls."""

    tool_type = "python_code"
    name = "python"

    def __init__(self, backend: str, timeout_s: int) -> None:
        gem_tool = require("gem", "gem.tools.python_code_tool").PythonCodeTool
        self.gem = gem_tool(timeout=timeout_s)
        self.backend, self.timeout_s = backend, timeout_s
        self._sandbox: Any = None

    def instruction_string(self) -> str:
        return str(self.gem.instruction_string())

    def execute_action(self, action: str) -> tuple[bool, bool, str, str]:
        """GEM's contract: ``(parsed, had_error, observation, parsed_action)``."""
        code, parsed_action, valid = self.gem._parse_action(action)  # GEM 0.1.0's own parser
        if not valid:
            return False, True, "", parsed_action
        if self._sandbox is None:
            from sandboxes import make_sandbox

            self._sandbox = make_sandbox(self.backend).start()
        result = self._sandbox.run_code(code, timeout=self.timeout_s)
        output = f"{result.stdout}\n{result.stderr}" if result.stderr else result.stdout
        if result.timed_out:
            output += f"\n(timed out after {self.timeout_s} s)"
        return (
            True,
            result.exit_code != 0,
            f"Code execution result: {output.lstrip()}\n",
            parsed_action,
        )

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.stop()
            self._sandbox = None


def sandboxed_run_python(
    code: str, sandbox_type: str = "", stdin: str | None = None, timeout: int = 5
) -> tuple[bool, str, str]:
    """GEM's ``gem.utils.sandbox.run_python`` contract, ``(success, stdout, stderr)``, run in
    an envhub ``local`` sandbox; the GEM adapter gives this to GEM's code envs for grading
    (``sandbox_type`` is GEM's and ignored)."""
    from sandboxes import make_sandbox

    with make_sandbox("local") as sandbox:
        result = sandbox.run_code(code, stdin=stdin, timeout=timeout)
    stderr = result.stderr + (
        f"\nExecution timed out after {timeout} seconds." if result.timed_out else ""
    )
    return result.exit_code == 0 and not result.timed_out, result.stdout, stderr
