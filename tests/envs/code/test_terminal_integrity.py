"""``code/terminal-v0`` rewards doing the task, not a shortcut around its checker.

Each shortcut test runs a command that leaves the checked outputs looking done without doing
what the instruction asks, asserts it earns nothing, and then solves the same task with the
shipped expert plan, which must still earn 1.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

import envhub

pytest.importorskip("sandboxes.local", reason="the sandboxes package is not available")

CHECK_TIMEOUT_S = 3.0
"""The env's command timeout, which also bounds each checker run."""


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    made = envhub.make("code/terminal-v0", command_timeout_s=CHECK_TIMEOUT_S)
    yield made
    made.close()


def send(env: Any, command: str) -> tuple[str, float, dict[str, Any]]:
    """One turn: ``command`` in a bash block; returns (observation text, reward, info)."""
    observation, reward, _, _, info = env.step(f"```bash\n{command}\n```")
    return observation[0]["content"], reward, info


def solve_with_expert(env: Any) -> tuple[float, bool]:
    """Follow the env's expert plan to the end; returns (last reward, success)."""
    reward, success = 0.0, False
    while not env.done:
        _, reward, _, _, info = env.step(env.expert_action())
        success = info["success"]
    return reward, success


def tree_name(env: Any) -> str:
    """The project name of a make-tree task, from its instruction."""
    match = re.search(r"directories (\w+)/src", env.unwrapped.task["instruction"])
    assert match, env.unwrapped.task["instruction"]
    return match.group(1)


CONFIG_WIPE = (
    'p=$(grep ^port app.ini); printf "%s\\ndebug = false\\n\\n\\n\\n\\n\\n" "$p" > app.ini'
)
SHORTCUTS = {
    "fix-script: a script that only prints OK": (
        "fix-script",
        "printf \"print('OK')\\n\" > fix.py",
    ),
    "fix-script: right only for small N": (
        "fix-script",
        (
            "printf 'import sys\\nn = int(sys.argv[1])\\n"
            "print(n * (n + 1) // 2 if n <= 50 else 0)\\n' > fix.py"
        ),
    ),
    "config-edit: host and [cache] deleted": ("config-edit", CONFIG_WIPE),
    "rename-ext: empty .md files, contents lost": (
        "rename-ext",
        'for f in notes/*.txt; do rm "$f"; touch "${f%.txt}.md"; done',
    ),
    "make-tree: symlinks instead of directories": (
        "make-tree",
        (
            'n={name}; mkdir -p .x "$n" && ln -s "$PWD/.x" "$n/src" && ln -s "$PWD/.x" "$n/tests"'
            ' && touch "$n/README.md"'
        ),
    ),
}


@pytest.mark.parametrize("kind, shortcut", SHORTCUTS.values(), ids=list(SHORTCUTS))
@pytest.mark.parametrize("seed", [0, 7])
def test_a_shortcut_earns_nothing_and_the_expert_plan_still_earns_one(
    env: Any, kind: str, shortcut: str, seed: int
) -> None:
    task = {"kind": kind, "seed": seed}
    env.reset(options={"task": task})
    command = shortcut.format(name=tree_name(env)) if kind == "make-tree" else shortcut
    text, reward, info = send(env, command)
    assert reward == 0.0 and not info["success"], text
    env.reset(options={"task": task})
    assert solve_with_expert(env) == (1.0, True)


def test_config_edit_accepts_the_edit_without_the_final_newline(env: Any) -> None:
    """The instruction allows any way of editing; dropping the file's last newline is fine."""
    env.reset(options={"task": {"kind": "config-edit", "seed": 3}})
    command = (
        "sed 's/^debug = true$/debug = false/' app.ini > new.ini && "
        'printf %s "$(cat new.ini)" > app.ini && rm new.ini'
    )
    text, reward, info = send(env, command)
    assert reward == 1.0 and info["success"], text


