"""``envhub eval --model URL``: any OpenAI-compatible endpoint on any env, through the real
``openai`` client over HTTP (a scripted server here; vLLM's own in test_eval_vllm.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="needs the openai extra: pip install -e '.[openai]'")
pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")

import openai
from click.testing import CliRunner

import envhub
from envhub.cli import main
from envhub.eval_records import pass_at_k, read_episodes
from envhub.evaluation import evaluate
from envhub.model_agent import ModelEndpointError
from tests.envhub.openai_servers import completion, scripted_server, tool_call

LOOKUP = "tools/lookup-v0"


def lookup_agent(body: dict[str, Any]) -> dict[str, Any]:
    """Plays tools/lookup-v0 from what it is sent alone: asks for both codes in one turn with
    native calls (its own ids), then answers from the tool messages *that carry those ids*."""
    messages = body["messages"]
    names = re.findall(r"codes of (\w+) and (\w+)", messages[1]["content"])
    answers = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    if not answers:
        first, second = names[0]
        return completion(
            "",
            [
                tool_call("srv-a", "lookup", json.dumps({"name": first})),
                tool_call("srv-b", "lookup", json.dumps({"name": second})),
            ],
        )
    return completion(f"<answer>{answers.get('srv-a')} {answers.get('srv-b')}</answer>")


def client(url: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="test", max_retries=retries, timeout=10)


def test_a_native_tool_agent_wins_when_its_call_ids_come_back_with_the_results(
    tmp_path: Path,
) -> None:
    with scripted_server(lookup_agent) as server:
        [summary] = evaluate(
            [LOOKUP], client=client(server.url), episodes=6, concurrency=3, out=tmp_path
        )
    assert summary.success_rate == 1.0 and summary.agent == "scripted"
    assert summary.mean_turns == 2.0 and summary.invalid_rate == 0.0
    assert all(r["tools"][0]["function"]["name"] == "lookup" for r in server.requests)
    episodes = read_episodes(tmp_path / "episodes.jsonl")
    assert sorted(e.seed for e in episodes) == list(range(6))
    roles = [m["role"] for m in episodes[0].messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert episodes[0].messages[2]["tool_calls"][1]["id"] == "srv-b"
    assert episodes[0].tokens_in == 20 and len(episodes[0].latencies) == 2
    assert json.loads((tmp_path / "summary.json").read_text())[0]["success_rate"] == 1.0


def test_arguments_that_are_not_json_are_env_feedback_not_a_crash() -> None:
    def broken(body: dict[str, Any]) -> dict[str, Any]:
        return completion("", [tool_call("x", "lookup", '{"name": ')])

    with scripted_server(broken) as server:
        [summary] = evaluate(
            [LOOKUP], client=client(server.url), episodes=2, max_turns=2, concurrency=1
        )  # one episode at a time: the second request is the first episode's second turn
    assert summary.failures == {} and summary.invalid_rate == 1.0
    second_prompt = server.requests[1]["messages"]
    assert "JSON" in second_prompt[-1]["content"]  # the env's own parse feedback


def test_a_server_that_refuses_tools_is_played_as_text_in_auto_mode_only() -> None:
    calls: list[bool] = []

    def vllm_without_tool_choice(body: dict[str, Any]) -> Any:
        from fastapi.responses import JSONResponse

        calls.append("tools" in body)
        if "tools" in body:  # what vLLM answers without --enable-auto-tool-choice
            message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'
            return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
        return completion("<answer>0 0</answer>")

    with scripted_server(vllm_without_tool_choice) as server:
        [auto] = evaluate(  # one episode at a time: the order of requests is the test
            [LOOKUP], client=client(server.url), episodes=3, concurrency=1
        )
        [native] = evaluate([LOOKUP], client=client(server.url), episodes=2, tools="native")
    assert auto.failures == {} and auto.mean_turns == 1.0
    assert calls[:4] == [True, False, False, False]  # refused once, then text for the run
    assert native.failures == {"http_400": 2}


def test_429_is_retried_and_persistent_errors_fail_episodes_without_losing_any(
    tmp_path: Path,
) -> None:
    from fastapi.responses import JSONResponse, Response

    state = {"n": 0}

    def flaky(body: dict[str, Any]) -> Any:
        state["n"] += 1
        seed_text = body["messages"][1]["content"]
        if state["n"] == 1:  # rate limited once: the client's own retry succeeds
            return JSONResponse({"error": "slow down"}, 429, headers={"retry-after-ms": "1"})
        if "gold" in seed_text:
            return JSONResponse({"error": {"message": "engine died"}}, status_code=500)
        if "pink" in seed_text:
            return Response(b"{not json", media_type="application/json")
        return completion("<answer>0 0</answer>")

    with scripted_server(flaky) as server:
        [summary] = evaluate(
            [LOOKUP], client=client(server.url, retries=1), episodes=12, out=tmp_path
        )
    episodes = read_episodes(tmp_path / "episodes.jsonl")
    assert len(episodes) == summary.episodes == 12
    reasons = {e.failure for e in episodes}
    assert reasons >= {None, "http_500", "bad_response"}, reasons
    assert sum(summary.failures.values()) == sum(e.failure is not None for e in episodes) > 0
    assert all(not e.success for e in episodes if e.failure)


def test_resume_plays_only_what_is_missing_and_survives_a_torn_line(tmp_path: Path) -> None:
    with scripted_server(lookup_agent) as server:
        evaluate([LOOKUP], client=client(server.url), episodes=3, samples=2, out=tmp_path)
        with open(tmp_path / "episodes.jsonl", "ab") as f:
            f.write(b'{"env_id": "tools/lookup-v0", "se')  # a run killed mid-write
        before = len(server.requests)
        [summary] = evaluate(
            [LOOKUP], client=client(server.url), episodes=5, samples=2, out=tmp_path, resume=True
        )
        assert len(server.requests) - before == 2 * 2 * 2  # 2 new seeds x 2 tries x 2 turns
    keys = [e.key for e in read_episodes(tmp_path / "episodes.jsonl")]
    assert len(keys) == len(set(keys)) == 10 and summary.episodes == 10
    assert summary.samples == 2 and summary.pass_at_k == 1.0


def test_an_unreachable_endpoint_or_unknown_model_is_refused_before_playing() -> None:
    from tests.envhub.pool.raycluster import free_port

    with pytest.raises(ModelEndpointError, match="cannot reach .*is the server running"):
        evaluate([LOOKUP], client=client(f"http://127.0.0.1:{free_port()}/v1"), episodes=1)
    with scripted_server(lookup_agent, models=("a", "b")) as server:
        with pytest.raises(ModelEndpointError, match=r"serves 2 models \['a', 'b'\].*--model-name"):
            evaluate([LOOKUP], client=client(server.url), episodes=1)
        with pytest.raises(ModelEndpointError, match="does not serve model 'c'"):
            evaluate([LOOKUP], client=client(server.url), model="c", episodes=1)
        assert server.requests == []


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)


def test_the_cli_prints_the_table_and_a_python_caller_gets_envhub_evaluate(
    tmp_path: Path,
) -> None:
    assert envhub.evaluate is evaluate
    with scripted_server(lookup_agent) as server:
        result = CliRunner().invoke(
            main,
            [
                "eval",
                LOOKUP,
                "--model",
                server.url,
                "--episodes",
                "4",
                "--samples",
                "2",
                "--out",
                str(tmp_path),
            ],
            env={"COLUMNS": "160"},
        )
        assert result.exit_code == 0, result.output
        assert "pass@2" in result.output and "100%" in result.output
        assert "tokens in/out" in result.output and "latency" in result.output
        bad = CliRunner().invoke(main, ["eval", LOOKUP, "--model", server.url, "--resume"])
    assert bad.exit_code == 2 and "--resume needs --out" in bad.output
    assert len(read_episodes(tmp_path / "episodes.jsonl")) == 8
