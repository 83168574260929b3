"""The trajectory store and ``envhub view``'s API: what a user browsing a run relies on.

Filters return exactly the matching episodes, pages add up, a part that is torn or corrupted
is named and skipped (the rest still reads), rewriting a step never duplicates it, env text is
returned as data, and a viewer bound with a token refuses requests without it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")

import envhub.runs
from envhub.runs import NotARunError, TrajectoryWriter

SCRIPT = "<script>alert(1)</script>"


def record(i: int, step: int) -> dict[str, Any]:
    won = i % 3 == 0
    return {
        "env_id": "games/frozen-lake-v0" if i % 2 else "tools/sql-v0",
        "seed": 100 + i % 4,
        "group_id": i // 2,
        "success": won,
        "failed": False,
        "return": float(won) - 0.01 * i,
        "turns": 1 + i % 3,
        "tokens": 6,
        "messages": json.dumps(
            [
                {"role": "user", "content": f"map {i} {SCRIPT}"},
                {"role": "assistant", "content": "up"},
            ]
        ),
        "info": "{}",
        "token_ids": [1, 2, 3, 4, 5, 6],
        "response_mask": [0, 0, 0, 1, 1, 0],
        "logprobs": [0.0, 0.0, 0.0, -0.1, -0.7, 0.0],
        "advantages": [0.0, 0.0, 0.0, 0.5, 0.5, 0.0],
        "row_starts": [0],
        "turn_rewards": [float(won)],
    }


def write_run(folder: Path, steps: int = 3, per_step: int = 12) -> None:
    writer = TrajectoryWriter(folder)
    for step in range(1, steps + 1):
        writer.write("train", step, [record(i, step) for i in range(per_step)])
    writer.write("eval", 0, [record(i, 0) for i in range(4)])
    writer.close()
    rows = [{"step": s, "time_s": 2.0 * s, "train/success": s / 10} for s in range(steps + 1)]
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 9, "tor')


def test_filters_sorting_and_pages_return_exactly_the_matching_episodes(tmp_path: Path) -> None:
    write_run(tmp_path)
    run = envhub.runs.open(tmp_path)
    assert run.kinds == ["eval", "train"] and run.steps() == [1, 2, 3]
    assert [r["step"] for r in run.metrics()] == [0, 1, 2, 3]  # the torn last line is skipped
    failures = run.episodes(kind="train", success=False, limit=None)
    assert failures.total == 3 * 8 and all(not r["success"] for r in failures.rows)
    page = run.episodes(kind="train", sort="return", descending=True, offset=30, limit=10)
    assert page.total == 36 and len(page.rows) == 6
    returns = [r["return"] for r in run.episodes(kind="train", sort="return", limit=None).rows]
    assert returns == sorted(returns)
    lake = run.episodes(env_id="games/frozen-lake-v0", seed=101, step=2, limit=None)
    assert {(r["env_id"], r["seed"], r["step"]) for r in lake.rows} == {
        ("games/frozen-lake-v0", 101, 2)
    }
    episode = run.episode(lake.rows[0]["key"])
    assert episode["response_mask"] == [0, 0, 0, 1, 1, 0]
    assert SCRIPT in episode["messages"][0]["content"]  # stored as the env wrote it
    with pytest.raises(KeyError, match="no episode"):
        run.episode("train:99:0")


def test_a_corrupted_part_is_named_and_skipped_and_rewrites_never_duplicate(tmp_path: Path) -> None:
    write_run(tmp_path)
    store = tmp_path / "trajectories"
    (store / "train-000000002.parquet").write_bytes(b"PAR1 torn by a kill")
    (store / ".train-000000004.parquet.1.2.tmp").write_bytes(b"half written")
    run = envhub.runs.open(tmp_path)
    assert run.episodes(kind="train", limit=None).total == 24  # steps 1 and 3
    assert any("train-000000002.parquet: unreadable" in p for p in run.problems)
    writer = TrajectoryWriter(tmp_path, keep_last=2)
    writer.write("train", 3, [record(i, 3) for i in range(5)])  # step 3 again (a resume)
    writer.write("train", 4, [record(i, 4) for i in range(5)])
    writer.close()
    run = envhub.runs.open(tmp_path)
    assert run.steps() == [3, 4]  # keep_last: the older parts are gone
    assert run.episodes(step=3, limit=None).total == 5  # replaced, not appended
    writer = TrajectoryWriter(tmp_path)
    writer.truncate_after(3)
    writer.close()
    assert envhub.runs.open(tmp_path).steps() == [3]


def test_sampling_keeps_a_fraction_or_a_count(tmp_path: Path) -> None:
    writer = TrajectoryWriter(tmp_path, sample=0.25)
    writer.write("train", 1, [record(i, 1) for i in range(40)])
    writer.close()
    writer = TrajectoryWriter(tmp_path, sample=3)
    writer.write("train", 2, [record(i, 2) for i in range(40)])
    writer.close()
    run = envhub.runs.open(tmp_path)
    assert run.episodes(step=1).total == 10 and run.episodes(step=2).total == 3


def test_a_folder_that_is_not_a_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NotARunError, match="is not a run: it has none of metrics.jsonl"):
        envhub.runs.open(tmp_path)
    with pytest.raises(NotARunError, match="is not a folder"):
        envhub.runs.open(tmp_path / "missing")


def test_the_viewer_api_pages_filters_and_refuses_requests_without_its_token(
    tmp_path: Path,
) -> None:
    from starlette.testclient import TestClient

    from envhub.view import create_app

    write_run(tmp_path)
    client = TestClient(create_app([tmp_path], token="s3cret"))
    assert client.get("/api/runs").status_code == 401
    assert client.get("/").status_code == 401
    auth = {"token": "s3cret"}
    assert client.get("/", params=auth).status_code == 200
    page = client.get("/api/episodes", params={**auth, "success": "false", "kind": "train"}).json()
    assert page["total"] == 24 and all(not r["success"] for r in page["rows"])
    key = page["rows"][0]["key"]
    episode = client.get("/api/episode", params={**auth, "key": key}).json()
    assert [t["policy"] for t in episode["tokens"]] == [False, False, False, True, True, False]
    assert episode["tokens"][4]["logprob"] == pytest.approx(-0.7)
    assert episode["tokens"][3]["advantage"] == pytest.approx(0.5)
    assert f"--replay {tmp_path} --episode {key}" in episode["replay"]
    metrics = client.get("/api/metrics", params=auth).json()
    assert metrics["keys"] == ["train/success"] and len(metrics["rows"]) == 4
    bad = client.get("/api/episodes", params={**auth, "sort": "messages"})
    assert bad.status_code == 400 and "cannot sort by 'messages'" in bad.json()["error"]
    assert client.get("/api/episodes", params={**auth, "run": 7}).status_code == 404


def test_replaying_a_stored_episode_ends_as_the_episode_did(quickstart_run: Path) -> None:
    from click.testing import CliRunner

    from envhub.cli import main
    from envhub.view.app import Viewer

    run = envhub.runs.open(quickstart_run)
    for row in run.episodes(kind="eval", step=4, limit=3).rows:
        episode = run.episode(row["key"])
        command = Viewer.replay_command(run, episode)  # what the page shows
        assert "-k size=3" in command  # the run's env kwargs, from its config
        result = CliRunner().invoke(main, shlex.split(command)[1:])
        assert result.exit_code == 0, result.output
        outcome = f"Return {episode['return']:+.2f} in {episode['turns']} turns."
        assert outcome in result.output, (outcome, result.output[-800:])
        # typed by hand, without the seed and kwargs: the stored episode's own are used
        short = ["play", str(episode["env_id"]), "--replay", str(quickstart_run)]
        result = CliRunner().invoke(main, [*short, "--episode", row["key"]])
        assert result.exit_code == 0 and outcome in result.output, result.output[-800:]


def test_view_refuses_a_public_host_without_a_token_and_a_folder_that_is_no_run(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from envhub.cli import main

    result = CliRunner().invoke(main, ["view", str(tmp_path), "--host", "0.0.0.0"])
    assert result.exit_code != 0 and "add --token SECRET" in result.output
    result = CliRunner().invoke(main, ["view", str(tmp_path)])
    assert result.exit_code != 0 and "is not a run" in result.output
    bad = CliRunner().invoke(main, ["play", "games/frozen-lake-v0", "--replay", str(tmp_path)])
    assert bad.exit_code != 0 and "--replay RUN_DIR needs --episode KEY" in bad.output
