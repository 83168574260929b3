"""``envhub eval --model URL`` against an API that enforces OpenAI's chat-completions rules, and
what the record keeps of each reply.

api.openai.com (and DeepSeek, DashScope, litellm in front of them) refuse with a 400 a
conversation in which an assistant message's ``tool_calls`` are not each answered by a ``tool``
message, or a ``tool`` message answers no call. vLLM does not check, so a bug here only shows
against a hosted API; ``strict`` below checks what they check, with OpenAI's wording.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="needs the openai extra: pip install -e '.[openai]'")
pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")

import openai
from click.testing import CliRunner
from fastapi.responses import JSONResponse

import envhub
from envhub.cli import main
from envhub.eval_records import read_episodes
from envhub.evaluation import evaluate
from envhub.model_agent import unique_call_ids
from tests.envhub.openai_servers import Reply, completion, scripted_server, tool_call
from tests.helpers import CountdownEnv

LOOKUP = "tools/lookup-v0"
COUNTDOWN = "evalstrict/countdown-v0"
"""Say 'go' to win."""
envhub.register(COUNTDOWN, CountdownEnv, max_turns=3)


def strict_problem(messages: list[dict[str, Any]]) -> str | None:
    """What api.openai.com says of a conversation whose tool messages break its rules."""
    pending: set[str] = set()
    for message in messages:
        role = message.get("role")
        if pending:
            if role == "tool" and message.get("tool_call_id") in pending:
                pending.discard(message["tool_call_id"])
                continue
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                f"response messages: {', '.join(sorted(pending))}"
            )
        if role == "tool":
            return (
                "Invalid parameter: messages with role 'tool' must be a response to a "
                "preceeding message with 'tool_calls'."
            )
        if role == "assistant" and message.get("tool_calls"):
            pending = {call["id"] for call in message["tool_calls"]}
    return None


def strict(reply: Reply) -> Reply:
    """``reply``, behind OpenAI's checks of the tool messages (a 400 as OpenAI words it)."""

    def answer(body: dict[str, Any]) -> Any:
        problem = strict_problem(body["messages"])
        if problem is not None:
            error = {"message": problem, "type": "invalid_request_error", "param": "messages"}
            return JSONResponse({"error": error}, status_code=400)
        return reply(body)

    return answer


def client(url: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="test", max_retries=retries, timeout=10)


def names_asked(body: dict[str, Any]) -> tuple[str, str]:
    first, second = re.findall(r"codes of (\w+) and (\w+)", body["messages"][1]["content"])[0]
    return first, second


def lookup(call_id: str, name: str) -> dict[str, Any]:
    return tool_call(call_id, "lookup", json.dumps({"name": name}))


def native_player(first_turn: dict[str, Any] | None) -> Reply:
    """Plays tools/lookup-v0 with native calls (ids srv-a, srv-b), after ``first_turn`` (a
    reply the env refuses) when given; answers from the tool messages carrying its ids."""

    def reply(body: dict[str, Any]) -> Any:
        messages = body["messages"]
        turns = sum(m["role"] == "assistant" for m in messages)
        if first_turn is not None and turns == 0:
            return first_turn
        answers = {m.get("tool_call_id"): m["content"] for m in messages if m["role"] == "tool"}
        if "srv-a" in answers and "srv-b" in answers:
            return completion(f"<answer>{answers['srv-a']} {answers['srv-b']}</answer>")
        first, second = names_asked(body)
        return completion("", [lookup("srv-a", first), lookup("srv-b", second)])

    return reply


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "refused",
    [
        completion("", [tool_call("srv-x", "no_such_tool", "{}")]),
        completion("", [tool_call("srv-x", "lookup", '{"name": ')]),
    ],
    ids=["unknown tool", "arguments not JSON"],
)
def test_a_tool_call_the_env_refuses_is_an_invalid_action_not_an_http_400(
    tmp_path: Path, refused: dict[str, Any]
) -> None:
    with scripted_server(strict(native_player(refused))) as server:
        [summary] = evaluate(
            [LOOKUP], client=client(server.url), episodes=2, concurrency=1, out=tmp_path
        )
    assert summary.failures == {}, summary.failures
    assert summary.success_rate == 1.0 and summary.mean_turns == 3.0
    assert summary.invalid_rate == pytest.approx(1 / 3)
    answer, feedback = server.requests[1]["messages"][3:5]  # after the refused reply
    assert answer["role"] == "tool" and answer["tool_call_id"] == "srv-x"
    assert answer["content"].startswith("Not run")
    assert feedback["role"] == "user"  # the env's own words on what was wrong
    assert "no tool named" in feedback["content"] or "JSON" in feedback["content"]
    recorded = read_episodes(tmp_path / "episodes.jsonl")[0].messages
    assert recorded[3]["role"] == "tool" and recorded[3]["tool_call_id"] == "srv-x"


