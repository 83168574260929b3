"""Graders take a right answer in the forms models write it (markdown, ``\\boxed{}``, a currency
sign, thousands commas, a short sentence) and still give nothing to an answer that lists several
candidates; the calculator reads commas in a call as argument separators."""

from __future__ import annotations

import pytest

import envhub
from envs.tools.calculator import safe_eval


@pytest.mark.parametrize(
    "expression, value",
    [
        ("max(2,500,3)", 500),  # not max(2500, 3)
        ("min(12,345)", 12),  # not min(12345), which failed
        ("1,234 + 1", 1235),  # a top-level comma can only be a thousands separator
        ("1,234 * max(2,500,3)", 617_000),
        ("(1,234 + 1) * 2", 2470),
        ("sqrt(1,000,000)", 1000),  # as arguments this is not Python (``000``)
        ("round(1,234.5678, 2)", 1234.57),  # three arguments to round cannot be meant
    ],
)
def test_calculator_reads_commas_in_a_call_as_argument_separators(expression, value):
    assert safe_eval(expression) == value


def test_the_calculate_tool_answers_max_with_unspaced_arguments():
    env = envhub.make("tools/calculator-v0")
    env.reset(seed=0)
    messages, *_ = env.step(
        '<tool_call>{"name": "calculate", "arguments": {"expression": "max(2,500,3)"}}</tool_call>'
    )
    assert messages[0]["content"] == "500"


def answer(env, task_id: str, text: str) -> float:
    """The reward of answering task ``task_id`` with ``text`` at once."""
    env.reset(options={"task_id": task_id})
    _, reward, terminated, _, _ = env.step(f"<answer>{text}</answer>")
    assert terminated
    return reward


@pytest.fixture(scope="module")
def sql():
    env = envhub.make("tools/sql-v0")
    yield env
    env.close()


def gold(env, task_id: str) -> tuple[str, str]:
    """Task ``task_id``'s expected answer and its question as the model sees it."""
    messages, _ = env.reset(options={"task_id": task_id})
    return str(env.task["answer"]), messages[-1]["content"]


def column(env, query: str) -> list[str]:
    """The values a ``run_sql`` call returns for a one-column query."""
    return env.call_tool("run_sql", {"query": query}).splitlines()[1:]


@pytest.mark.parametrize(
    "form", ["{}", "**{}**", "The {} department", "{} department.", "$\\boxed{{{}}}$", "`{}`"]
)
def test_sql_accepts_a_name_in_common_formats(sql, form):
    department, _ = gold(sql, "sql-0000")  # which department has the highest salary bill
    assert answer(sql, "sql-0000", form.format(department)) == 1.0


@pytest.mark.parametrize("form", ["{:,}", "${:,}", "{} dollars", "**{}**", "\\boxed{{{}}}"])
def test_sql_accepts_a_number_in_common_formats(sql, form):
    salary = int(gold(sql, "sql-0003")[0])  # the average salary of a department
    assert answer(sql, "sql-0003", form.format(salary)) == 1.0


def test_sql_accepts_a_count_restating_the_question(sql):
    count, question = gold(sql, "sql-0001")  # how many hired after <year> work in <city>
    year = question.split("after ")[1].split()[0]
    assert answer(sql, "sql-0001", f"{count} employees were hired after {year}.") == 1.0


def test_sql_refuses_an_answer_listing_several_candidates(sql):
    department, _ = gold(sql, "sql-0000")
    other = next(name for name in column(sql, "SELECT name FROM departments") if name != department)
    assert answer(sql, "sql-0000", f"{department} or {other}") == 0.0
    assert answer(sql, "sql-0000", f"{other}, {department}") == 0.0
    employee, _ = gold(sql, "sql-0002")  # who logged the most hours on a project
    rival = next(name for name in column(sql, "SELECT name FROM employees") if name != employee)
    assert answer(sql, "sql-0002", f"{employee} and {rival}") == 0.0
    salary = int(gold(sql, "sql-0003")[0])
    assert answer(sql, "sql-0003", f"{salary - 1}, {salary} or {salary + 1}") == 0.0
    assert answer(sql, "sql-0003", f"{salary + 1}") == 0.0


@pytest.fixture(scope="module")
def retrieval():
    env = envhub.make("tools/retrieval-v0")
    yield env
    env.close()


def test_retrieval_accepts_the_answer_in_a_full_sentence(retrieval):
    year, question = gold(retrieval, "doc-00-0")  # in which year was the founder of <firm> born
    firm = question.split("founder of ")[1].removesuffix(" born?")
    assert answer(retrieval, "doc-00-0", f"The founder of {firm} was born in {year}.") == 1.0
    assert answer(retrieval, "doc-00-0", f"**{year}**") == 1.0
    country, _ = gold(retrieval, "doc-00-2")  # in which country was the founder of <firm> born
    sentence = f"The founder of {firm} was born in {country}, as the encyclopedia says."
    assert answer(retrieval, "doc-00-2", sentence) == 1.0
    population = int(gold(retrieval, "doc-00-1")[0])
    assert answer(retrieval, "doc-00-1", f"About {population:,} people live there.") == 1.0


