"""Code a reasoning model only drafted inside ``<think>...</think>`` is never run: the code
envs take their code (``extract_code``) and command (``extract_command``) from the reply with
its thinking blanked, so a reply whose only code is in its thinking gets the env's usual
"no code" feedback, and the code after the thinking is what runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import envhub
from envs.code.programming import extract_code
from envs.code.terminal import extract_command
from tests.envs.code.test_code_sabotage import RIGHT, TASK, WRONG

pytest.importorskip("sandboxes.local", reason="the sandboxes package is not available")


def test_extractors_ignore_code_inside_thinking():
    assert extract_code(f"<think>\n```python\n{RIGHT}```\n</think>\n").strip() == ""
    assert extract_code(f"<think>```python\n{RIGHT}```</think>\n```python\n{WRONG}```") == (
        WRONG.strip("\n")
    )
    assert extract_command("<think>\n```bash\nrm -rf x\n```\n</think>") == ""
    assert extract_command("<think>```bash\nrm x\n```</think>```bash\nls\n```") == "ls"
    assert extract_command("<answer>ls</answer><think><answer>rm x</answer></think>") == "ls"


@pytest.fixture(scope="module")
def humaneval() -> Iterator[Any]:
    made = envhub.make("code/humaneval-v0", dataset=[TASK], max_revisions=1, test_timeout_s=2.0)
    yield made
    made.close()


def test_humaneval_does_not_run_code_only_inside_thinking(humaneval):
    humaneval.reset(seed=0)
    observation, reward, _, _, info = humaneval.step(f"<think>\n```python\n{RIGHT}```\n</think>\n")
    assert info["invalid_action"] and reward <= 0, (reward, info)
    assert "no code" in observation[0]["content"], observation
    humaneval.reset(seed=0)  # the code after the thinking is the answer
    reply = f"<think>\n```python\n{WRONG}```\n</think>\n```python\n{RIGHT}```"
    _, reward, _, _, info = humaneval.step(reply)
    assert (reward, info["passed"], info["success"]) == (1.0, 2, True)


@pytest.fixture(scope="module")
def terminal() -> Iterator[Any]:
    made = envhub.make("code/terminal-v0", command_timeout_s=3.0)
    yield made
    made.close()


def test_terminal_does_not_run_a_command_only_inside_thinking(terminal):
    terminal.reset(seed=0)
    observation, reward, _, _, info = terminal.step(
        "<think>\n```bash\necho RAN-IN-THINKING\n```\n</think>\n"
    )
    assert info["invalid_action"] and reward <= 0, (reward, info)
    assert "RAN-IN-THINKING" not in observation[0]["content"], observation
    observation, _, _, _, info = terminal.step(
        "<think>```bash\necho DRAFT\n```</think>\n```bash\necho FINAL\n```"
    )
    assert not info["invalid_action"]
    assert "FINAL" in observation[0]["content"] and "DRAFT" not in observation[0]["content"]