@pytest.mark.timeout(60)
def test_text_tool_calls_are_answered_in_a_form_a_strict_api_takes() -> None:
    def text_player(body: dict[str, Any]) -> Any:
        messages = body["messages"]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            calls = "".join(
                f'<tool_call>{{"name": "lookup", "arguments": {{"name": "{name}"}}}}</tool_call>'
                for name in names_asked(body)
            )
            return completion(calls)
        said = " ".join(str(m["content"]) for m in messages[turns[0] + 1 :])
        codes = " ".join(re.findall(r"\b\d\b", said))
        return completion(f"<answer>{codes}</answer>")

    with scripted_server(strict(text_player)) as server:
        [summary] = evaluate(
            [LOOKUP], client=client(server.url), episodes=2, tools="text", concurrency=1
        )
    assert summary.failures == {} and summary.success_rate == 1.0, summary
    assert all("tools" not in body for body in server.requests)


@pytest.mark.timeout(60)
def test_a_reply_with_text_and_native_calls_gets_answers_for_the_ids_the_server_gave(
    tmp_path: Path,
) -> None:
    def mixed_player(body: dict[str, Any]) -> Any:
        messages = body["messages"]
        first, second = names_asked(body)
        if not any(m["role"] == "assistant" for m in messages):
            text_call = f'<tool_call>{{"name": "lookup", "arguments": {{"name": "{second}"}}}}'
            return completion(text_call + "</tool_call>", [lookup("srv-a", first)])
        return native_player(None)(body)

    with scripted_server(strict(mixed_player)) as server:
        [summary] = evaluate(
            [LOOKUP], client=client(server.url), episodes=1, concurrency=1, out=tmp_path
        )
    assert summary.failures == {} and summary.success_rate == 1.0, summary
    sent = [m for body in server.requests for m in body["messages"]]
    issued = {call["id"] for m in sent for call in m.get("tool_calls", [])}
    answered = {m["tool_call_id"] for m in sent if m["role"] == "tool"}
    assert answered and answered <= issued


def with_choice(body: dict[str, Any], **choice: Any) -> dict[str, Any]:
    """A completion body with ``choice``'s keys set on its message or, for ``finish_reason``,
    on its choice."""
    finish = choice.pop("finish_reason", None)
    if finish is not None:
        body["choices"][0]["finish_reason"] = finish
    body["choices"][0]["message"].update(choice)
    return body


