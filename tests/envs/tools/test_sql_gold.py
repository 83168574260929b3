"""Every built-in SQL question has exactly one right answer: no tie at the top of a "which ...
has the most" question, no average over an empty department (a gold answer of ``None``)."""

from __future__ import annotations

from envs.tools.sql import SqlEnv

TOP_TWO = {
    "Which department has the highest total salary bill?": (
        "SELECT SUM(e.salary) FROM departments d JOIN employees e ON e.dept_id = d.id "
        "GROUP BY d.id ORDER BY 1 DESC LIMIT 2"
    ),
    "Who logged the most hours on project": (
        "SELECT a.hours FROM assignments a JOIN projects p ON a.project_id = p.id "
        "WHERE p.name = '{}' ORDER BY 1 DESC LIMIT 2"
    ),
    "Which project has the largest budget per assigned employee?": (
        "SELECT p.budget * 1.0 / COUNT(DISTINCT a.employee_id) FROM projects p "
        "JOIN assignments a ON a.project_id = p.id GROUP BY p.id ORDER BY 1 DESC LIMIT 2"
    ),
}


def top_two(env: SqlEnv, question: str) -> list[float]:
    """The two best values of what a ranking question ranks by, as the model would query them."""
    for opening, query in TOP_TWO.items():
        if question.startswith(opening):
            project = question.removeprefix(opening).split("?")[0].strip()
            rows = env.call_tool("run_sql", {"query": query.format(project)}).splitlines()[1:]
            return [float(row) for row in rows]
    return []


def test_no_gold_answer_of_2000_tasks_is_tied_or_none():
    env = SqlEnv(num_builtin=2000)
    tied, empty = [], []
    for index in range(2000):
        messages, _ = env.reset(options={"task_index": index})
        question = messages[-1]["content"]
        if str(env.task["answer"]) in ("None", ""):
            empty.append(env.task["id"])
        best = top_two(env, question)
        if len(best) == 2 and best[0] == best[1]:
            tied.append(env.task["id"])
    assert (tied, empty) == ([], [])
