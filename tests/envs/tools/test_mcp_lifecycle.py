"""tools/mcp-v0 across episodes and failures: a server that dies mid-episode, one that never
finishes the MCP handshake, and what a server keeps from one episode to the next."""

from __future__ import annotations

import contextlib
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from envhub.evaluation import run_episode

pytest.importorskip("mcp", reason="the mcp SDK is not installed (pip install 'envhub[tools]')")

from envs.tools.mcp_bridge import McpEnv  # (after the skip for a missing SDK)
from envs.tools.mcp_client import McpConnection, McpError

NOTES_SERVER = [sys.executable, str(Path(__file__).with_name("mcp_notes_server.py"))]
NOTES_TASKS = [{"id": "notes-0", "question": "Store a note, then answer ok.", "answer": "ok"}]


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def running(fragment: str) -> list[psutil.Process]:
    """Every process on the host (orphans included) whose command line holds ``fragment``."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if fragment in " ".join(process.info["cmdline"] or []) and (
                process.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(process)
    return found


def server_pids(fragment: str = "mcp_demo_server") -> list[int]:
    own = {p.pid for p in psutil.Process().children(recursive=True)}
    return [p.pid for p in running(fragment) if p.pid in own]


@pytest.fixture
def reaped() -> Iterator[list[str]]:
    """Command-line fragments whose processes are killed after the test (a failing run of a
    leak test must not leave them behind)."""
    fragments: list[str] = []
    yield fragments
    for fragment in fragments:
        for process in running(fragment):
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_a_dead_server_fails_the_episode_with_a_clear_error_and_reset_restarts_it():
    env = McpEnv()
    try:
        env.reset(seed=0)
        for pid in server_pids():
            psutil.Process(pid).kill()
        with pytest.raises(McpError, match=r"(?s)MCP server .*went away.*next reset\(\)"):
            env.step(call("get_inventory", item="widget"))
        with pytest.raises(McpError, match=r"call reset\(\)"):  # the episode stays over
            env.step(call("get_inventory", item="widget"))
        env.reset(seed=0)
        assert env.step(call("get_inventory", item="widget"))[0][0]["content"] == "1284"
    finally:
        env.close()
    psutil.wait_procs([psutil.Process(pid) for pid in server_pids()], timeout=5)
    assert server_pids() == []


def test_eval_records_a_dead_server_as_a_failed_episode_not_a_loss():
    """What ``envhub eval`` and the trainer read: an env that raises fails the episode
    (``failure="env_error"``), where an ordinary reward-0 ending would count as a loss."""

    def kill_then_call(env: Any, observation: Any) -> str:
        for pid in server_pids():
            psutil.Process(pid).kill()
        return call("get_inventory", item="widget")

    env = McpEnv()
    try:
        stats = run_episode(env, kill_then_call, seed=0)
    finally:
        env.close()
    assert stats.failure == "env_error" and "went away" in stats.detail and not stats.success


def test_a_server_that_never_completes_the_handshake_is_stopped_with_its_children(reaped):
    """A command that never speaks MCP (a wrong entry point, an npx/uvx server still installing
    itself): the connect timeout stops it, and the child it started, even one that ignores
    SIGTERM."""
    token = f"envhub-test-noinit-{uuid.uuid4().hex}"
    reaped.append(token)
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]]); "
        "time.sleep(600)"
    )
    with pytest.raises(McpError) as raised:
        McpConnection(command=[sys.executable, "-c", script, token], connect_timeout_s=2)
    assert running(token) == [], "the server (or its child) outlived the connect timeout"
    assert "did not complete the MCP handshake within 2s" in str(raised.value)
    assert "connect_timeout_s" in str(raised.value)  # the fix for a server that is only slow


def test_nothing_one_episode_leaves_in_the_server_reaches_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = McpEnv(command=NOTES_SERVER, dataset=NOTES_TASKS)
    try:
        for _ in range(2):
            env.reset(seed=0)
            assert env.step(call("recall"))[0][0]["content"] == "(no notes)"
            assert env.step(call("remember", note="secret-7319"))[0][0]["content"] == "stored"
            env.step("<answer>ok</answer>")
        env.reset(seed=0)
    finally:
        env.close()
    assert server_pids("mcp_notes_server") == []
    # the restarts' cost is said once, with the tool that caused it and how to avoid it
    said = [r.getMessage() for r in caplog.records if "restarting the MCP server" in r.getMessage()]
    assert len(said) == 1 and "'remember'" in said[0] and "readOnlyHint" in said[0], said


def test_restart_server_never_keeps_one_server_for_every_episode():
    env = McpEnv(command=NOTES_SERVER, dataset=NOTES_TASKS, restart_server="never")
    try:
        env.reset(seed=0)
        env.step(call("remember", note="kept"))
        env.reset(seed=0)
        assert env.step(call("recall"))[0][0]["content"] == "kept"
    finally:
        env.close()
    with pytest.raises(ValueError, match=r"restart_server must be 'episode' or 'never'"):
        McpEnv(restart_server="always")


def test_an_episode_of_read_only_calls_keeps_its_server():
    """Restarting costs a server start (~0.5 s for a Python one): an episode whose calls were
    all to tools the server marks read-only (``readOnlyHint``) left nothing to undo."""
    env = McpEnv()  # the demo warehouse: every tool is read-only
    try:
        env.reset(seed=0)
        while not env.done:
            env.step(env.expert_action())
        first = server_pids()
        env.reset(seed=1)
        assert server_pids() == first and len(first) == 1
    finally:
        env.close()
