"""Action parsing from chatty model text."""

from __future__ import annotations

import pytest

from envhub.errors import ActionParseError
from envhub.parsing import ActionParser, extract_answer


@pytest.mark.parametrize(
    "text, action",
    [
        ("<answer>up</answer>", "up"),
        ("I think... <ANSWER> Left </Answer>", "Left"),
        ("First <answer>up</answer>, no wait: <answer>down</answer>", "down"),
        ("<answer>\n```\nright\n```\n</answer>", "right"),
        ("Reasoning about it.\n<answer>42", "42"),
        ("no tags at all\nup", "up"),
        ("`left`", "left"),
    ],
)
def test_tag_format_finds_the_action(text, action):
    assert ActionParser().parse(text) == action


def test_strict_tag_format_explains_the_expected_format():
    with pytest.raises(ActionParseError) as caught:
        ActionParser(lenient=False).parse("I will go up")
    assert (
        caught.value.feedback
        == "I could not find your action. Put your action inside <answer>...</answer>."
    )


@pytest.mark.parametrize("text", ["", "   \n ", "<answer>  </answer>"])
def test_empty_replies_get_feedback(text):
    with pytest.raises(ActionParseError, match="empty|no action") as caught:
        ActionParser().parse(text)
    assert "<answer>" in caught.value.feedback


def test_overlong_action_is_refused():
    with pytest.raises(ActionParseError, match="exceeds max_length=10"):
        ActionParser(max_length=10).parse("<answer>" + "x" * 11 + "</answer>")


def test_other_formats_and_custom_tag():
    assert ActionParser(format="last_line").parse("thinking\n\n  go  \n") == "go"
    assert ActionParser(format="raw").parse("  all of it \n") == "all of it"
    assert ActionParser(tag="move").parse("<move>up</move><answer>x</answer>") == "up"
    assert ActionParser(tag="move").wrap("up") == "<move>up</move>"
    assert extract_answer("x <answer>7</answer>") == "7" and extract_answer("7") is None


def test_bad_parser_config_is_refused():
    with pytest.raises(ValueError, match="unknown action format 'xml'"):
        ActionParser(format="xml")
    with pytest.raises(ValueError, match="must be a plain name"):
        ActionParser(tag="a b")


@pytest.mark.parametrize(
    "text, action",
    [
        ("<think>maybe <answer>0</answer>? no.</think><answer>5</answer>", "5"),
        ("<think>is it <answer>up</answer>?</think>\ndown", "down"),  # lenient: the last line
        ("it could be <answer>2</answer>... </think><answer>3</answer>", "3"),  # prompt's <think>
        ("<answer>print('</think>')</answer>", "print('</think>')"),  # a close tag is text
        ("<answer>a</answer> note: the tag </think> is fine", "a"),
    ],
)
def test_an_answer_written_while_thinking_is_not_the_action(text, action):
    assert ActionParser().parse(text) == action


def test_a_reply_that_only_thinks_has_no_action():
    with pytest.raises(ActionParseError):
        ActionParser(lenient=False).parse("<think>so <answer>0</answer> then</think>")
    assert extract_answer("<think><answer>0</answer></think>") is None
