"""``envhub eval`` against envs, endpoints and output folders that misbehave: each test is one
thing a user could run into, and what they see (exit code, message, what ``--out`` holds)."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

import envhub
from envhub.eval_records import read_episodes
from envhub.evaluation import evaluate
from tests.envhub.eval_cli_helpers import eval_cli, summary_rows
from tests.helpers import CountdownEnv

COUNTDOWN = "evaltest/countdown-v0"
RELEASE = threading.Event()
"""Set at the end of a test to let the threads of hung envs return."""


class Exits(CountdownEnv):
    """Calls ``sys.exit()`` in ``step`` (as some game engines do on a 'quit' command)."""

    def on_step(self, action):
        sys.exit()


class IntKeys(CountdownEnv):
    """Reports scores by player number: int keys, as ``envhub check`` accepts."""

    def on_step(self, action):
        info = {"score_by_player": {0: 1.0, 1: 0.0}, "big": 2**70}
        return envhub.Turn("ok", terminated=True, success=True, info=info)


class Broken(CountdownEnv):
    """Cannot be built (a data file is missing)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        raise RuntimeError("cannot open data file levels.json")


class Hangs(CountdownEnv):
    """``step`` never returns (until the test sets ``RELEASE``)."""

    def on_step(self, action):
        RELEASE.wait()
        return envhub.Turn("late", terminated=True)


class HangsClosing(CountdownEnv):
    """``close`` never returns (until the test sets ``RELEASE``)."""

    def close(self) -> None:
        RELEASE.wait()
        super().close()


class Interrupted(CountdownEnv):
    """Ctrl-C arrives while it steps."""

    def on_step(self, action):
        raise KeyboardInterrupt


for _id, _entry in {
    COUNTDOWN: CountdownEnv,
    "evaltest/exits-v0": Exits,
    "evaltest/intkeys-v0": IntKeys,
    "evaltest/broken-v0": Broken,
    "evaltest/hangs-v0": Hangs,
    "evaltest/hangs-closing-v0": HangsClosing,
    "evaltest/interrupted-v0": Interrupted,
}.items():
    envhub.register(_id, _entry, max_turns=3)


@pytest.fixture(autouse=True)
def release_hung_envs() -> Iterator[None]:
    RELEASE.clear()
    yield
    RELEASE.set()


# -------------------------------------------------------------------- envs that misbehave
@pytest.mark.timeout(60)
def test_an_env_that_calls_sys_exit_fails_its_episodes_and_the_run_is_summarised(
    tmp_path: Path,
) -> None:
    result = eval_cli(
        COUNTDOWN, "evaltest/exits-v0", "--agent", "random", "--episodes", "3",
        "--out", str(tmp_path), "--json",
    )  # fmt: skip
    assert result.exit_code == 1, result.output  # a row that measured nothing is an error
    rows = summary_rows(tmp_path)
    assert rows["evaltest/exits-v0"]["failures"] == {"env_error": 3}
    assert rows[COUNTDOWN]["failures"] == {} and rows[COUNTDOWN]["episodes"] == 3
    assert "evaltest/exits-v0" in result.stderr and "SystemExit" in result.stderr
    exits = [e for e in read_episodes(tmp_path / "episodes.jsonl") if e.failure]
    assert len(exits) == 3 and all("SystemExit" in e.detail for e in exits)


@pytest.mark.timeout(60)
def test_info_with_int_keys_or_huge_ints_is_written_not_a_crash(tmp_path: Path) -> None:
    evaluate(["evaltest/intkeys-v0", COUNTDOWN], ["random"], episodes=2, out=tmp_path)
    episodes = read_episodes(tmp_path / "episodes.jsonl")
    assert len(episodes) == 4
    info = next(e.info for e in episodes if e.env_id == "evaltest/intkeys-v0")
    assert info["score_by_player"] == {"0": 1.0, "1": 0.0} and int(info["big"]) == 2**70