def test_config_edit_rejects_an_extra_line(env: Any) -> None:
    env.reset(options={"task": {"kind": "config-edit", "seed": 3}})
    text, reward, info = send(
        env, "sed -i 's/^debug = true$/debug = false/' app.ini && echo 'extra = 1' >> app.ini"
    )
    assert reward == 0.0 and not info["success"], text


def test_json_active_with_no_active_user_needs_the_file_written(env: Any) -> None:
    """Seed 48 has no active user: the expected file is empty, but it must exist."""
    task = {"kind": "json-active", "seed": 48}
    env.reset(options={"task": task})
    text, reward, info = send(env, "ls")
    assert reward == 0.0 and not info["success"], text
    env.reset(options={"task": task})
    assert solve_with_expert(env) == (1.0, True)


def test_fix_script_does_not_accept_the_instruction_example_hardcoded(env: Any) -> None:
    env.reset(options={"task": {"kind": "fix-script", "seed": 5}})
    example = re.search(r"should print (\d+)", env.unwrapped.task["instruction"])
    assert example, env.unwrapped.task["instruction"]
    text, reward, info = send(env, f"printf 'print({example.group(1)})\\n' > fix.py")
    assert reward == 0.0 and not info["success"], text


def test_the_session_cannot_change_how_the_checker_runs(env: Any) -> None:
    """Aliases, functions, PATH entries and rc files of the agent's shell do not reach the
    checker: it is a fresh ``bash -c`` with the sandbox's fixed environment."""
    env.reset(options={"task": {"kind": "count-errors", "seed": 1}})
    planted = (
        "printf 'exit 0\\n' | tee .bashrc .profile .bash_profile .bash_login rc.sh >/dev/null; "
        "export BASH_ENV=$PWD/rc.sh ENV=$PWD/rc.sh; mkdir -p bin; "
        "for t in tr test cat; do printf '#!/bin/sh\\nexit 0\\n' > bin/$t; chmod +x bin/$t; done; "
        "export PATH=$PWD/bin:$PATH; alias test=true; test() { return 0; }; export -f test; "
        "echo 0 > answer.txt"
    )
    text, reward, info = send(env, planted)
    assert reward == 0.0 and not info["success"], text


FIFOS = {
    "count-errors": "rm -f answer.txt; mkfifo answer.txt",
    "csv-total": "rm -f total.txt; mkfifo total.txt",
    "dedupe": "rm -f unique.txt; mkfifo unique.txt",
    "json-active": "rm -f active.txt; mkfifo active.txt",
    "config-edit": "rm -f app.ini; mkfifo app.ini",
    "fix-script": "rm -f fix.py; mkfifo fix.py",
    "rename-ext": 'for f in notes/*.txt; do m="${f%.txt}.md"; rm "$f"; mkfifo "$m"; done',
}


@pytest.mark.parametrize("kind, plant", FIFOS.items(), ids=list(FIFOS))
def test_a_fifo_at_a_checked_path_fails_the_check_without_blocking_it(
    env: Any, kind: str, plant: str
) -> None:
    """A FIFO where the checker reads would block the check until the command timeout on
    every turn; the checker must see it is not a regular file and fail at once."""
    env.reset(options={"task": {"kind": kind, "seed": 2}})
    sandbox = env.unwrapped._sandbox
    assert sandbox.run(["bash", "-c", plant]).exit_code == 0
    result = sandbox.run(["bash", "-c", env.unwrapped.task["check"]], timeout=CHECK_TIMEOUT_S)
    assert not result.timed_out and result.exit_code != 0, result.describe()


def test_a_lone_surrogate_in_the_action_is_an_invalid_action_not_an_exception(env: Any) -> None:
    """``"\\udcff"`` is a legal Python str (e.g. from JSON) that has no UTF-8 encoding."""
    env.reset(options={"task": {"kind": "count-errors", "seed": 0}})
    observation, reward, terminated, _, info = env.step("```bash\necho '\udcff'\n```")
    text = observation[0]["content"]
    assert info["invalid_action"] and reward < 0 and not terminated
    assert "not valid" in text and "\\udcff" in text, text
    assert send(env, "echo still here")[0].startswith("still here")
