"""What ``envhub eval``'s numbers and ``--out`` folder say when episodes fail for reasons that are
not the model's (an endpoint down, an env that crashes), and the options and API arguments it
refuses: each test is what a user would see."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="needs the openai extra: pip install -e '.[openai]'")
pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")

import openai
from fastapi.responses import JSONResponse, Response

import envhub
from envhub.eval_records import read_episodes
from envhub.evaluation import evaluate
from tests.envhub.eval_cli_helpers import eval_cli
from tests.envhub.openai_servers import completion, scripted_server
from tests.helpers import CountdownEnv

COUNTDOWN = "evalacct/countdown-v0"
"""Say 'go' to win."""
FLAKY = "evalacct/flaky-v0"
"""A countdown whose ``reset`` raises while ``ENV_BROKEN`` holds True."""
ENV_BROKEN = {"now": False}


class Flaky(CountdownEnv):
    def on_reset(self, options: dict[str, Any]) -> Any:
        if ENV_BROKEN["now"]:
            raise RuntimeError("the env's data server is down")
        return super().on_reset(options)


class Sized(CountdownEnv):
    """A countdown that takes ``size`` (which ``COUNTDOWN`` does not)."""

    def __init__(self, *, size: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.size = size


envhub.register(COUNTDOWN, CountdownEnv, max_turns=3)
envhub.register(FLAKY, Flaky, max_turns=3)
envhub.register("evalacct/sized-v0", Sized, max_turns=3)
DOWN = JSONResponse({"error": {"message": "engine died"}}, status_code=500)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="test", max_retries=0, timeout=10)


# ------------------------------------------------------------------ --resume replays outages
@pytest.mark.timeout(60)
def test_resume_replays_the_episodes_an_outage_failed_and_keeps_the_models_own(
    tmp_path: Path,
) -> None:
    too_long = {"error": {"message": "This model's maximum context length is 8 tokens"}}

    def outage(body: dict[str, Any]) -> Any:
        secret = int(body["messages"][-1]["content"].split("Secret ")[1].rstrip("."))
        return JSONResponse(too_long, status_code=400) if secret % 2 else DOWN

    with scripted_server(outage) as server:
        [failed] = evaluate([COUNTDOWN], client=client(server.url), episodes=6, out=tmp_path)
    reasons = failed.failures
    assert set(reasons) == {"http_500", "context_length"}, reasons
    with scripted_server(lambda body: completion("go")) as server:
        [resumed] = evaluate(
            [COUNTDOWN], client=client(server.url), episodes=6, out=tmp_path, resume=True
        )
        assert len(server.requests) == reasons["http_500"]  # only the outage's are played again
    assert resumed.episodes == 6
    assert resumed.failures == {"context_length": reasons["context_length"]}
    assert resumed.success_rate == pytest.approx(reasons["http_500"] / 6)
    episodes = read_episodes(tmp_path / "episodes.jsonl")  # one line per episode: the newest
    assert len(episodes) == 6 and sum(e.failure == "http_500" for e in episodes) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())[0]
    assert summary["failures"] == {"context_length": reasons["context_length"]}


@pytest.mark.timeout(60)
def test_resume_replays_episodes_whose_env_failed(tmp_path: Path) -> None:
    ENV_BROKEN["now"] = True
    try:
        result = eval_cli(FLAKY, "--agent", "expert", "--episodes", "2", "--out", str(tmp_path))
    finally:
        ENV_BROKEN["now"] = False
    assert result.exit_code == 1 and "data server is down" in result.stderr, result.output
    again = eval_cli(
        FLAKY, "--agent", "expert", "--episodes", "2", "--out", str(tmp_path), "--resume"
    )
    assert again.exit_code == 0, again.output
    [row] = json.loads((tmp_path / "summary.json").read_text())
    assert row["failures"] == {} and row["episodes"] == 2


@pytest.mark.timeout(60)
def test_an_interrupted_resume_leaves_no_summary_of_the_earlier_run(tmp_path: Path) -> None:
    class Interrupted(CountdownEnv):
        def on_step(self, action: str) -> Any:
            raise KeyboardInterrupt

    envhub.register("evalacct/interrupted-v0", Interrupted, max_turns=3)
    args = ["--agent", "random", "--episodes", "2", "--out", str(tmp_path)]
    assert eval_cli(COUNTDOWN, *args).exit_code == 0
    assert (tmp_path / "summary.json").exists()
    stopped = eval_cli(COUNTDOWN, "evalacct/interrupted-v0", *args, "--resume")
    assert stopped.exit_code == 130, stopped.output
    assert not (tmp_path / "summary.json").exists()  # it no longer describes the folder


# ----------------------------------------------------------------------- what a reply holds
@pytest.mark.timeout(60)
def test_a_reply_with_a_lone_surrogate_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    body = json.dumps(completion("go")).replace('"go"', '"\\udcff go"').encode()
    with scripted_server(lambda _: Response(body, media_type="application/json")) as server:
        [summary] = evaluate([COUNTDOWN], client=client(server.url), episodes=2, out=tmp_path)
    assert summary.episodes == 2 and summary.failures == {}
    episodes = read_episodes(tmp_path / "episodes.jsonl")
    assert len(episodes) == 2
    assert episodes[0].messages[1]["content"] == "\ufffd go"
    assert json.loads((tmp_path / "summary.json").read_text())[0]["episodes"] == 2


# ------------------------------------------------------------ success over measured episodes
@pytest.mark.timeout(60)
def test_success_over_the_measured_episodes_is_shown_and_many_failures_warned_of(
    tmp_path: Path,
) -> None:
    count = {"n": 0}

    def half_down(body: dict[str, Any]) -> Any:
        count["n"] += 1
        return DOWN if count["n"] <= 6 else completion("go")

    with scripted_server(half_down) as server:
        result = eval_cli(
            COUNTDOWN, "--model", server.url, "--episodes", "10", "--retries", "0",
            "--concurrency", "1", "--out", str(tmp_path),
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    [row] = json.loads((tmp_path / "summary.json").read_text())
    assert row["success_rate"] == pytest.approx(0.4)  # every episode
    assert row["measured"] == 4 and row["measured_success_rate"] == 1.0
    header, line = result.stdout.splitlines()[1:3]
    cells = dict(zip(header.split("\t"), line.split("\t"), strict=True))
    assert cells["success"] == "40%" and cells["measured"] == "4"
    assert cells["success (measured)"] == "100%"
    [warning] = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert COUNTDOWN in warning and "6 of 10" in warning and "http_500 6" in warning
    assert "--resume" in warning


@pytest.mark.timeout(60)
def test_a_row_without_failures_has_no_measured_column_and_no_warning() -> None:
    result = eval_cli(COUNTDOWN, "--agent", "random", "--episodes", "2")
    assert result.exit_code == 0, result.output
    assert "measured" not in result.stdout and "warning:" not in result.stderr


@pytest.mark.timeout(60)
def test_a_row_that_measured_nothing_has_json_without_infinity(tmp_path: Path) -> None:
    class Unbuildable(CountdownEnv):
        def __init__(self, **kwargs: Any) -> None:
            raise RuntimeError("cannot build")

    envhub.register("evalacct/unbuildable-v0", Unbuildable, max_turns=3)
    result = eval_cli(
        "evalacct/unbuildable-v0", COUNTDOWN, "--agent", "expert", "--episodes", "2", "--json",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    for text in (result.stdout, (tmp_path / "summary.json").read_text()):
        assert "Infinity" not in text and "NaN" not in text, text
        rows = json.loads(text)
        assert rows[0]["steps_per_second"] == 0.0 and rows[0]["measured"] == 0


# --------------------------------------------------------------- options and API arguments
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--retries", "-1"),
        ("--timeout", "-5"),
        ("--timeout", "0"),
        ("--max-tokens", "-5"),
        ("--max-tokens", "0"),
        ("--temperature", "-1"),
        ("--episodes", "0"),
        ("--samples", "0"),
    ],
)
def test_out_of_range_options_are_usage_errors_naming_the_option(option: str, value: str) -> None:
    with scripted_server(lambda body: completion("go")) as server:
        result = eval_cli(COUNTDOWN, "--model", server.url, "--episodes", "1", option, value)
        assert server.requests == []
    assert result.exit_code == 2, result.output
    assert option in result.stderr and "Traceback" not in result.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("arguments", "named"),
    [({"episodes": 0}, "episodes"), ({"episodes": -3}, "episodes"), ({"samples": 0}, "samples"),
     ({"seed": -1}, "seed")],
)  # fmt: skip
def test_evaluate_refuses_counts_that_play_nothing(arguments: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=f"{named} must be"):
        evaluate([COUNTDOWN], ["random"], **arguments)


@pytest.mark.timeout(60)
def test_a_kwarg_one_env_of_several_does_not_take_is_refused_before_playing(
    tmp_path: Path,
) -> None:
    result = eval_cli(
        "evalacct/sized-v0", COUNTDOWN, "-k", "size=4", "--agent", "expert", "--episodes", "2",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert f"{COUNTDOWN} got unexpected keyword argument(s) 'size'" in message
    assert "-k (env_kwargs) applies to every env" in message
    assert "envhub eval evalacct/sized-v0 -k size=4" in message
    assert not (tmp_path / "episodes.jsonl").exists() or not read_episodes(
        tmp_path / "episodes.jsonl"
    )  # nothing was played