@pytest.mark.timeout(60)
def test_an_env_that_cannot_be_built_fails_its_episodes_and_the_others_are_played(
    tmp_path: Path,
) -> None:
    result = eval_cli(
        COUNTDOWN, "evaltest/broken-v0", "--agent", "random", "--episodes", "3",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert "evaltest/broken-v0" in result.stderr and "cannot open data file" in result.stderr
    rows = summary_rows(tmp_path)
    assert rows["evaltest/broken-v0"]["failures"] == {"env_error": 3}
    assert rows[COUNTDOWN]["episodes"] == 3 and rows[COUNTDOWN]["failures"] == {}


@pytest.mark.timeout(60)
def test_a_hung_episode_times_out_and_the_run_goes_on(tmp_path: Path) -> None:
    result = eval_cli(
        "evaltest/hangs-v0", COUNTDOWN, "--agent", "random", "--episodes", "2",
        "--episode-timeout", "0.5", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "--episode-timeout" in result.stderr
    rows = summary_rows(tmp_path)
    assert rows["evaltest/hangs-v0"]["failures"] == {"env_timeout": 2}
    assert rows[COUNTDOWN]["episodes"] == 2 and rows[COUNTDOWN]["failures"] == {}


@pytest.mark.timeout(60)
def test_an_env_whose_close_hangs_does_not_hang_the_run(tmp_path: Path) -> None:
    result = eval_cli(
        "evaltest/hangs-closing-v0", "--agent", "random", "--episodes", "2",
        "--episode-timeout", "0.5", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)
    assert row["episodes"] == 2 and row["failures"] == {}


HANGING_RUN = """
import threading, envhub
from envhub.cli import main
from tests.helpers import CountdownEnv

class Hangs(CountdownEnv):
    def on_step(self, action):
        threading.Event().wait()

envhub.register("evaltest/hangs-v0", Hangs, max_turns=3)
main(["eval", "evaltest/hangs-v0", "--agent", "random", "--episodes", "2",
      "--episode-timeout", "0.5", "--json"])
"""


@pytest.mark.timeout(120)
def test_the_process_exits_when_its_envs_are_still_hung() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HANGING_RUN],
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)[0]["failures"] == {"env_timeout": 2}


@pytest.mark.timeout(60)
def test_ctrl_c_says_that_resume_keeps_the_finished_episodes(tmp_path: Path) -> None:
    result = eval_cli(
        COUNTDOWN, "evaltest/interrupted-v0", "--agent", "random", "--episodes", "2",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 130, result.output
    assert "--resume" in result.stderr
    assert len(read_episodes(tmp_path / "episodes.jsonl")) == 2  # the countdown's, kept


@pytest.mark.timeout(60)
def test_an_env_id_given_twice_is_played_once() -> None:
    result = eval_cli(COUNTDOWN, COUNTDOWN, "--agent", "random", "--episodes", "2", "--json")
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)
    assert row["env_id"] == COUNTDOWN and row["episodes"] == 2


# ------------------------------------------------------------------------ the --out folder
@pytest.mark.timeout(60)
def test_a_second_run_into_the_same_out_needs_resume_or_overwrite(tmp_path: Path) -> None:
    args = [COUNTDOWN, "--agent", "random", "--episodes", "2", "--out", str(tmp_path)]
    assert eval_cli(*args).exit_code == 0
    again = eval_cli(*args)
    assert again.exit_code == 2, again.output
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    assert len(read_episodes(tmp_path / "episodes.jsonl")) == 2
    replaced = eval_cli(*args, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert len(read_episodes(tmp_path / "episodes.jsonl")) == 2
    both = eval_cli(*args, "--overwrite", "--resume")
    assert both.exit_code == 2 and "--overwrite" in both.stderr


@pytest.mark.timeout(60)
def test_resume_with_other_settings_is_refused_naming_what_differs(tmp_path: Path) -> None:
    args = [COUNTDOWN, "--agent", "random", "--out", str(tmp_path)]
    assert eval_cli(*args, "--episodes", "2", "--max-turns", "1").exit_code == 0
    assert json.loads((tmp_path / "eval.json").read_text())["settings"]["max_turns"] == 1
    other = eval_cli(*args, "--episodes", "3", "-k", "goal=stop", "--resume")
    assert other.exit_code == 2, other.output
    assert "max_turns" in other.stderr and "env_kwargs" in other.stderr
    assert len(read_episodes(tmp_path / "episodes.jsonl")) == 2
    same = eval_cli(*args, "--episodes", "3", "--max-turns", "1", "--resume")
    assert same.exit_code == 0, same.output
    assert len(read_episodes(tmp_path / "episodes.jsonl")) == 3


@pytest.mark.timeout(60)
def test_a_resumed_eval_is_viewed_with_its_new_episodes(tmp_path: Path) -> None:
    """A finished run's store part is its episodes then; while a resume plays more, the viewer
    reads ``episodes.jsonl`` (the part is written again at the end), not the stale part."""
    from envhub.eval_output import open_run as open_eval_out
    from envhub.runs import open_run

    evaluate([COUNTDOWN], ["random"], episodes=2, out=tmp_path)
    assert open_run(tmp_path).episodes().total == 2
    first = json.loads((tmp_path / "episodes.jsonl").read_text().splitlines()[0])
    writer = open_eval_out(tmp_path, json.loads((tmp_path / "eval.json").read_text()), resume=True)
    try:
        writer.write({**first, "seed": 12345})  # the resumed run's first new episode
    finally:
        writer.close()
    assert 12345 in {row["seed"] for row in open_run(tmp_path).episodes().rows}


@pytest.mark.timeout(60)
def test_resume_skips_lines_that_are_json_but_no_episode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    evaluate([COUNTDOWN], ["random"], episodes=2, out=tmp_path)
    with open(tmp_path / "episodes.jsonl", "ab") as f:
        f.write(b'[1, 2]\n"an episode"\nnull\n')
        bad = {**json.loads((tmp_path / "episodes.jsonl").read_text().splitlines()[0])}
        edited = [{**bad, "seed": 7, "failure": failure} for failure in (1, ["x"])]  # no reason
        f.writelines(json.dumps(record).encode() + b"\n" for record in edited)
    with caplog.at_level(logging.WARNING):
        [summary] = evaluate([COUNTDOWN], ["random"], episodes=3, out=tmp_path, resume=True)
    assert summary.episodes == 3
    assert "skipped 5 unreadable line(s)" in caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["under a file", "in /proc"])