def test_retrieval_refuses_an_answer_listing_several_candidates(retrieval):
    year = int(gold(retrieval, "doc-00-0")[0])
    assert answer(retrieval, "doc-00-0", f"{year - 1}, {year} or {year + 1}") == 0.0
    country, _ = gold(retrieval, "doc-00-2")
    others = [c for c in ("Norvania", "Estrelia", "Kalmar Union", "Ostravia") if c != country]
    assert answer(retrieval, "doc-00-2", f"{country} or {others[0]}") == 0.0
    assert answer(retrieval, "doc-00-2", ", ".join([*others, country])) == 0.0


@pytest.mark.parametrize("form", ["{} {}", "{}, {}", "{},{}", "{}; {}", "**{} {}**", "{} and {}"])
def test_lookup_accepts_both_codes_however_they_are_separated(form):
    env = envhub.make("tools/lookup-v0")
    env.reset(seed=0)
    codes = [env.task["table"][name] for name in env.task["names"]]
    assert answer(env, env.task["id"], form.format(*codes)) == 1.0


def test_lookup_refuses_more_than_two_codes_however_they_are_separated():
    env = envhub.make("tools/lookup-v0")
    env.reset(seed=0)
    first, second = (env.task["table"][name] for name in env.task["names"])
    other = str((int(second) + 1) % 10)
    assert answer(env, env.task["id"], f"{first}, {second}, {other}") == 0.0
    assert answer(env, env.task["id"], f"{first},{second} or {first},{other}") == 0.0


def test_calculator_accepts_money_and_refuses_a_list_of_candidates():
    env = envhub.make("tools/calculator-v0")
    env.reset(options={"task": {"question": "What is 1234 + 0.5?", "answer": 1234.5}})
    _, reward, *_ = env.step("<answer>**$1,234.50**</answer>")
    assert reward == 1.0
    env.reset(options={"task": {"question": "What is 1234 + 0.5?", "answer": 1234.5}})
    _, reward, *_ = env.step("<answer>1,200 or 1,234.50</answer>")
    assert reward == 0.0


def test_mcp_refuses_a_list_of_candidates_and_accepts_a_formatted_number():
    env = envhub.make("tools/mcp-v0")
    try:
        expected, _ = gold(env, "value-widget-eur")
        value = float(expected)
        assert answer(env, "value-widget-eur", f"**€{value:,.2f}**") == 1.0
        assert answer(env, "value-widget-eur", f"{value - 1:.2f} or {value:.2f}") == 0.0
    finally:
        env.close()


def calculator_reward(text: str, value: float) -> float:
    """The calculator's reward for answering ``text`` to a question whose answer is ``value``."""
    env = envhub.make("tools/calculator-v0")
    env.reset(options={"task": {"question": "What is 32 * 24214 / 7?", "answer": value}})
    _, reward, *_ = env.step(f"<answer>{text}</answer>")
    env.close()
    return reward


@pytest.mark.parametrize(
    "text, value",
    [
        ("13 or .14", 13),  # a second value written after a dot
        ("1935 or .1936 or .1937", 1935),
        ("13 or ...14", 13),
        ("1935 or ¹⁹³⁶", 1935),  # superscript digits
        ("1935 or １９３６", 1935),  # full-width digits
        ("42 or −42", 42),  # U+2212 minus sign
        ("8 or ⑨", 8),  # a circled digit
    ],
)
def test_a_hedge_written_with_unusual_numbers_scores_nothing(text, value):
    assert calculator_reward(text, value) == 0.0


@pytest.mark.parametrize(
    "text, value",
    [
        (".5", 0.5),
        ("-.5", -0.5),
        ("−42", -42),  # U+2212 minus sign
        ("１９３６", 1936),  # full-width digits
        ("The answer is 1936.", 1936),
        ("1936. That is the year.", 1936),
        ("**13**", 13),
        ("1.5", 1.5),
        ("An area of 357,022 km².", 357022),  # a unit's power is not a second value
    ],
)
def test_a_right_answer_in_an_unusual_number_form_scores(text, value):
    assert calculator_reward(text, value) == 1.0


def test_an_answer_that_denies_a_candidate_is_read_as_denying_it(sql, retrieval):
    """``not X`` does not give X (it scored 1 as a whole-word match); ``X, not Y`` commits to X
    (it scored 0: Y looked like a hedge)."""
    department, _ = gold(sql, "sql-0000")
    other = next(name for name in column(sql, "SELECT name FROM departments") if name != department)
    assert answer(sql, "sql-0000", f"not {department}") == 0.0
    assert answer(sql, "sql-0000", f"It is not the {department} department.") == 0.0
    assert answer(sql, "sql-0000", f"It isn't {department}") == 0.0
    assert answer(sql, "sql-0000", f"{department}, not {other}") == 1.0
    assert answer(sql, "sql-0000", f"Not {other} but {department}") == 1.0
    year = int(gold(retrieval, "doc-00-0")[0])
    assert answer(retrieval, "doc-00-0", f"not {year}") == 0.0
    assert answer(retrieval, "doc-00-0", f"neither {year} nor {year + 1}") == 0.0
    assert answer(retrieval, "doc-00-0", f"{year}, not {year + 1}") == 1.0
    assert answer(retrieval, "doc-00-0", f"Born in {year}, not long after the war.") == 1.0
