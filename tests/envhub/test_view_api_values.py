"""``envhub view``'s API on the values a run can hold and the answers a page polls for.

A damaged part never makes a bare server error, the episode answer carries a version that
changes whenever the set of parts does (not only the count), NaN and infinity are shown as such
and sorted after every number, a bad filter value is refused naming its parameter, a poll of
the metrics sends only the rows after the page's last step, an eval run's agents can be
filtered, and a folder of runs is opened as its runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")
pytest.importorskip("starlette", reason="needs the view extra: pip install -e '.[view]'")
from starlette.testclient import TestClient

from envhub.runs import write_part
from envhub.view import create_app
from tests.envhub.test_runs import record, write_run
from tests.envhub.test_runs_reading import damage_column, three_parts

LOCAL = "http://127.0.0.1:8080"


def client(*paths: Path) -> TestClient:
    return TestClient(create_app(list(paths)), base_url=LOCAL, raise_server_exceptions=False)


# ---------------------------------------------------------------- 1. damage
def test_a_damaged_part_is_listed_in_problems_and_the_table_still_answers(tmp_path: Path) -> None:
    damage_column(three_parts(tmp_path) / "trajectories" / "train-000000002.parquet", "return")
    viewer = client(tmp_path)
    page = viewer.get("/api/episodes")
    assert page.status_code == 200, page.text
    assert page.json()["total"] == 16
    assert any("train-000000002.parquet: unreadable" in p for p in page.json()["problems"])


def test_an_unexpected_error_is_a_json_answer_that_says_what_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from envhub.runs.reader import Run

    def broken(self: Run, **_: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Run, "episodes", broken)
    response = client(three_parts(tmp_path)).get("/api/episodes")
    assert response.status_code == 500
    assert response.json() == {"error": "RuntimeError: disk on fire"}


# ---------------------------------------------------------------- 2. a version of the store
def test_the_version_changes_when_the_parts_change_though_the_total_does_not(
    tmp_path: Path,
) -> None:
    """With ``keep_last`` each step adds one part and prunes one: the total stays, the version
    (what the page's poll compares) does not."""
    viewer = client(three_parts(tmp_path))
    before = viewer.get("/api/episodes", params={"limit": 1}).json()
    assert viewer.get("/api/episodes", params={"limit": 1}).json()["version"] == before["version"]
    write_part(tmp_path / "trajectories", "train", 4, [record(i, 4) for i in range(8)])
    (tmp_path / "trajectories" / "train-000000001.parquet").unlink()
    after = viewer.get("/api/episodes", params={"limit": 1}).json()
    assert after["total"] == before["total"] == 24
    assert after["version"] != before["version"]


# ---------------------------------------------------------------- 7. NaN and infinity
def test_nan_and_infinity_are_shown_as_such_and_sorted_after_every_number(tmp_path: Path) -> None:
    rows = [record(i, 1) for i in range(7)]
    returns = [0.0, float("nan"), float("inf"), None, float("-inf"), 5.0, 4.0]
    for row, value in zip(rows, returns, strict=True):
        row["return"] = value
    write_part(tmp_path / "trajectories", "train", 1, rows)
    viewer = client(tmp_path)
    for desc, finite in (("false", [0.0, 4.0, 5.0]), ("true", [5.0, 4.0, 0.0])):
        shown = [
            r["return"]
            for r in viewer.get("/api/episodes", params={"sort": "return", "desc": desc}).json()[
                "rows"
            ]
        ]
        assert shown[:3] == finite, shown  # the best (or worst) first is a number
        assert sorted(shown[3:6]) == ["-inf", "NaN", "inf"] and shown[6] is None, shown


def test_a_summary_with_nan_shows_nan(tmp_path: Path) -> None:
    write_run(tmp_path, steps=1, per_step=2)
    (tmp_path / "summary.json").write_text(
        '[{"env_id": "x", "success": NaN, "n": 2, "failures": {"timeout": 1}}]'
    )
    response = client(tmp_path).get("/api/summary")
    assert response.status_code == 200
    assert response.json() == [
        {"env_id": "x", "success": "NaN", "n": 2, "failures": {"timeout": 1}}
    ]


def test_a_metric_that_went_nan_is_sent_as_a_gap_not_dropped(tmp_path: Path) -> None:
    lines = ['{"step": 4, "loss": 1.0}', '{"step": 5, "loss": null}', '{"step": 6, "loss": NaN}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    body = client(tmp_path).get("/api/metrics").json()
    assert body["keys"] == ["loss"]
    assert [r.get("loss", "absent") for r in body["rows"]] == [1.0, None, "NaN"]


# ---------------------------------------------------------------- 8. parameters
@pytest.mark.parametrize(
    ("path", "params", "status", "message"),
    [
        ("/api/episodes", {"seed": str(2**64)}, 400, "seed='18446744073709551616' is not a whole"),
        ("/api/episodes", {"step": "99999999999999999999"}, 400, "step='99999999999999999999'"),
        ("/api/episodes", {"min_tokens": str(2**70)}, 400, "min_tokens="),
        ("/api/episodes", {"step": "10-20"}, 400, "step='10-20' is not a whole number"),
        ("/api/episodes", {"min_return": "abc"}, 400, "min_return='abc' is not a number"),
        ("/api/episodes", {"limit": str(10**30)}, 400, "limit="),
        ("/api/episode", {"key": "train:99999999999999999999:0"}, 404, "is not an episode key"),
        ("/api/episode", {"key": "train:1:99999999999999999999"}, 404, "is not an episode key"),
        ("/api/metrics", {"after": "x"}, 400, "after='x' is not a whole number"),
    ],
)
def test_a_bad_value_is_refused_naming_its_parameter(
    tmp_path: Path, path: str, params: dict[str, str], status: int, message: str
) -> None:
    response = client(three_parts(tmp_path)).get(path, params=params)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error, error
    assert error.count("'") % 2 == 0, error  # quotes come in pairs


# ---------------------------------------------------------------- 12. metrics polls
def test_a_metrics_poll_sends_only_the_rows_after_the_pages_last_step(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(5)))
    viewer = client(tmp_path)
    first = viewer.get("/api/metrics").json()
    assert [r["step"] for r in first["rows"]] == [0, 1, 2, 3, 4] and first["full"]
    with metrics.open("a") as file:
        file.write(json.dumps({"step": 5, "x": 5, "y": 1}) + "\n")
    since = {"after": 4, "file": first["file"]}
    poll = viewer.get("/api/metrics", params=since).json()
    assert [r["step"] for r in poll["rows"]] == [5] and not poll["full"]
    assert poll["keys"] == ["x", "y"]
    # a resumed run rewrites the file (truncated at its checkpoint): the page gets it all again
    replaced = tmp_path / ".metrics.tmp"
    replaced.write_text("".join(json.dumps({"step": s, "x": -s}) + "\n" for s in range(3)))
    os.replace(replaced, metrics)
    again = viewer.get("/api/metrics", params=since).json()
    assert again["full"] and [r["x"] for r in again["rows"]] == [0, -1, -2]


# ---------------------------------------------------------------- 5 and 13. eval runs
def test_an_eval_runs_agents_can_be_filtered_and_the_values_are_listed(tmp_path: Path) -> None:
    records = [record(i, 1) for i in range(6)]
    for i, row in enumerate(records):
        row["agent"] = "random" if i % 2 else "expert"
    write_part(tmp_path / "trajectories", "envhub-eval", 0, records)
    viewer = client(tmp_path)
    page = viewer.get("/api/episodes", params={"agent": "random", "env": "lake"}).json()
    assert page["total"] == 3 and {r["agent"] for r in page["rows"]} == {"random"}
    assert page["choices"] == {
        "agent": ["expert", "random"],
        "env_id": ["games/frozen-lake-v0", "tools/sql-v0"],
    }


def test_a_folder_of_runs_is_shown_as_its_runs(tmp_path: Path) -> None:
    for name in ("b", "a"):
        write_run(tmp_path / name, steps=1, per_step=2)
    (tmp_path / "notes").mkdir()
    runs = client(tmp_path).get("/api/runs").json()
    assert [r["name"] for r in runs] == ["a", "b"]


def test_the_link_printed_for_a_public_host_names_this_machine() -> None:
    import socket

    from envhub.view.cli import link

    assert link("0.0.0.0", 8080, "T") == f"http://{socket.gethostname()}:8080/?token=T"
    assert link("127.0.0.1", 8080, None) == "http://127.0.0.1:8080/"
    assert link("::1", 80, None) == "http://[::1]:80/"
