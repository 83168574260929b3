"""A program agent (``rollout.agent.command``) is a process the trainer cleans up after.

What a user relies on: when the agent exits, the episode ends then, whatever it left running
(a helper that inherited its stderr is killed with its process group, not waited for until
``rollout.agent.timeout_s``), and however much it logs, the trainer keeps only a bounded tail
of its stderr, enough to say why it failed.
"""

from __future__ import annotations

import os
import select
import sys
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("openai")

from tests.trainer.conftest import LAKE
from tests.trainer.rollout.test_agent_proxy import AGENTS, engine_for, with_agent
from trainer.rollout.groups import EpisodeSpec
from trainer.rollout.trajectory import ChatRenderer


def test_an_agent_that_exits_ends_its_episode_and_its_leftover_children(
    policy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = tmp_path / "orphan.pid"
    monkeypatch.setenv("ORPHAN_PID_FILE", str(pid_file))
    (t,) = with_agent(
        engine_for(policy),
        ChatRenderer(policy[1]),
        [EpisodeSpec(LAKE, 5, 0)],
        command=[sys.executable, "-m", AGENTS, "orphan"],
        timeout_s=20,  # the orphan outlives it: waiting for its stderr would fail "agent timeout"
    )
    assert t.failure is None and t.num_turns >= 1
    try:  # killed with the agent's group: its pidfd turns readable once it has exited
        pidfd = os.pidfd_open(int(pid_file.read_text()))
    except ProcessLookupError:
        return  # exited and reaped already
    try:
        exited, _, _ = select.select([pidfd], [], [], 10)
    finally:
        os.close(pidfd)
    assert exited, "the agent's child outlived its episode"


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