def test_an_unusable_out_is_an_error_naming_it(tmp_path: Path, kind: str) -> None:
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "afile" / "sub" if kind == "under a file" else Path("/proc/envhub-out")
    result = eval_cli(COUNTDOWN, "--agent", "random", "--episodes", "1", "--out", str(out))
    assert result.exit_code == 2, result.output
    assert str(out) in result.stderr and "Traceback" not in result.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("option", "value"), [("--seed", "-1"), ("--max-turns", "-3")])
def test_negative_seeds_and_turns_are_refused(option: str, value: str) -> None:
    result = eval_cli(COUNTDOWN, "--agent", "random", "--episodes", "1", option, value)
    assert result.exit_code == 2, result.output
    assert option in result.output


# ------------------------------------------------------------------- endpoints that misbehave
@contextlib.contextmanager
def endpoint(models: Any, status: int = 200, chat_status: int = 200) -> Iterator[str]:
    """A server answering ``/v1/models`` with ``models`` (a body, or a string sent as HTML)
    and chat completions with ``chat_status`` (a real completion when 200)."""
    pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse

    from tests.envhub.openai_servers import completion, serve_app

    app = FastAPI()

    @app.get("/v1/models")
    def list_models() -> Any:
        if isinstance(models, str):
            return HTMLResponse(models, status_code=status)
        return JSONResponse(models, status_code=status)

    @app.post("/v1/chat/completions")
    def chat() -> Any:
        if chat_status != 200:
            return JSONResponse({"error": {"message": "engine died"}}, status_code=chat_status)
        return completion("go")

    with serve_app(app) as url:
        yield url


def model_eval(url: str, *args: str) -> Result:
    return eval_cli(COUNTDOWN, "--model", url, "--retries", "0", "--episodes", "2", *args)


MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}
UNAUTHORISED = {"error": {"message": "Incorrect API key provided"}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_api_key_is_fatal_and_names_the_key_variable(status: int) -> None:
    with endpoint(UNAUTHORISED, status=status) as url:
        for args in ([], ["--model-name", "m"]):
            result = model_eval(f"{url}/v1", *args)
            assert result.exit_code == 2, result.output
            assert "$OPENAI_API_KEY" in result.stderr and "--api-key-env" in result.stderr


@pytest.mark.timeout(60)
def test_a_url_without_v1_is_told_to_end_in_v1() -> None:
    with endpoint(MODELS) as url:
        result = model_eval(url)
    assert result.exit_code == 2, result.output
    assert "/v1" in result.stderr and "404" in result.stderr


@pytest.mark.timeout(60)
def test_a_run_whose_every_episode_failed_at_the_endpoint_exits_non_zero(tmp_path: Path) -> None:
    with endpoint(MODELS, chat_status=500) as url:
        result = model_eval(f"{url}/v1", "--out", str(tmp_path))
    assert result.exit_code == 1, result.output
    assert "every episode failed at the endpoint" in result.stderr and "http_500" in result.stderr
    assert summary_rows(tmp_path)[COUNTDOWN]["failures"] == {"http_500": 2}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "models", ["<html><body>Open WebUI</body></html>", ["m"], {"data": "m"}], ids=str
)
def test_an_endpoint_that_is_no_openai_api_is_refused_before_playing(models: Any) -> None:
    with endpoint(models) as url:
        result = model_eval(f"{url}/v1")
    assert result.exit_code == 2, result.output
    assert "did not answer like an OpenAI /v1 API" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.timeout(60)
def test_models_listed_without_ids_need_a_model_name() -> None:
    with endpoint({"object": "list", "data": [{"object": "model"}]}) as url:
        refused = model_eval(f"{url}/v1")
        named = model_eval(f"{url}/v1", "--model-name", "m")
    assert refused.exit_code == 2 and "--model-name" in refused.stderr, refused.output
    assert named.exit_code == 0, named.output
