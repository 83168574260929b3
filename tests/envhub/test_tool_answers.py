"""Every tool call of a reply answered once, in call order, wherever an env's reply is read
(``envhub eval``, the trainer's env manager and agent proxy all use ``answer_tool_calls``)."""

from __future__ import annotations

from typing import Any

from envhub.model_agent import ANSWERED_BELOW, NOT_RUN, answer_tool_calls

IDS = ["srv_a", "srv_b"]


def tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def shown(messages: list[dict[str, Any]]) -> list[tuple[str, Any, str]]:
    return [(m["role"], m.get("tool_call_id"), m["content"]) for m in messages]


def test_an_env_that_answers_out_of_order_by_its_own_numbers_gets_each_answer_to_its_call() -> None:
    answers = [tool("call00001", "B"), tool("call00000", "A")]
    assert shown(answer_tool_calls(IDS, answers)) == [
        ("tool", "srv_a", "A"),
        ("tool", "srv_b", "B"),
    ]


def test_an_env_that_ran_only_the_second_call_answers_it_and_the_first_is_not_run() -> None:
    answers = [tool("call00001", "B"), {"role": "user", "content": "call 1 was refused"}]
    assert shown(answer_tool_calls(IDS, answers, refused=True)) == [
        ("tool", "srv_a", NOT_RUN),
        ("tool", "srv_b", "B"),
        ("user", None, "call 1 was refused"),
    ]


def test_an_env_that_kept_the_calls_own_ids_is_matched_by_them_first() -> None:
    ids = ["call00001", "call00000"]  # (a server's ids that look like an env's numbering)
    answers = [tool("call00000", "second"), tool("call00001", "first")]
    assert shown(answer_tool_calls(ids, answers)) == [
        ("tool", "call00001", "first"),
        ("tool", "call00000", "second"),
    ]


def test_a_second_answer_to_one_call_joins_the_feedback_instead_of_answering_no_call() -> None:
    answers = [tool("call00000", "A"), tool("call00000", "A again"), tool("call00001", "B")]
    assert shown(answer_tool_calls(IDS, answers)) == [
        ("tool", "srv_a", "A"),
        ("tool", "srv_b", "B"),
        ("user", None, "A again"),
    ]


def test_an_env_that_answered_in_prose_is_not_said_to_have_refused_the_call() -> None:
    prose = {"role": "user", "content": "The calculator says 4."}
    assert shown(answer_tool_calls(["srv_a"], [prose], refused=False)) == [
        ("tool", "srv_a", ANSWERED_BELOW),
        ("user", None, "The calculator says 4."),
    ]
    assert shown(answer_tool_calls(["srv_a"], [prose], refused=True))[0][2] == NOT_RUN


def test_a_reply_without_calls_is_left_as_the_env_wrote_it() -> None:
    answers = [{"role": "user", "content": "hi"}, tool("call00000", "stray")]
    assert answer_tool_calls([], answers) == answers
