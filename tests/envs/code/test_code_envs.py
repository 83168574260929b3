"""code/ envs: model code runs in the sandbox; oracle vs random; bad code never hangs."""

from __future__ import annotations

import pytest

import envhub
from envhub.evaluation import AGENTS, run_episode
from envs.code.harness import split_tests

sandboxes = pytest.importorskip("sandboxes.local", reason="the sandboxes package is not available")

MBPP_STYLE = [
    {
        "id": "add",
        "prompt": 'def add(a, b):\n    """Return a + b."""\n',
        "entry_point": "add",
        "tests": [
            "assert add(1, 2) == 3",
            "assert add(-1, 1) == 0",
            "assert add(10, 5) == 15",
            "assert add(0, 0) == 0",
        ],
        "solution": "def add(a, b):\n    return a + b\n",
    },
]


@pytest.fixture(scope="module")
def humaneval():
    env = envhub.make("code/humaneval-v0")
    yield env
    env.close()


def test_code_envs_are_listed():  # the checker runs over every id in tests/envhub/test_check_all.py
    assert {"code/humaneval-v0", "code/humaneval-single-v0", "code/terminal-v0"} <= {
        s.id for s in envhub.list_envs("code")
    }


def test_humaneval_oracle_passes_every_test_and_random_scores_low(humaneval):
    for index in (0, 32, 77, 120, 163):
        humaneval.reset(options={"task_index": index})
        _, reward, terminated, _, info = humaneval.step(humaneval.expert_action())
        assert (
            terminated and info["success"] and reward == 1.0 and info["passed"] == info["total"] > 0
        )
    random = [run_episode(humaneval, AGENTS["random"], seed=s) for s in range(4)]
    assert sum(r.episode_return for r in random) / 4 < 0.3 and not any(r.success for r in random)


def test_partial_credit_feedback_and_revision(tmp_path):
    path = tmp_path / "mine.jsonl"
    import json

    path.write_text("\n".join(json.dumps(t) for t in MBPP_STYLE))
    env = envhub.make("code/humaneval-v0", dataset=str(path))
    try:
        env.reset(seed=0)
        reply, reward, terminated, _, info = env.step(
            "```python\ndef add(a, b):\n    return a + b if a < 0 else 0\n```"
        )
        assert info["passed"] == 2 and reward == pytest.approx(0.5) and not terminated
        text = reply[0]["content"]  # how many failed and how, never what a test expected
        assert "2/4 tests passed" in text and "2 test(s): your function's result failed" in text
        assert "add(1, 2)" not in text and "== 3" not in text and "15" not in text
        assert "Revise your code (2 attempt(s) left)" in text
        reply = env.step("```python\ndef add(a, b):\n    return [][a]\n```")[0]
        assert "4 test(s): your code raised:" in reply[0]["content"]
        assert "IndexError: list index out of range" in reply[0]["content"]
        _, reward, terminated, _, info = env.step(env.expert_action())
        assert terminated and reward == pytest.approx(0.5) and info["best_score"] == 1.0
    finally:
        env.close()
    binary = envhub.make("code/humaneval-binary-v0", dataset=MBPP_STYLE)
    try:
        binary.reset(seed=0)
        assert (
            binary.step("```python\ndef add(a, b):\n    return a + b if a < 0 else 0\n```")[1]
            == 0.0
        )
    finally:
        binary.close()


def test_the_last_attempt_ends_the_task_as_terminated_not_truncated():
    """Attempts are the task's rule (1 + max_revisions): running out is a lost task,
    not a time limit."""
    env = envhub.make("code/humaneval-single-v0", dataset=MBPP_STYLE)
    try:
        env.reset(seed=0)
        reply, _, terminated, truncated, info = env.step(
            "```python\ndef add(a, b):\n    return 0\n```"
        )
        assert (terminated, truncated, info["success"]) == (True, False, False)
        # add(-1, 1), add(0, 0)
        assert "Revise" not in reply[0]["content"] and "2/4 tests passed" in reply[0]["content"]
    finally:
        env.close()


