"""The MCP bridge against a real local MCP server (the SDK's server class), stdio and HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import psutil
import pytest

import envhub
from envs.tools.mcp_bridge import McpEnv, demo_tasks
from envs.tools.mcp_client import McpConnection, McpError

pytest.importorskip("mcp", reason="the mcp SDK is not installed (pip install 'envhub[tools]')")


def call(name, **arguments):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def server_processes():
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "mcp_demo_server" in " ".join(p.cmdline())
    ]


@pytest.fixture(scope="module")
def stdio_env():
    env = McpEnv(hidden_tools=[], call_timeout_s=1.5)
    yield env
    env.close()


def test_stdio_server_tools_become_openai_schemas(stdio_env):
    _, info = stdio_env.reset(seed=0)
    names = [tool["function"]["name"] for tool in info["tools"]]
    assert names == sorted(
        ["convert_currency", "flood", "get_inventory", "get_price", "list_items", "slow_echo"]
    )
    tool = next(t for t in info["tools"] if t["function"]["name"] == "convert_currency")
    schema = tool["function"]["parameters"]
    assert set(schema["required"]) == {"amount", "from_currency", "to_currency"}
    reply = stdio_env.step(call("get_price", item="gizmo"))[0]
    assert reply == [
        {"role": "tool", "name": "get_price", "tool_call_id": "call00000", "content": "19.99"}
    ]


def test_server_side_errors_reach_the_model(stdio_env):
    stdio_env.reset(seed=0)
    content = stdio_env.step(call("get_inventory", item="thingamajig"))[0][0]["content"]
    assert content.startswith("Error:") and "unknown item 'thingamajig'" in content


def test_a_tool_that_never_returns_times_out_and_the_env_stays_usable(stdio_env):
    stdio_env.reset(seed=0)
    content = stdio_env.step(call("slow_echo", text="hi", seconds=600))[0][0]["content"]
    assert "did not return within 1.5s" in content  # the env's timeout answered, not the 600 s tool
    assert stdio_env.step(call("get_inventory", item="widget"))[0][0]["content"] == "1284"


def test_a_flood_of_output_is_truncated(stdio_env):
    stdio_env.reset(seed=0)
    content = stdio_env.step(call("flood", size=300_000))[0][0]["content"]
    assert len(content) < 2_200 and "[truncated 298000 characters]" in content


# A server that dies mid-episode, one that never finishes the handshake, and server state
# between episodes: test_mcp_lifecycle.py.


def test_close_stops_the_stdio_server():
    others = {p.pid for p in server_processes()}  # (the module's stdio_env has one too)
    env = McpEnv()
    env.reset(seed=0)
    mine = [p for p in server_processes() if p.pid not in others]
    assert len(mine) == 1
    env.close()
    env.close()
    _, alive = psutil.wait_procs(mine, timeout=5)
    assert alive == []


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(McpError, match="cannot connect to the MCP server"):
        McpConnection(
            command=[sys.executable, "-c", "import sys; sys.exit(3)"], connect_timeout_s=10
        )
    with pytest.raises(ValueError, match="needs dataset="):
        McpEnv(command=["my-server"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server_plays_the_same_tasks():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "envs.tools.mcp_demo_server", "--http", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        env = envhub.make(
            "tools/mcp-v0",
            url=f"http://127.0.0.1:{port}/mcp",
            dataset=demo_tasks(),
            hidden_tools=["slow_echo", "flood"],
        )
        try:
            for seed in range(3):
                env.reset(seed=seed)
                while not env.done:
                    _, reward, *_ = env.step(env.expert_action())
                assert reward == 1.0
        finally:
            env.close()
    finally:
        server.terminate()
        server.wait(10)
