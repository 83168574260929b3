"""What an answer denies is not given, and only that: ``not Finance`` gives nothing, ``Finance, not
Sales`` commits to Finance, and a denial ends with its clause, so a right answer after it (``Not
Sales: Finance``) or a name that holds a negation word (``Never Let Me Go``) still scores."""

from __future__ import annotations

import pytest

from envs.tools.answers import name_matches, number_matches

RIVALS = ["Sales", "Research", "Finance", "Engineering"]


@pytest.mark.parametrize(
    "answer, given",
    [
        ("not Finance", False),
        ("It is not the Finance department.", False),
        ("It isn't Finance", False),
        ("It isn\u2019t Finance", False),  # a typographic apostrophe
        ("It cannot be Finance", False),
        ("Finance, not Sales", True),
        ("Not Sales but Finance", True),
        ("Not Sales: Finance", True),
        ("Not Sales - Finance", True),
        ("Not Sales. Finance.", True),
        ("Not Sales.\n**Finance**", True),
        ("It's not Sales.\nFinal answer: Finance", True),
    ],
)
def test_a_name_denied_is_not_given_and_a_denial_ends_with_its_clause(answer, given):
    assert name_matches(answer, "Finance", RIVALS) is given


@pytest.mark.parametrize(
    "answer, value, question, given",
    [
        ("not 1935", 1935, "", False),
        ("neither 1935 nor 1936", 1935, "", False),
        ("It isn\u2019t 1935", 1935, "", False),
        ("1935, not 1936", 1935, "", True),
        ("Born in 1935, not long after the war.", 1935, "", True),
        ("Not 1936. 1935.", 1935, "", True),
        ("Not 1936: 1935", 1935, "", True),
        ("Rounding isn't needed: 42.5", 42.5, "", True),
        ("I didn't round: 42.5", 42.5, "", True),
        ("Never promoted: 12", 12, "How many employees were never promoted?", True),
        ("Employees not hired: 12", 12, "How many employees were not hired after 2015?", True),
    ],
)
def test_a_number_denied_is_not_given_and_a_denial_ends_with_its_clause(
    answer, value, question, given
):
    assert number_matches(answer, value, stated=question) is given


@pytest.mark.parametrize("title", ["Never Let Me Go", "Don't Look Up", "Neither Here nor There"])
def test_a_name_that_holds_a_negation_word_is_read_as_the_name(title):
    assert name_matches(title, title, ["Atonement", "Dune"])
    assert name_matches(f"The answer is {title}.", title, ["Atonement", "Dune"])
    assert not name_matches(f"Atonement or {title}", "Atonement", [title, "Dune"])  # a hedge
    assert name_matches(f"Atonement, not {title}", "Atonement", [title, "Dune"])
