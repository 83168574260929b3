"""Replies with more than one code block: the solution runs, not the usage example after it;
the command runs, not the expected output shown after it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import envhub
from envs.code.programming import extract_code
from envs.code.terminal import extract_command
from tests.envs.code.test_code_sabotage import RIGHT, TASK, WRONG

pytest.importorskip("sandboxes.local", reason="the sandboxes package is not available")

USAGE = "print(add(2, 3))\n"
HELPER = "def plus(a, b):\n    return a + b\n"


@pytest.mark.parametrize(
    "reply, code",
    [
        # the solution, then a usage example: the block that defines the function
        (f"```python\n{RIGHT}```\nUsage:\n```python\n{USAGE}```", RIGHT),
        # a first draft, then the fix, then an example: the last definition
        (f"```python\n{WRONG}```\nFixed:\n```python\n{RIGHT}```\n```python\n{USAGE}```", RIGHT),
        # a helper in a block of its own stays with the function that calls it
        (
            f"```python\n{HELPER}```\n```python\ndef add(a, b):\n    return plus(a, b)\n```",
            HELPER + "\ndef add(a, b):\n    return plus(a, b)\n",
        ),
        # an example before the solution is not a helper, even one that only assigns
        (f"```python\nexpected = add(2, 3)\n```\n```python\n{RIGHT}```", RIGHT),
        # the output shown in a text block is not code
        (f"```python\n{RIGHT}```\nOutput:\n```text\n5\n```", RIGHT),
        # no block defines the function: the blocks of a completion run together
        (
            "```python\n    total = a + b\n```\nthen\n```python\n    return total\n```",
            "    total = a + b\n\n    return total\n",
        ),
    ],
    ids=[
        "usage-after",
        "draft-fix-usage",
        "helper-block",
        "example-before",
        "text-output",
        "completion-parts",
    ],
)
def test_extract_code_takes_the_solution_not_the_example(reply, code):
    assert extract_code(reply, entry_point="add") == code.strip("\n")


@pytest.mark.parametrize(
    "reply, command",
    [
        ("```bash\ngrep -c ERROR app.log > n.txt\n```\nn.txt then holds:\n```\n17\n```", "grep"),
        ("```sh\nls -la\n```\nwhich prints\n```text\ntotal 0\n```", "ls -la"),
        ("Run\n```console\nwc -l *\n```\nExpected:\n```\n3 a.txt\n```", "wc -l *"),
        ("```\nls\n```\nthen\n```\npwd\n```", "pwd"),  # unlabelled only: the last one
    ],
    ids=["bash-then-output", "sh-then-text", "console-then-output", "unlabelled-only"],
)
def test_extract_command_prefers_a_shell_block_to_an_unlabelled_one(reply, command):
    assert extract_command(reply).startswith(command)


@pytest.mark.parametrize(
    "opening",
    ["```python title=solution.py", "``` python", "```py {linenos=true}", "```{.python}"],
)
def test_extract_code_pairs_a_fence_that_says_more_than_its_language(opening):
    """A fence line is ```` ``` ```` and an info string: its first word is the language, the rest
    is ignored. Each block closes where it ends, so the prose between blocks never runs."""
    reply = f"{opening}\n{RIGHT}```\nExample:\n```\n>>> add(2, 3)\n5\n```"
    assert extract_code(reply, entry_point="add") == RIGHT.strip("\n")


@pytest.mark.parametrize(
    "reply, command",
    [
        ("x\n``` bash\nls -la\n```\nthen\n```\nout\n```", "ls -la"),
        ("```bash title=run.sh\nls -la\n```\nthen\n```\nout\n```", "ls -la"),
        ("```zsh\nls -la\n```\nPrints:\n```\ntotal 0\n```", "ls -la"),
        ("```shell-session\n$ ls -la\ntotal 0\n$ pwd\n/work\n```", "ls -la\npwd"),
        ("```console\n$ wc -l a.txt\n3 a.txt\n```", "wc -l a.txt"),
        ("```shell-session\nls -la\n```", "ls -la"),  # no prompts: the block as written
        ("```bash\n$HOME/bin/run\n```", "$HOME/bin/run"),  # bash is never unprompted
    ],
    ids=[
        "space-before-label",
        "info-string",
        "zsh",
        "shell-session-prompts",
        "console-prompt",
        "shell-session-no-prompt",
        "bash-dollar",
    ],
)
def test_extract_command_runs_the_shell_block_whatever_its_fence_says(reply, command):
    assert extract_command(reply) == command


@pytest.fixture(scope="module")
def humaneval() -> Iterator[Any]:
    made = envhub.make("code/humaneval-v0", dataset=[TASK], max_revisions=0, test_timeout_s=2.0)
    yield made
    made.close()


def test_a_solution_followed_by_a_usage_example_passes(humaneval):
    humaneval.reset(seed=0)
    reply = f"```python\n{RIGHT}```\nFor example:\n```python\n{USAGE}```"
    _, reward, terminated, _, info = humaneval.step(reply)
    assert (reward, info["passed"], info["success"], terminated) == (1.0, 2, True, True)


def test_humaneval_solution_then_example_passes_every_test():
    env = envhub.make("code/humaneval-v0", max_revisions=0)
    try:
        env.reset(options={"task_id": "HumanEval/0"})
        solution = env.unwrapped.task["solution"]
        example = "print(has_close_elements([1.0, 2.0], 0.5))\n"
        reply = f"```python\n{solution}```\nExample:\n```python\n{example}```"
        _, reward, _, _, info = env.step(reply)
        assert reward == 1.0 and info["passed"] == info["total"] == 7
    finally:
        env.close()


def test_terminal_runs_the_command_not_the_expected_output_after_it():
    env = envhub.make("code/terminal-v0", kinds=["count-errors"], command_timeout_s=5.0)
    try:
        env.reset(seed=0)
        reply = (
            "I'll count the ERROR lines:\n```bash\ngrep -c ERROR logs/app.log > answer.txt\n```\n"
            "answer.txt should then contain a single number, e.g.\n```\n17\n```"
        )
        observation, reward, terminated, _, _ = env.step(reply)
        assert "command not found" not in observation[0]["content"]
        assert reward == 1.0 and terminated
    finally:
        env.close()
