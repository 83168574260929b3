"""The trajectory store and ``envhub view``'s API: what a user browsing a run relies on.

Filters return exactly the matching episodes, pages add up, a part that is torn or corrupted
is named and skipped (the rest still reads), rewriting a step never duplicates it, env text is
returned as data, and a viewer bound with a token refuses requests without it.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")

import envhub.runs
from envhub.runs import NotARunError, TrajectoryWriter, write_part

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
    client = TestClient(create_app([tmp_path], token="s3cret"), base_url="http://127.0.0.1:8080")
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


# ---------------------------------------------------------------- what a writer may be handed
def test_one_bad_record_costs_only_its_bad_value_not_the_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An env's exception text with a lone surrogate, or a seed past int64, is one value: the
    other episodes of the step, and the rest of that episode, are stored."""
    records = [record(i, 1) for i in range(20)]
    records[3]["failure"] = "boom \udcff"
    records[5]["env_id"] = "x\ud800"
    records[7]["seed"] = 2**63
    writer = TrajectoryWriter(tmp_path)
    writer.write("train", 1, records)
    writer.close()
    assert writer.errors == []
    run = envhub.runs.open(tmp_path)
    assert run.episodes(limit=None).total == 20
    assert run.episode("train:1:3")["failure"] == "boom \ufffd"
    assert run.episode("train:1:5")["env_id"] == "x\ufffd"
    seventh = run.episode("train:1:7")
    assert seventh["seed"] is None and seventh["messages"][1]["content"] == "up"
    assert "train:1:7" in caplog.text and "seed" in caplog.text and str(2**63) in caplog.text


def test_a_killed_writers_temporary_file_is_removed_when_a_writer_starts(tmp_path: Path) -> None:
    store = tmp_path / "trajectories"
    store.mkdir()
    dead = store / ".train-000000002.parquet.99999999.1.tmp"  # no process has this pid
    dead.write_bytes(b"half written")
    live = store / f".train-000000003.parquet.{os.getpid()}.1.tmp"  # a writer still running
    live.write_bytes(b"being written")
    TrajectoryWriter(tmp_path).close()
    assert not dead.exists() and live.exists()


def test_a_part_is_on_disk_before_its_name_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The part's bytes are synced before the rename and the folder after it, so a power cut
    leaves the old part or the new one, never a named empty file."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync file")
        real_fsync(fd)

    def replace(source: Any, target: Any) -> None:
        events.append("rename")
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_part(tmp_path, "train", 1, [record(0, 1)])
    assert events == ["fsync file", "rename", "fsync dir"]


# ---------------------------------------------------------------- what a reader may find
def test_bad_eval_lines_are_named_and_the_rest_is_read(tmp_path: Path) -> None:
    good = json.dumps({"env_id": "e", "seed": 1, "rewards": [1.0], "success": True})
    lines = [good, "[1, 2]", '{"env_id": "e", "seed": "abc"}', '{"env_id": "e", "rewards": ["x"]}']
    (tmp_path / "episodes.jsonl").write_text("\n".join([*lines, good]) + "\n")
    run = envhub.runs.open(tmp_path)
    page = run.episodes(limit=None)
    assert page.total == 3  # both good lines, and the one whose seed is text (seed left out)
    assert [r["seed"] for r in page.rows] == [1, None, 1]
    assert any("episodes.jsonl line 2" in p and "not an object" in p for p in run.problems)
    assert any("episodes.jsonl line 3" in p and "seed" in p for p in run.problems)
    assert any("episodes.jsonl line 4" in p for p in run.problems)


def test_a_part_deleted_while_the_table_is_read_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep_last prunes a part between the reader's listing and its read: the page still
    answers, from the parts that are there."""
    write_run(tmp_path, steps=3, per_step=4)
    run = envhub.runs.open(tmp_path)
    stale = run.parts()  # listed ...
    (tmp_path / "trajectories" / "train-000000001.parquet").unlink()  # ... then pruned
    fresh = run.parts
    calls = iter([stale])
    monkeypatch.setattr(run, "parts", lambda: next(calls, None) or fresh())
    assert run.episodes(kind="train", limit=None).total == 8


def test_a_poll_reads_only_the_parts_that_are_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page polls the episode table every few seconds; a large run must not be re-read
    whole each time: a part is read once per version of its file."""
    from envhub.runs import reader

    write_run(tmp_path, steps=3, per_step=4)
    run = envhub.runs.open(tmp_path)
    read: list[str] = []
    real = reader.read_light

    def counted(path: Path) -> Any:
        read.append(path.name)
        return real(path)

    monkeypatch.setattr(reader, "read_light", counted)
    assert run.episodes(limit=1).total == 16 and len(read) == 4  # every part, once
    assert run.episodes(kind="train", limit=1).total == 12 and len(read) == 4  # none again
    write_part(tmp_path / "trajectories", "train", 4, [record(i, 4) for i in range(4)])
    assert run.episodes(limit=1).total == 20 and read[4:] == ["train-000000004.parquet"]
