"""Answer questions by querying a small SQLite database: ``tools/sql-v0``.

Each task has its own company database (departments, employees, projects, assignments)
generated from the task's seed, so the answer cannot be memorised: the model must look at
the schema (``list_tables``, ``describe_table``) and query it (``run_sql``). The oracle
runs the gold query and answers with its result. Every built-in question has one right
answer: a draw that would have two (a tie at the top of a ranking) or none (an average over
an empty department) is replaced by the draw of a seed derived from the task's. The answer is
graded as a number (``$96,859``) or a name (``Sales department``) by ``envs.tools.answers``;
naming two candidates scores 0.

Queries run read-only: an authorizer allows only reads (SELECT, column reads, functions and
the schema PRAGMAs such as ``table_info``) and refuses writes, DDL, transactions, ``ATTACH``
and every other PRAGMA, so ``PRAGMA query_only = OFF`` cannot lift it. They are aborted after
a fixed number of SQLite VM steps (so a cross join of cross joins cannot hang the env), may
not make or read a value over ``MAX_VALUE_BYTES`` nor return over ``MAX_RESULT_BYTES``, and
return at most ``max_rows`` rows. Not covered: a sort or temporary b-tree of many large rows
may spill to SQLite's temporary files before the step budget stops it.

A user dataset is JSONL of ``{"question", "answer"}`` plus either ``"database"`` (a path to
a SQLite file, opened read-only) or nothing (the generated database of the task's seed);
``"sql"`` (the gold query) lets the oracle solve it.
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any, ClassVar

import numpy as np

from envhub.core import function_tool
from envhub.parsing import format_tool_call
from envs.datasets import Task, stable_hash
from envs.tools.answers import name_matches, number, number_matches
from envs.tools.base import ToolEnv, ToolError

__all__ = ["QUESTIONS", "SqlEnv", "build_company_db"]

MAX_VM_STEPS = 2_000_000
_FIRST = [
    "Ada",
    "Bram",
    "Cleo",
    "Dov",
    "Edda",
    "Finn",
    "Gia",
    "Hugo",
    "Ines",
    "Jora",
    "Kai",
    "Lior",
    "Mira",
    "Nils",
    "Oona",
    "Pax",
    "Quin",
    "Rhea",
    "Sami",
    "Tove",
]
_LAST = [
    "Arkwright",
    "Bellamy",
    "Castell",
    "Drummond",
    "Everly",
    "Fairweather",
    "Galloway",
    "Hartnell",
    "Ivers",
    "Jessop",
    "Kettering",
    "Lowther",
]
_DEPARTMENTS = [
    "Research",
    "Sales",
    "Support",
    "Finance",
    "Legal",
    "Design",
    "Operations",
    "Marketing",
]
_CITIES = ["Lisbon", "Oslo", "Tallinn", "Porto", "Ghent", "Turku", "Bergen", "Krakow"]
_PROJECTS = [
    "Apollo",
    "Borealis",
    "Cobalt",
    "Dynamo",
    "Ember",
    "Fjord",
    "Granite",
    "Helix",
    "Iris",
    "Juniper",
    "Kestrel",
    "Lumen",
]

QUESTIONS: list[tuple[str, str]] = [
    (
        "Which department has the highest total salary bill? Answer with the department name.",
        (
            "SELECT d.name FROM departments d JOIN employees e ON e.dept_id = d.id "
            "GROUP BY d.id ORDER BY SUM(e.salary) DESC LIMIT 1"
        ),
    ),
    (
        "How many employees hired after {year} work in departments located in {city}?",
        (
            "SELECT COUNT(*) FROM employees e JOIN departments d ON e.dept_id = d.id "
            "WHERE e.hired_year > {year} AND d.city = '{city}'"
        ),
    ),
    (
        "Who logged the most hours on project {project}? Answer with the employee's full name.",
        (
            "SELECT e.name FROM assignments a JOIN employees e ON a.employee_id = e.id "
            "JOIN projects p ON a.project_id = p.id "
            "WHERE p.name = '{project}' ORDER BY a.hours DESC LIMIT 1"
        ),
    ),
    (
        (
            "What is the average salary in the {department} department, "
            "rounded to the nearest whole number?"
        ),
        (
            "SELECT CAST(ROUND(AVG(e.salary)) AS INTEGER) FROM employees e "
            "JOIN departments d ON e.dept_id = d.id WHERE d.name = '{department}'"
        ),
    ),
    (
        "Which project has the largest budget per assigned employee? Answer with the project name.",
        (
            "SELECT p.name FROM projects p JOIN assignments a ON a.project_id = p.id GROUP BY p.id "
            "ORDER BY p.budget * 1.0 / COUNT(DISTINCT a.employee_id) DESC LIMIT 1"
        ),
    ),
]


_TOP_TWO: dict[int, str] = {
    0: (
        "SELECT SUM(e.salary) FROM departments d JOIN employees e ON e.dept_id = d.id "
        "GROUP BY d.id ORDER BY 1 DESC LIMIT 2"
    ),
    2: (
        "SELECT a.hours FROM assignments a JOIN projects p ON a.project_id = p.id "
        "WHERE p.name = '{project}' ORDER BY 1 DESC LIMIT 2"
    ),
    4: (
        "SELECT p.budget * 1.0 / COUNT(DISTINCT a.employee_id) FROM projects p "
        "JOIN assignments a ON a.project_id = p.id GROUP BY p.id ORDER BY 1 DESC LIMIT 2"
    ),
}
"""For each question that asks for the top of a ranking (by its index in ``QUESTIONS``), the
two best values it ranks by: equal, the question has two right answers and is drawn again."""
MAX_DRAWS = 50
"""How many databases a built-in task may draw before one gives its question a single answer
(a few tasks in a thousand need a second)."""


def build_company_db(seed: int) -> sqlite3.Connection:
    """An in-memory company database drawn from ``seed`` (same seed, same rows)."""
    rng = np.random.default_rng(seed)
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript(
        """
        CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
        CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL,
                                dept_id INTEGER REFERENCES departments(id),
                                salary INTEGER NOT NULL, hired_year INTEGER NOT NULL);
        CREATE TABLE projects (id INTEGER PRIMARY KEY, name TEXT NOT NULL,
                               dept_id INTEGER REFERENCES departments(id),
                               budget INTEGER NOT NULL);
        CREATE TABLE assignments (employee_id INTEGER REFERENCES employees(id),
                                  project_id INTEGER REFERENCES projects(id),
                                  hours INTEGER NOT NULL, PRIMARY KEY (employee_id, project_id));
        """
    )
    departments = rng.permutation(_DEPARTMENTS)[: int(rng.integers(4, 7))]
    for i, name in enumerate(departments, 1):
        db.execute(
            "INSERT INTO departments VALUES (?, ?, ?)", (i, str(name), str(rng.choice(_CITIES[:4])))
        )
    everyone = rng.permutation([f"{f} {l}" for f in _FIRST for l in _LAST])
    names = everyone[: int(rng.integers(25, 45))]
    for i, name in enumerate(names, 1):
        db.execute(
            "INSERT INTO employees VALUES (?, ?, ?, ?, ?)",
            (
                i,
                str(name),
                int(rng.integers(1, len(departments) + 1)),
                int(rng.integers(40, 160)) * 1_000 + int(rng.integers(0, 999)),
                int(rng.integers(2008, 2025)),
            ),
        )
    projects = rng.permutation(_PROJECTS)[: int(rng.integers(5, 9))]
    for i, name in enumerate(projects, 1):
        db.execute(
            "INSERT INTO projects VALUES (?, ?, ?, ?)",
            (
                i,
                str(name),
                int(rng.integers(1, len(departments) + 1)),
                int(rng.integers(20, 900)) * 1_000 + int(rng.integers(0, 999)),
            ),
        )
    for employee in range(1, len(names) + 1):
        for project in rng.choice(
            np.arange(1, len(projects) + 1), size=int(rng.integers(1, 3)), replace=False
        ):
            db.execute(
                "INSERT INTO assignments VALUES (?, ?, ?)",
                (employee, int(project), int(rng.integers(5, 400))),
            )
    db.commit()
    return db


_READ_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
_READ_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list"}
)
"""PRAGMAs that only describe the schema, whatever their argument; every other one is refused."""
MAX_VALUE_BYTES = 1_000_000
"""The longest string or blob a query may make or read (``randomblob(4e8)`` is refused)."""
MAX_RESULT_BYTES = 2_000_000
"""How much text and blob data one query may return before it is refused."""
_LIMITS = {
    sqlite3.SQLITE_LIMIT_LENGTH: MAX_VALUE_BYTES,
    sqlite3.SQLITE_LIMIT_SQL_LENGTH: 100_000,
    sqlite3.SQLITE_LIMIT_COLUMN: 100,
    sqlite3.SQLITE_LIMIT_EXPR_DEPTH: 100,
    sqlite3.SQLITE_LIMIT_COMPOUND_SELECT: 50,
    sqlite3.SQLITE_LIMIT_ATTACHED: 0,
}


def _authorize(action: int, arg1: str | None, *_: Any) -> int:
    """Allow reads only: SELECT, reading columns, functions, recursive CTEs and the schema
    PRAGMAs; deny writes, DDL, transactions, ATTACH and every other PRAGMA (``query_only``)."""
    if action in _READ_ACTIONS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _READ_PRAGMAS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _readonly(db: sqlite3.Connection) -> sqlite3.Connection:
    """``db`` made read-only for the model (an allow-list authorizer, not only the
    ``query_only`` PRAGMA it could switch off) and bounded in value size and query shape."""
    db.execute("PRAGMA query_only = ON")
    for limit, value in _LIMITS.items():
        db.setlimit(limit, value)
    db.set_authorizer(_authorize)
    return db


def _quote(identifier: str) -> str:
    """``identifier`` as a quoted SQL name (``a"b`` -> ``"a""b"``)."""
    return '"' + identifier.replace('"', '""') + '"'


def _cell_bytes(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 8


class SqlEnv(ToolEnv):
    """Questions about a generated company database, answered with SQL tools."""

    tool_schemas: ClassVar[list[dict[str, Any]]] = [
        function_tool(
            "list_tables", "List the tables of the database.", {"type": "object", "properties": {}}
        ),
        function_tool(
            "describe_table",
            "Show a table's columns (name and type) and its first three rows.",
            {"type": "object", "properties": {"table": {"type": "string"}}, "required": ["table"]},
        ),
        function_tool(
            "run_sql",
            "Run one read-only SQLite query and return the rows (at most 50).",
            {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        ),
    ]
    required_fields = ("question", "answer")
    generated_fields = ("template",)
    intro = "Answer the question about the company database by querying it with SQL."

    def __init__(self, *, num_builtin: int = 200, max_rows: int = 50, **options: Any) -> None:
        self.num_builtin = num_builtin
        self.max_rows = max_rows
        self._db: sqlite3.Connection | None = None
        self._answers: frozenset[str] | None = None
        """The non-numeric answers of the task set (rivals of a name answer), read once."""
        super().__init__(**options)

    # ------------------------------------------------------------------ tasks
    def builtin_tasks(self) -> list[Task]:
        return [
            {"id": f"sql-{i:04d}", "template": i % len(QUESTIONS), "seed": 20_000 + i}
            for i in range(self.num_builtin)
        ]

    def _database(self) -> sqlite3.Connection:
        if self._db is None:
            path = self.task.get("database")
            if path:
                try:
                    self._db = sqlite3.connect(
                        f"file:{path}?mode=ro", uri=True, check_same_thread=False
                    )
                except sqlite3.Error as exc:
                    raise ToolError(f"cannot open database {path!r}: {exc}") from None
            else:
                seed = self.task["database_seed" if "database_seed" in self.task else "seed"]
                self._db = build_company_db(int(seed))
            _readonly(self._db)
        return self._db

    def _query(
        self, sql: str, max_rows: int | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Column names and up to ``max_rows + 1`` rows (default ``self.max_rows``) of ``sql``,
        run within the step and size budgets; every failure is a ``ToolError``."""
        limit = self.max_rows if max_rows is None else max_rows
        db = self._database()
        steps = [0]

        def progress() -> int:
            steps[0] += 1
            return 1 if steps[0] * 1_000 > MAX_VM_STEPS else 0

        db.set_progress_handler(progress, 1_000)
        try:
            cursor = db.execute(sql)
            rows, size = [], 0
            for row in cursor:  # one row at a time, so the size bound holds while fetching
                rows.append(row)
                size += sum(_cell_bytes(value) for value in row)
                if size > MAX_RESULT_BYTES:
                    raise ToolError(
                        f"the result is larger than {MAX_RESULT_BYTES:,} bytes; select fewer "
                        "rows or shorter values (substr, length)"
                    )
                if len(rows) > limit:
                    break
        except sqlite3.OperationalError as exc:
            if "interrupted" in str(exc):
                raise ToolError(
                    f"query aborted after {MAX_VM_STEPS:,} steps; add a WHERE clause or a LIMIT"
                ) from None
            raise ToolError(f"SQL error: {exc}") from None
        except (sqlite3.Error, sqlite3.Warning, ValueError) as exc:
            raise ToolError(f"SQL error: {exc}") from None
        finally:
            db.set_progress_handler(None, 1_000)
        columns = [c[0] for c in cursor.description or []]
        return columns, rows

    def start(self, task: Task) -> str:
        """The question: the task's own, or one drawn from ``QUESTIONS`` with the database of
        the task's seed. A draw whose question has no single answer (two rows tied at the top
        of a ranking, an average over an empty department) is replaced by the draw of a seed
        derived from the task's (``database_seed``), so a seed still gives one task."""
        self._close_database()
        if "question" in task:
            return str(task["question"])
        seed = int(task["seed"])
        for attempt in range(MAX_DRAWS):
            drawn = seed if attempt == 0 else stable_hash("sql-redraw", seed, attempt) % 2**31
            self.task["database_seed"] = drawn
            question = self._draw(self._database(), int(task["template"]), drawn)
            if question is not None:
                if drawn == seed:
                    del self.task["database_seed"]  # the task's own seed: nothing to record
                return question
            self._close_database()
        raise RuntimeError(
            f"no database of {MAX_DRAWS} drawn for task {task['id']!r} gives its "
            "question a single answer"
        )

    def _draw(self, db: sqlite3.Connection, template: int, seed: int) -> str | None:
        """Question ``template`` filled in from ``seed`` for ``db``, its gold query and answer
        stored in the task; None when the question has no single answer in ``db``."""
        rng = np.random.default_rng(seed)
        text, gold = QUESTIONS[template]
        fill = {
            "year": int(rng.integers(2010, 2020)),
            "city": str(
                rng.choice(
                    [
                        row[0]
                        for row in db.execute("SELECT DISTINCT city FROM departments ORDER BY city")
                    ]
                )
            ),
            "project": str(
                rng.choice([row[0] for row in db.execute("SELECT name FROM projects ORDER BY id")])
            ),
            "department": str(
                rng.choice(
                    [row[0] for row in db.execute("SELECT name FROM departments ORDER BY id")]
                )
            ),
        }
        sql = gold.format(**fill)
        row = db.execute(sql).fetchone()
        if row is None or row[0] is None:  # no rows, or an average over none
            return None
        if template in _TOP_TWO:
            best = [value for (value,) in db.execute(_TOP_TWO[template].format(**fill))]
            if len(best) == 2 and best[0] == best[1]:
                return None
        self.task["sql"], self.task["answer"] = sql, str(row[0])
        return text.format(**fill)

    # ------------------------------------------------------------------ tools
    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name == "list_tables":
            _, rows = self._query(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
            return ", ".join(row[0] for row in rows)
        if name == "describe_table":
            table = arguments["table"]
            _, tables = self._query("SELECT name FROM sqlite_master WHERE type = 'table'")
            if table not in {row[0] for row in tables}:
                raise ToolError(f"no table named {table!r}; call list_tables to see them")
            _, info = self._query(f"PRAGMA table_info({_quote(table)})", max_rows=10_000)
            _, rows = self._query(f"SELECT * FROM {_quote(table)} LIMIT 3")
            lines = [f"{table}(" + ", ".join(f"{c[1]} {c[2]}" for c in info) + ")"]
            lines += [" | ".join(map(str, row)) for row in rows]
            return "\n".join(lines)
        columns, rows = self._query(arguments["query"])
        more = len(rows) > self.max_rows
        lines = [" | ".join(columns)] + [" | ".join(map(str, row)) for row in rows[: self.max_rows]]
        if more:
            lines.append(f"... (more rows; only the first {self.max_rows} are shown)")
        return "\n".join(lines) if rows else " | ".join(columns) + "\n(no rows)"

    def grade(self, answer: str) -> float:
        """1.0 for the expected answer in any common form (``envs.tools.answers``): a number
        as the answer's one value besides those the question states (``$96,859``, ``96859
        dollars``), a name as whole words with no rival (``**Sales**``, ``Sales department``);
        0.0 for an answer that names two candidates (``Sales or Research``)."""
        expected = str(self.task["answer"])
        target = number(expected)
        if target is not None:
            return 1.0 if number_matches(answer, target, stated=self.question) else 0.0
        return 1.0 if name_matches(answer, expected, self._rivals(expected)) else 0.0

    def _rivals(self, expected: str) -> set[str]:
        """What a hedge would list beside ``expected``: the other values of each text column
        that holds it (every department for a department, every employee for an employee)
        and the other answers of the task set. Queries run within the usual budgets; a
        column too big to read adds nothing."""
        if self._answers is None:
            answers = {str(task["answer"]) for task in self.tasks if "answer" in task}
            self._answers = frozenset(a for a in answers if number(a) is None)
        rivals = set(self._answers)
        literal = "'" + expected.strip().lower().replace("'", "''") + "'"
        with contextlib.suppress(ToolError):
            _, tables = self._query("SELECT name FROM sqlite_master WHERE type = 'table'")
            for (table,) in tables:
                _, info = self._query(f"PRAGMA table_info({_quote(table)})", max_rows=10_000)
                for column in (_quote(row[1]) for row in info):
                    with contextlib.suppress(ToolError):
                        where = f"FROM {_quote(table)} WHERE typeof({column}) = 'text'"
                        _, hit = self._query(
                            f"SELECT 1 {where} AND lower({column}) = {literal} LIMIT 1"
                        )
                        if hit:
                            _, values = self._query(
                                f"SELECT DISTINCT {column} {where}", max_rows=10_000
                            )
                            rivals.update(str(value) for (value,) in values)
        return rivals

    def plan(self) -> list[str]:
        if "sql" not in self.task:
            return [f"<answer>{self.task['answer']}</answer>"]
        return [
            format_tool_call("list_tables"),
            format_tool_call("describe_table", {"table": "employees"}),
            format_tool_call("run_sql", {"query": self.task["sql"]}),
            f"<answer>{self.task['answer']}</answer>",
        ]

    def random_call(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        if roll < 0.3:
            return format_tool_call("list_tables")
        table = str(
            np_random.choice(["employees", "departments", "projects", "assignments", "staff"])
        )
        if roll < 0.6:
            return format_tool_call("describe_table", {"table": table})
        return format_tool_call(
            "run_sql", {"query": f"SELECT * FROM {table} LIMIT {int(np_random.integers(1, 5))}"}
        )

    # ------------------------------------------------------------------ lifecycle
    def on_close(self) -> None:
        self._close_database()

    def _close_database(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_db"] = None  # rebuilt from the task's seed (or file) on first use
        return state
