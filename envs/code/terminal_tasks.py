"""The built-in tasks of ``code/terminal-v0``: files to start from, a goal, a checker, a solution.

Each task is generated from a seed (file contents and expected values vary), so a policy
has to look at the files rather than memorise answers. A task is a dict::

    {"kind", "instruction", "files": {path: text}, "check": "<bash script: exit 0 when done>",
     "solution": ["command", ...]}

User datasets use the same fields (``solution`` optional).
"""

from __future__ import annotations

import json
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
            "check": f'test "$(tr -d "[:space:]" < answer.txt)" = "{count}"',
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
            "check": f'test "$(tr -d "[:space:]" < total.txt)" = "{total}"',
            "solution": [
                "head -3 sales.csv",
                "awk -F, 'NR>1{s+=$2} END{print s}' sales.csv > total.txt",
            ],
        }
    if kind == "rename-ext":
        names = sorted({str(w) for w in rng.choice(_WORDS, size=int(rng.integers(3, 7)))})
        files = {f"notes/{n}.txt": f"{n}\n" for n in names}
        expected = " ".join(f"notes/{n}.md" for n in names)
        return {
            "kind": kind,
            "instruction": (
                "Rename every .txt file in notes/ to the same name with the .md extension."
            ),
            "files": files,
            "check": (
                'test -z "$(ls notes/*.txt 2>/dev/null)" && '
                f'for f in {expected}; do test -f "$f" || exit 1; done'
            ),
            "solution": ['for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done'],
        }
    if kind == "fix-script":
        n = int(rng.integers(5, 20))
        script = (
            f"total = 0\nfor i in range(1, {n}):\n    total += i\n"
            f"print('OK' if total == {n * (n + 1) // 2} else 'WRONG', total)\n"
        )
        return {
            "kind": kind,
            "instruction": (
                f"fix.py should add the numbers 1 to {n} inclusive and print OK, "
                "but it prints WRONG. Fix fix.py."
            ),
            "files": {"fix.py": script},
            "check": 'python3 fix.py | grep -q "^OK"',
            "solution": [f"sed -i 's/range(1, {n})/range(1, {n + 1})/' fix.py", "python3 fix.py"],
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
            "check": (
                'grep -qx "debug = false" app.ini && ! grep -q "debug = true" app.ini && '
                f'grep -qx "port = {port}" app.ini && '
                f"test $(wc -l < app.ini) -eq {config.count(chr(10))}"
            ),
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
            "check": f'test "$(cat unique.txt)" = "{chr(10).join(unique)}"',
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
        active = sorted(u["name"] for u in users if u["active"])
        return {
            "kind": kind,
            "instruction": (
                "users.json is a list of users with name and active fields. "
                "Write the names of the active users, sorted, one per line, to active.txt."
            ),
            "files": {"users.json": json.dumps(users, indent=1)},
            "check": f'test "$(cat active.txt)" = "{chr(10).join(active)}"',
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
            "check": (
                f"test -d {name}/src && test -d {name}/tests && "
                f"test -f {name}/README.md && test ! -s {name}/README.md"
            ),
            "solution": [f"mkdir -p {name}/src {name}/tests && touch {name}/README.md"],
        }
    raise ValueError(f"unknown terminal task kind {kind!r}; use one of {TERMINAL_KINDS}")
