"""``reset(options={"task": ...})`` with a task that lacks a field says which field and what a
task needs, before any sandbox starts; a built-in terminal task given by kind still plays."""

from __future__ import annotations

import pytest

import envhub
from envs.datasets import TaskSetError

pytest.importorskip("sandboxes.local", reason="the sandboxes package is not available")


def test_humaneval_refuses_a_task_without_tests():
    env = envhub.make("code/humaneval-v0")
    try:
        task = {"prompt": "def f(x):\n    pass\n", "entry_point": "f"}
        with pytest.raises(TaskSetError) as error:
            env.reset(options={"task": task})
        assert "lacks the field(s) ['tests']" in str(error.value)
        assert "a task needs ['prompt', 'tests', 'entry_point']" in str(error.value)
    finally:
        env.close()


def test_terminal_refuses_a_task_without_a_check_and_names_the_built_in_form():
    env = envhub.make("code/terminal-v0")
    try:
        with pytest.raises(TaskSetError) as error:
            env.reset(options={"task": {"instruction": "make a file", "files": {}}})
        message = str(error.value)
        assert "lacks the field(s) ['check']" in message
        assert "or ['kind'] to draw one from its seed" in message, message
    finally:
        env.close()


def test_terminal_refuses_an_unknown_kind():
    env = envhub.make("code/terminal-v0")
    try:
        with pytest.raises(TaskSetError, match="unknown terminal task kind 'count'"):
            env.reset(options={"task": {"kind": "count"}})
    finally:
        env.close()


def test_terminal_plays_a_custom_task_and_a_built_in_one_by_kind():
    env = envhub.make("code/terminal-v0", command_timeout_s=5.0)
    try:
        task = {"instruction": "Create done.txt.", "files": {}, "check": "test -f done.txt"}
        messages, _ = env.reset(options={"task": task})
        assert messages[-1]["content"].startswith("Goal: Create done.txt.")
        _, reward, terminated, _, _ = env.step("```bash\ntouch done.txt\n```")
        assert reward == 1.0 and terminated
        messages, _ = env.reset(options={"task": {"kind": "count-errors", "seed": 1}})
        assert "Count the lines of logs/app.log" in messages[-1]["content"]
    finally:
        env.close()
