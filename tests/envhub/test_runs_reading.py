"""Reading a run that is large, damaged or odd: what a user of ``envhub.runs`` would notice.

A part whose footer is whole but whose data is damaged (bit rot, a copy cut short, another
tool's file with other column types) is named and left out, and the other parts still read;
opening one episode reads the one part its key names, not the whole store; filter values past
int64 are refused naming the filter; and a folder of runs opens as its runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")
import pyarrow as pa
import pyarrow.parquet as pq

import envhub.runs
from envhub.runs import NotARunError, write_part
from tests.envhub.test_runs import record, write_run


def damage_column(path: Path, column: str) -> None:
    """Flip the bytes of ``column``'s first data page, leaving the footer whole (so the part
    passes a footer check and fails only when that column is read)."""
    data = bytearray(path.read_bytes())
    meta = pq.read_metadata(path)
    paths = [meta.row_group(0).column(i).path_in_schema for i in range(meta.num_columns)]
    chunk = meta.row_group(0).column(
        next(i for i, p in enumerate(paths) if p.split(".")[0] == column)
    )
    start = chunk.data_page_offset
    for k in range(start + 8, start + chunk.total_compressed_size):
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))


def three_parts(folder: Path) -> Path:
    for step in (1, 2, 3):
        write_part(folder / "trajectories", "train", step, [record(i, step) for i in range(8)])
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return folder


def test_a_part_with_a_damaged_data_page_is_named_and_the_rest_reads(tmp_path: Path) -> None:
    run_dir = three_parts(tmp_path)
    damage_column(run_dir / "trajectories" / "train-000000002.parquet", "return")
    run = envhub.runs.open(run_dir)
    page = run.episodes(limit=None)
    assert page.total == 16 and {r["step"] for r in page.rows} == {1, 3}
    assert any(p.startswith("train-000000002.parquet: unreadable") for p in run.problems)
    assert run.episode("train:3:0")["messages"][1]["content"] == "up"


def test_a_damaged_token_column_fails_that_episode_only_with_its_reason(tmp_path: Path) -> None:
    """The table reads the small columns; the damage is in the tokens: the table still lists
    the part's episodes, and opening one of them says which file cannot be read."""
    run_dir = three_parts(tmp_path)
    damage_column(run_dir / "trajectories" / "train-000000002.parquet", "token_ids")
    run = envhub.runs.open(run_dir)
    assert run.episodes(limit=None).total == 24
    with pytest.raises(KeyError, match=r"train:2:0: train-000000002.parquet is unreadable"):
        run.episode("train:2:0")
    assert run.episode("train:1:0")["token_ids"] == [1, 2, 3, 4, 5, 6]


def test_a_part_whose_columns_have_other_types_is_named_and_left_out(tmp_path: Path) -> None:
    """A part another tool wrote, with ``seed`` as text: left out, named, never a failed read."""
    run_dir = three_parts(tmp_path)
    rows = [{**record(i, 4), "kind": "train", "step": 4, "index": i} for i in range(3)]
    for row in rows:
        row["seed"] = f"seed-{row['seed']}"
    pq.write_table(pa.Table.from_pylist(rows), run_dir / "trajectories" / "train-000000004.parquet")
    run = envhub.runs.open(run_dir)
    assert run.episodes(limit=None).total == 24
    assert any(p.startswith("train-000000004.parquet: unreadable") for p in run.problems)


def test_opening_an_episode_reads_only_the_part_its_key_names(tmp_path: Path) -> None:
    """On a run of thousands of parts, listing the store (a stat and a footer per part) is the
    seconds a click took: ``episode`` goes to ``trajectories/train-000000002.parquet`` directly."""
    run = envhub.runs.open(three_parts(tmp_path))

    def listed() -> list[Path]:
        raise AssertionError("episode() listed every part of the store")

    run.parts = listed  # type: ignore[method-assign]
    episode = run.episode("train:2:5")
    assert (episode["key"], episode["step"], episode["index"]) == ("train:2:5", 2, 5)
    with pytest.raises(KeyError, match="no episode 'train:2:99'"):
        run.episode("train:2:99")


def test_an_eval_folder_without_a_store_opens_episodes_from_its_jsonl(tmp_path: Path) -> None:
    line = {"env_id": "e", "seed": 3, "rewards": [1.0], "success": True, "agent": "expert"}
    (tmp_path / "episodes.jsonl").write_text(json.dumps(line) + "\n")
    episode = envhub.runs.open(tmp_path).episode("envhub-eval:0:0")
    assert (episode["seed"], episode["agent"]) == (3, "expert")


@pytest.mark.parametrize(
    ("filters", "named"),
    [
        ({"seed": 2**64}, "seed"),
        ({"step": -(2**63) - 1}, "step"),
        ({"min_tokens": 2**70}, "min_tokens"),
    ],
)
def test_a_filter_past_int64_is_refused_naming_it(
    tmp_path: Path, filters: dict[str, int], named: str
) -> None:
    run = envhub.runs.open(three_parts(tmp_path))
    with pytest.raises(ValueError, match=f"^{named}=.* is not a whole number in int64 range"):
        run.episodes(**filters)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["train:99999999999999999999:0", "train:1:99999999999999999999"])
def test_an_episode_key_past_int64_is_no_episode(tmp_path: Path, key: str) -> None:
    run = envhub.runs.open(three_parts(tmp_path))
    with pytest.raises(KeyError, match="is not an episode key"):
        run.episode(key)


def test_env_matches_part_of_the_id_and_agent_and_values_are_listed(tmp_path: Path) -> None:
    records = [record(i, 1) for i in range(6)]
    for i, row in enumerate(records):
        row["agent"] = "random" if i % 2 else "expert"
    write_part(tmp_path / "trajectories", "envhub-eval", 0, records)
    run = envhub.runs.open(tmp_path)
    lake = run.episodes(env_contains="FROZEN", limit=None)
    assert lake.total == 3 and {r["env_id"] for r in lake.rows} == {"games/frozen-lake-v0"}
    experts = run.episodes(agent="expert", limit=None)
    assert experts.total == 3 and {r["agent"] for r in experts.rows} == {"expert"}
    assert run.values("agent") == ["expert", "random"]
    assert run.values("env_id") == ["games/frozen-lake-v0", "tools/sql-v0"]


def test_a_folder_of_runs_opens_as_its_runs_and_skips_what_is_no_run(tmp_path: Path) -> None:
    from envhub.runs.reader import find_runs

    for name in ("b", "a"):
        write_run(tmp_path / name, steps=1, per_step=2)
    (tmp_path / "notes").mkdir()  # a stray folder beside the runs
    assert [p.name for p in find_runs(tmp_path)] == ["a", "b"]
    assert find_runs(tmp_path / "a") == [tmp_path / "a"]
    with pytest.raises(NotARunError, match="is not a run"):
        find_runs(tmp_path / "notes")
