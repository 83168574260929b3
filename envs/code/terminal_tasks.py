"""The built-in tasks of ``code/terminal-v0``: files to start from, a goal, a checker, a solution.

Each task is generated from a seed (file contents and expected values vary), so a policy
has to look at the files rather than memorise answers. A task is a dict::

    {"kind", "instruction", "files": {path: text}, "check": "<bash script: exit 0 when done>",
     "solution": ["command", ...]}

User datasets use the same fields (``solution`` optional).

What the built-in checkers guard against (``tests/envs/code/test_terminal_integrity.py``
attacks each):

- **Outputs that only look done.** A file the task asks for is compared whole, byte for
  byte (only its final newline may be missing), so deleting the lines a checker used to
  skip, or creating empty files in place of renamed ones, fails. ``fix-script`` runs the
  fixed program on inputs drawn when the check runs (``$RANDOM``), so a program that prints
  a memorised answer, or is right only for the instruction's example, fails.
- **Non-regular files.** Every path is tested with ``test -f`` before it is read, so a FIFO
  (or a device, or a directory) there fails the check at once instead of blocking it until
  the command timeout on every turn. A background process that swaps a file for a FIFO
  between that test and the read can still stall a check; it only delays its own failure.
- **The agent's shell.** Checkers run as a fresh ``bash -c`` with the sandbox's fixed
  environment, not in the session, so its aliases, functions, ``PATH`` and rc files do not
  reach them; the system directories on ``PATH`` are read-only.

- **Reading the expected values.** A checker's script reaches its sandbox on stdin, is read
  into the checker shell's memory and stdin is then ``/dev/null`` (``terminal.py``,
  ``_CHECK_FROM_STDIN``): it is in no command line, environment or open file, so a watcher the
  agent leaves in its session finds nothing in ``/proc``; nor could it read the checker's
  memory: the local backend runs the session in a PID namespace of its own, docker runs it as
  another uid (``tests/sandboxes/test_checker_secrets.py``).

Not covered: a program the check itself runs (``fix-script`` runs the agent's ``fix.py``) has
the checker's uid and could read the checker shell's memory through ``/proc/PPID/mem``, so a
check that runs the agent's code must not hold a secret it compares against: compute the
expected value after the program ran, as ``fix-script`` does. On e2b, a process of the VM
(any the agent left running, with the template's sudo) can read anything in it.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import numpy as np

__all__ = ["TERMINAL_KINDS", "make_terminal_task"]

TERMINAL_KINDS = (
    "count-errors",
    "csv-total",
    "rename-ext",
    "fix-script",
    "config-edit",
    "dedupe",
    "json-active",
    "make-tree",
)
_WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "fable", "gamma", "harbor", "iris", "jade"]


def _regular(path: str) -> str:
    """Bash: ``path`` is a regular file (a FIFO there would block the read that follows)."""
    return f"test -f {shlex.quote(path)}"


def _number_check(path: str, value: int) -> str:
    """Bash, exit 0 when ``path`` holds just ``value`` (whitespace around it ignored)."""
    quoted = shlex.quote(path)
    return f'{_regular(path)} && test "$(tr -d "[:space:]" < {quoted})" = "{value}"'


def _text_check(path: str, text: str) -> str:
    """Bash, exit 0 when ``path`` holds exactly ``text``, with or without its final newline.

    ``cmp`` compares bytes, so NUL bytes or trailing blank lines are differences too (a
    ``$(cat ...)`` comparison would drop both).
    """
    quoted, body = shlex.quote(path), shlex.quote(text.rstrip("\n"))
    return (
        f'{_regular(path)} && t={body} && {{ printf %s "$t" | cmp -s - {quoted} || '
        f"printf '%s\\n' \"$t\" | cmp -s - {quoted}; }}"
    )


_FIX_BUGS = {
    "range(1, n)": "the last number is left out",
    "range(2, n + 1)": "the first number is left out",
}
"""fix-script's bugs: the loop's wrong ``range`` -> what it gets wrong (the fix is always
``range(1, n + 1)``)."""


def make_terminal_task(kind: str, seed: int) -> dict[str, Any]:
    """Task ``kind`` with its files and expected results drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    if kind == "count-errors":
        levels = rng.choice(
            ["INFO", "WARN", "ERROR", "DEBUG"],
            size=int(rng.integers(30, 80)),
            p=[0.5, 0.2, 0.2, 0.1],
        )
        lines = [
            f"2026-11-{int(rng.integers(1, 29)):02d} {lvl} {rng.choice(_WORDS)!s} service event {i}"
            for i, lvl in enumerate(levels)
        ]
        count = int(sum(level == "ERROR" for level in levels))
        return {
            "kind": kind,
            "instruction": (
                "Count the lines of logs/app.log that contain ERROR "
                "and write just that number to answer.txt."
            ),
            "files": {"logs/app.log": "\n".join(lines) + "\n"},
            "check": _number_check("answer.txt", count),
            "solution": ["grep -c ERROR logs/app.log > answer.txt"],
        }
    if kind == "csv-total":
        rows = [
            (str(rng.choice(_WORDS)), int(rng.integers(1, 500)))
            for _ in range(int(rng.integers(8, 25)))
        ]
        total = sum(amount for _, amount in rows)
        csv = "name,amount\n" + "".join(f"{name},{amount}\n" for name, amount in rows)
        return {
            "kind": kind,
            "instruction": (
                "sales.csv has a header and an amount column. "
                "Write the sum of the amount column to total.txt."
            ),
            "files": {"sales.csv": csv},
            "check": _number_check("total.txt", total),
            "solution": [
                "head -3 sales.csv",
                "awk -F, 'NR>1{s+=$2} END{print s}' sales.csv > total.txt",
            ],
        }
    if kind == "rename-ext":
        names = sorted({str(w) for w in rng.choice(_WORDS, size=int(rng.integers(3, 7)))})
        files = {f"notes/{n}.txt": f"{n}\n" for n in names}
        moved = " && ".join(_text_check(f"notes/{n}.md", f"{n}\n") for n in names)
        return {
            "kind": kind,
            "instruction": (
                "Rename every .txt file in notes/ to the same name with the .md extension."
            ),
            "files": files,
            "check": f"! compgen -G 'notes/*.txt' >/dev/null && {moved}",
            "solution": ['for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done'],
        }
    if kind == "fix-script":
        n = int(rng.integers(5, 20))
        bug = str(rng.choice(sorted(_FIX_BUGS)))
        script = (
            "import sys\n\nn = int(sys.argv[1])\ntotal = 0\n"
            f"for i in {bug}:\n    total += i\nprint(total)\n"
        )
        # 1, the example and two inputs drawn anew by every check, so no answer can be
        # memorised; the expected sum is computed after the program ran, never passed to it.
        inputs = f"1 {n} $((RANDOM % 30000 + 100)) $((RANDOM % 30000 + 100))"
        return {
            "kind": kind,
            "instruction": (
                "fix.py should print the sum of the whole numbers from 1 to N inclusive, "
                f"for the N given as its argument (`python3 fix.py {n}` should print "
                f"{n * (n + 1) // 2}), but {_FIX_BUGS[bug]}. Fix fix.py."
            ),
            "files": {"fix.py": script},
            "check": (
                f"{_regular('fix.py')} && for k in {inputs}; do "
                'test "$(python3 -I fix.py "$k" 2>/dev/null)" = "$((k * (k + 1) / 2))" '
                "|| exit 1; done"
            ),
            "solution": [
                f"sed -i 's/for i in {bug}:/for i in range(1, n + 1):/' fix.py",
                f"python3 fix.py {n}",
            ],
        }
    if kind == "config-edit":
        port = int(rng.integers(2000, 9000))
        config = (
            f"[server]\nhost = 127.0.0.1\nport = {port}\ndebug = true\n\n"
            f"[cache]\nsize = {int(rng.integers(10, 99))}\n"
        )
        return {
            "kind": kind,
            "instruction": "In app.ini set debug to false, leaving every other line unchanged.",
            "files": {"app.ini": config},
            "check": _text_check("app.ini", config.replace("debug = true", "debug = false")),
            "solution": ["sed -i 's/^debug = true$/debug = false/' app.ini"],
        }
    if kind == "dedupe":
        emails = [
            f"{rng.choice(_WORDS)!s}{int(rng.integers(1, 6))}@example.org"
            for _ in range(int(rng.integers(15, 40)))
        ]
        unique = sorted(set(emails))
        return {
            "kind": kind,
            "instruction": (
                "emails.txt has duplicates. "
                "Write the distinct addresses, sorted, one per line, to unique.txt."
            ),
            "files": {"emails.txt": "\n".join(emails) + "\n"},
            "check": _text_check("unique.txt", "".join(f"{e}\n" for e in unique)),
            "solution": ["sort -u emails.txt > unique.txt"],
        }
    if kind == "json-active":
        users = [
            {
                "name": f"{str(rng.choice(_WORDS)).capitalize()}{i}",
                "active": bool(rng.random() < 0.5),
            }
            for i in range(int(rng.integers(5, 12)))
        ]
        active = sorted(str(u["name"]) for u in users if u["active"])
        return {
            "kind": kind,
            "instruction": (
                "users.json is a list of users with name and active fields. "
                "Write the names of the active users, sorted, one per line, to active.txt."
            ),
            "files": {"users.json": json.dumps(users, indent=1)},
            "check": _text_check("active.txt", "".join(f"{a}\n" for a in active)),
            "solution": [
                (
                    "python3 -c \"import json; print('\\n'.join(sorted(u['name'] for u in "
                    "json.load(open('users.json')) if u['active'])))\" > active.txt"
                )
            ],
        }
    if kind == "make-tree":
        name = str(rng.choice(_WORDS))
        return {
            "kind": kind,
            "instruction": (
                f"Create a project skeleton: directories {name}/src and {name}/tests, "
                f"and an empty file {name}/README.md."
            ),
            "files": {},
            # real directories: a symlink to some other directory is not creating one
            "check": (
                f"for d in {name} {name}/src {name}/tests; do "
                'test -d "$d" && test ! -L "$d" || exit 1; done && '
                f"test -f {name}/README.md && test ! -s {name}/README.md"
            ),
            "solution": [f"mkdir -p {name}/src {name}/tests && touch {name}/README.md"],
        }
    raise ValueError(f"unknown terminal task kind {kind!r}; use one of {TERMINAL_KINDS}")