@pytest.mark.parametrize(
    "code, expect",
    [
        ("def add(a, b):\n    while True:\n        pass\n", "timed out after 1s"),
        ("def add(a, b):\n    print('x' * 10_000_000)\n    return -7\n", "xxxxxxxxxx"),
        ("import os\nos._exit(0)\n", "failed before any test ran"),
        ("def add(a, b):\n    return [0] * (10 ** 10)\n", "MemoryError"),
        (
            "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n",
            "failed before any test ran",
        ),
    ],
)
def test_hostile_code_gives_feedback_within_bounds(code, expect):
    env = envhub.make(
        "code/humaneval-v0", dataset=MBPP_STYLE, test_timeout_s=1.0, wall_time_s=10, memory_mb=256
    )
    try:
        env.reset(seed=0)
        # the test timeout catches a hang
        reply, reward, terminated, _, _ = env.step(f"```python\n{code}```")
        content = reply[0]["content"]
        assert expect in content or "exceeded" in content, content[:500]
        assert reward == 0.0 and not terminated and len(content) < 2_500
    finally:
        env.close()


def test_humaneval_runs_tests_in_a_warm_sandbox_and_episodes_leave_nothing_behind():
    """By default the test runner is forked by the sandbox's fork server (no interpreter
    start-up); an episode's code cannot leave anything the next episode's code can find."""
    env = envhub.make("code/humaneval-v0", dataset=MBPP_STYLE)
    try:
        env.reset(seed=0)
        leave = "import os\nopen('/tmp/left', 'w').close()\nopen('left', 'w').close()\n"
        env.step(f"```python\n{leave}def add(a, b):\n    return a + b\n```")
        sandbox = env.unwrapped._sandbox
        assert sandbox.warm_exec and sandbox._executor is not None
        env.reset(seed=1)
        look = "import os\nprint('seen:', os.path.exists('/tmp/left'), os.path.exists('left'))\n"
        reply, *_ = env.step(f"```python\n{look}def add(a, b):\n    return 0\n```")
        assert "seen: False False" in reply[0]["content"], reply[0]["content"]
    finally:
        env.close()
    cold = envhub.make(
        "code/humaneval-v0", dataset=MBPP_STYLE, sandbox_options={"warm_exec": False}
    )
    try:
        cold.reset(seed=0)
        assert cold.step(cold.expert_action())[2]  # the path it replaced still works
        assert cold.unwrapped._sandbox._executor is None
    finally:
        cold.close()


def test_split_tests_handles_check_functions_and_lists():
    setup, tests = split_tests(
        (
            "import math\ndef check(candidate):\n    x = 3\n    assert candidate(x) == 9\n"
            "    for i in range(3):\n        assert candidate(i) == i * i\n"
        ),
        "sq",
    )
    assert "x = 3" in setup and "candidate = sq" in setup and len(tests) == 2
    assert split_tests(["assert f(1)"], "f") == ("", ["assert f(1)"])
    with pytest.raises(ValueError, match="no assert statements"):
        split_tests("print('hi')", "f")


def test_terminal_oracle_solves_every_kind_and_random_does_not():
    from envs.code.terminal_tasks import TERMINAL_KINDS

    env = envhub.make("code/terminal-v0")
    try:
        for kind in TERMINAL_KINDS:
            env.reset(options={"task_id": f"{kind}-007"})
            while not env.done:
                _, reward, terminated, _, info = env.step(env.expert_action())
            assert terminated and info["success"] and reward == 1.0, kind
        random = [run_episode(env, AGENTS["random"], seed=s) for s in range(3)]
        assert not any(r.success for r in random)
    finally:
        env.close()


def test_terminal_session_persists_and_survives_hangs_and_floods():
    env = envhub.make("code/terminal-v0", command_timeout_s=1.5)
    try:
        env.reset(options={"task_id": "make-tree-000"})
        env.step("```bash\nmkdir -p deep/dir && cd deep/dir && export X=42\n```")
        assert env.step("```bash\npwd; echo $X\n```")[0][0]["content"].startswith(
            "/sandbox/deep/dir\n42"
        )
        reply = env.step("```bash\nsleep 600\n```")[0][0]["content"]
        assert "ran longer than 1.5s" in reply  # the command timeout answered, not the 600 s sleep
        reply = env.step("```bash\nyes | head -c 5000000\n```")[0][0]["content"]
        assert "truncated" in reply and len(reply) < 3_000
        assert "[exit code 0]" in env.step("```bash\ntrue\n```")[0][0]["content"]
    finally:
        env.close()
