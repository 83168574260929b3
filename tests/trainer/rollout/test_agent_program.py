"""A program agent (``rollout.agent.command``) is a process the trainer cleans up after.

What a user relies on: when the agent exits, the episode ends then, whatever it left running
(a helper that inherited its stderr is killed with its process group, not waited for until
``rollout.agent.timeout_s``), and however much it logs, the trainer keeps only a bounded tail
of its stderr, enough to say why it failed.
"""

from __future__ import annotations

import os
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("openai")

from tests.trainer.conftest import LAKE
from tests.trainer.rollout.test_agent_proxy import AGENTS, engine_for, with_agent
from trainer.rollout.groups import EpisodeSpec
from trainer.rollout.trajectory import ChatRenderer


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited (its parent reaps it)
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_an_agent_that_exits_ends_its_episode_and_its_leftover_children(
    policy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = tmp_path / "orphan.pid"
    monkeypatch.setenv("ORPHAN_PID_FILE", str(pid_file))
    started = time.monotonic()
    (t,) = with_agent(
        engine_for(policy),
        ChatRenderer(policy[1]),
        [EpisodeSpec(LAKE, 5, 0)],
        command=[sys.executable, "-m", AGENTS, "orphan"],
        timeout_s=20,
    )
    took = time.monotonic() - started
    assert t.failure is None and t.num_turns >= 1
    assert took < 15, f"the episode waited {took:.1f} s for the agent's leftover child"
    orphan = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(orphan), "the agent's child outlived its episode"


def test_a_chatty_agents_stderr_is_kept_as_a_bounded_tail(policy) -> None:
    tracemalloc.start()
    try:
        (t,) = with_agent(
            engine_for(policy),
            ChatRenderer(policy[1]),
            [EpisodeSpec(LAKE, 5, 0)],
            command=[sys.executable, "-m", AGENTS, "noisy"],
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"the trainer held {peak / 2**20:.0f} MiB for 32 MB of stderr"
    assert t.failed and "exited with status 3" in (t.failure or "")
    assert "the last words" in (t.failure or "")  # the tail, short enough to be kept