@pytest.mark.timeout(60)
def test_the_record_keeps_why_a_reply_ended_and_its_reasoning(tmp_path: Path) -> None:
    def thinker(body: dict[str, Any]) -> Any:
        if len(body["messages"]) < 3:  # first turn: cut off at max_tokens
            return with_choice(completion("I think the answer is"), finish_reason="length")
        return with_choice(completion("go"), reasoning_content="Let me think: they want go.")

    with scripted_server(thinker) as server:
        result = CliRunner().invoke(
            main,
            [
                "eval", COUNTDOWN, "--model", server.url, "--episodes", "2", "--concurrency",
                "1", "--out", str(tmp_path), "--json",
            ],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    episode = read_episodes(tmp_path / "episodes.jsonl")[0]
    replies = [m for m in episode.messages if m["role"] == "assistant"]
    assert [m["finish_reason"] for m in replies] == ["length", "stop"]
    assert replies[1]["reasoning_content"] == "Let me think: they want go."
    assert episode.cut_off == 1
    [row] = json.loads(result.stdout)
    assert row["cut_off_rate"] == pytest.approx(0.5)  # 2 of the 4 replies
    sent = [m for body in server.requests for m in body["messages"]]
    assert not any("reasoning_content" in m or "finish_reason" in m for m in sent)
    [note] = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert "50% of the replies were cut off at --max-tokens 512" in note


@pytest.mark.timeout(60)
def test_a_hint_says_replies_were_cut_off_only_when_they_were() -> None:
    def rambler(body: dict[str, Any]) -> Any:
        return with_choice(completion("Well, let me see"), finish_reason="length")

    with scripted_server(rambler) as server:
        cut = CliRunner().invoke(
            main, ["eval", COUNTDOWN, "--model", server.url, "--episodes", "2"]
        )
    with scripted_server(lambda body: completion("I say stop")) as server:
        whole = CliRunner().invoke(
            main, ["eval", COUNTDOWN, "--model", server.url, "--episodes", "2"]
        )
    [hint] = [line for line in cut.stderr.splitlines() if line.startswith("hint:")]
    assert "100% of the replies were cut off at --max-tokens 512" in hint
    [hint] = [line for line in whole.stderr.splitlines() if line.startswith("hint:")]
    assert "cut off" not in hint


@pytest.mark.timeout(60)
def test_each_try_of_a_seed_is_sampled_with_its_own_request_seed() -> None:
    with scripted_server(lambda body: completion("go")) as server:
        evaluate([COUNTDOWN], client=client(server.url), episodes=2, samples=2)
        first = [body.get("seed") for body in server.requests]
        evaluate([COUNTDOWN], client=client(server.url), episodes=2, samples=2)
    again = [body.get("seed") for body in server.requests[len(first) :]]
    assert None not in first and len(set(first)) == 4  # 2 seeds x 2 tries
    assert sorted(again) == sorted(first)  # the same run asks for the same samples


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("samples", "temperature", "warned"), [(3, 0.0, True), (1, 0.0, False), (3, 0.7, False)]
)
def test_several_tries_at_temperature_0_are_warned_of(
    caplog: pytest.LogCaptureFixture, samples: int, temperature: float, warned: bool
) -> None:
    with scripted_server(lambda body: completion("go")) as server, caplog.at_level(logging.WARNING):
        evaluate(
            [COUNTDOWN], client=client(server.url), episodes=1, samples=samples,
            temperature=temperature,
        )  # fmt: skip
    assert ("3 tries per seed at temperature 0" in caplog.text) is warned, caplog.text


@pytest.mark.timeout(60)
def test_latency_counts_the_requests_that_failed() -> None:
    def down(body: dict[str, Any]) -> Any:
        return JSONResponse({"error": {"message": "engine died"}}, status_code=500)

    with scripted_server(down) as server:
        [summary] = evaluate([COUNTDOWN], client=client(server.url), episodes=2)
    assert summary.failures == {"http_500": 2}
    assert summary.latency_p50_s > 0 and summary.latency_p95_s > 0


@pytest.mark.timeout(60)
def test_tool_calls_that_share_an_id_are_each_answered_under_an_id_of_their_own(
    tmp_path: Path,
) -> None:
    def same_ids(body: dict[str, Any]) -> Any:
        """Gives both calls the id call_0; answers from the tool messages of the ids sent
        back, in the order of its calls."""
        messages = body["messages"]
        replies = [m for m in messages if m["role"] == "assistant"]
        if not replies:
            first, second = names_asked(body)
            return completion("", [lookup("call_0", first), lookup("call_0", second)])
        answers = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        codes = [answers[call["id"]] for call in replies[-1]["tool_calls"]]
        return completion(f"<answer>{' '.join(codes)}</answer>")

    with scripted_server(strict(same_ids)) as server:
        [summary] = evaluate(
            [LOOKUP], client=client(server.url), episodes=2, concurrency=1, out=tmp_path
        )
    assert summary.failures == {} and summary.success_rate == 1.0, summary
    [sent] = [m for m in server.requests[1]["messages"] if m["role"] == "assistant"]
    ids = [call["id"] for call in sent["tool_calls"]]
    assert ids[0] == "call_0" and len(set(ids)) == 2  # the server's id kept where it can be
    recorded = read_episodes(tmp_path / "episodes.jsonl")[0].messages
    [reply] = [m for m in recorded if m["role"] == "assistant" and m.get("tool_calls")]
    assert [call["id"] for call in reply["tool_calls"]] == ids


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        (["a", "a", "b"], ["a", "call00001", "b"]),
        ([None, None], ["call00000", "call00001"]),
        (["call00001", "call00001", None], ["call00001", "call00002", "call00003"]),
        (["x", "call00001", "x"], ["x", "call00001", "call00002"]),
    ],
)
def test_call_ids_are_made_unique_keeping_the_servers_where_they_are(
    given: list[str | None], sent: list[str]
) -> None:
    assert unique_call_ids(given) == sent
