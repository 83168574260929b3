"""An attempt's code cannot break the next attempt's test run into an env error (which the
trainer replays on a fresh env and never scores: a free re-roll for the policy): each run
writes the runner's files where no earlier code can have planted anything, and what the code
did to the sandbox that still stops them (a full scratch) is scored as the code's failure; any
other failure to write them is the sandbox's, and raises (an env error)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import envhub

pytest.importorskip("sandboxes.local", reason="the sandboxes package is not available")

TASK = {
    "id": "add",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "entry_point": "add",
    "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"],
}
WRONG = "def add(a, b):\n    return 0\n"
RIGHT = "def add(a, b):\n    return a + b\n"

PLANT = """
import os
def plant(where):
    for name, how in (("runner.py", "symlink"), ("runner.bin", "dir"),
                      ("runner_source.py", "dir"), ("solution.py", "fifo")):
        path = os.path.join(where, name)
        try:
            os.remove(path)
        except OSError:
            pass
        try:
            {"symlink": lambda p: os.symlink("/etc/passwd", p), "dir": os.mkdir,
             "fifo": os.mkfifo}[how](path)
        except OSError:
            pass
for where in {os.environ["HOME"], os.getcwd()}:  # scratch, and where this run's files are
    plant(where)
    for name in (".envhub", ".envhub/run"):  # and where a runner directory might go
        try:
            os.makedirs(os.path.join(where, name), exist_ok=True)
        except OSError:
            pass
"""
FILL = """
import os
for name in os.listdir():  # this run's files: space the next run's must not find again
    try:
        os.remove(name)
    except OSError:
        pass
for i in range(8):  # until scratch is full (each file stays under RLIMIT_FSIZE)
    try:
        with open(os.path.join(os.environ["HOME"], f"fill{i}"), "wb") as f:
            for _ in range(32):
                f.write(b"x" * (1 << 20))
    except OSError:
        break
"""


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    made = envhub.make("code/humaneval-v0", dataset=[TASK], max_revisions=1, test_timeout_s=2.0)
    yield made
    made.close()


def attempt(env: Any, code: str) -> tuple[str, float, dict[str, Any]]:
    reply, reward, _, _, info = env.step(f"```python\n{code}```")
    return reply[0]["content"], reward, info


def test_files_planted_at_the_runners_paths_do_not_reach_the_next_attempt(env):
    env.reset(seed=0)
    _, reward, info = attempt(env, WRONG + PLANT)
    assert (reward, info["passed"]) == (0.0, 0)
    _, reward, info = attempt(env, RIGHT)  # scored as usual: the plants are not in its way
    assert (reward, info["passed"], info["success"]) == (1.0, 2, True)


def test_a_scratch_filled_by_earlier_code_is_that_codes_failure_not_an_env_error(env):
    env.reset(seed=0)
    attempt(env, WRONG + FILL)
    reply, reward, info = attempt(env, RIGHT)  # nothing raised: a score of 0, and why
    assert (reward, info["passed"], info["success"]) == (0.0, 0, False)
    assert "scratch" in reply and "full" in reply, reply


def test_a_sandbox_write_failure_that_is_not_a_full_scratch_is_an_env_error(env, monkeypatch):
    """e2b and docker raise ``SandboxFileError`` for any failed write (network, expired VM,
    daemon): not the code's doing, so the step raises (the trainer replays the episode)
    instead of scoring the code 0."""
    from sandboxes import SandboxFileError

    env.reset(seed=0)
    sandbox = env.unwrapped.sandbox()

    def broken(parts: tuple[str, ...], data: bytes) -> None:
        raise SandboxFileError("network")

    monkeypatch.setattr(sandbox, "_write_bytes", broken)
    with pytest.raises(SandboxFileError, match="network"):
        attempt(env, RIGHT)
