"""``envhub view``'s HTTP API under hostile conditions: what a user (or an attacker) would notice.

A website the user visits cannot read runs by rebinding its name to 127.0.0.1, every response
carries headers that keep the page from being framed or sniffed, a run with NaN or infinity in
it still answers (as null, or as text where the page shows text), a slow request does not stall
the others, odd files in a run folder do not hang the server, and malformed parameters are
refused with a message naming the fix.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")
pytest.importorskip("starlette", reason="needs the view extra: pip install -e '.[view]'")
from starlette.testclient import TestClient

from envhub.runs import write_part
from envhub.view import create_app
from tests.envhub.openai_servers import serve_app
from tests.envhub.test_runs import record, write_run

LOCAL = "http://127.0.0.1:8080"


def client(*paths: Path, **kwargs: Any) -> TestClient:
    """A client that talks to the app as a browser on this machine does (Host 127.0.0.1)."""
    return TestClient(create_app(list(paths), **kwargs), base_url=LOCAL)


def one_part(folder: Path, change: dict[str, Any]) -> Path:
    records = [record(i, 1) for i in range(3)]
    records[0].update(change)
    write_part(folder / "trajectories", "train", 1, records)
    return folder


# ---------------------------------------------------------------- 1. DNS rebinding, headers
@pytest.mark.parametrize(
    "host", ["127.0.0.1:8080", "localhost:8080", "[::1]:8080", "localhost", "127.0.0.1"]
)
def test_loopback_names_are_served(tmp_path: Path, host: str) -> None:
    write_run(tmp_path, steps=1, per_step=2)
    response = client(tmp_path).get("/api/runs", headers={"Host": host})
    assert response.status_code == 200, response.text


def test_a_rebound_hostname_cannot_read_runs(tmp_path: Path) -> None:
    """attacker.example resolving to 127.0.0.1 sends ``Host: attacker.example``: refused."""
    write_run(tmp_path, steps=1, per_step=2)
    viewer = client(tmp_path)
    for path in ("/api/runs", "/api/episode?key=train:1:0", "/"):
        response = viewer.get(path, headers={"Host": "attacker.example:8080"})
        assert response.status_code == 400 and "train" not in response.text, path


def test_the_host_given_to_bind_is_accepted_too(tmp_path: Path) -> None:
    write_run(tmp_path, steps=1, per_step=2)
    viewer = client(tmp_path, host="::1")
    assert viewer.get("/api/runs", headers={"Host": "[::1]:9000"}).status_code == 200
    assert viewer.get("/api/runs", headers={"Host": "evil.example"}).status_code == 400


def test_every_response_carries_the_security_headers(tmp_path: Path) -> None:
    write_run(tmp_path, steps=1, per_step=2)
    viewer = client(tmp_path)
    responses = [
        viewer.get("/"),
        viewer.get("/static/viewer.js"),
        viewer.get("/api/runs"),
        viewer.get("/api/episodes", params={"sort": "messages"}),  # an error
        viewer.get("/api/runs", headers={"Host": "evil.example"}),  # refused by host
    ]
    for response in responses:
        policy = response.headers.get("content-security-policy", "")
        assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert response.headers.get("x-content-type-options") == "nosniff"


# ---------------------------------------------------------------- 2. non-finite numbers
@pytest.mark.parametrize(
    "change",
    [
        {"info": json.dumps({"score": float("nan")})},
        {"turn_rewards": [float("nan")]},
        {"time_s": float("nan")},
        {"logprobs": [0.0, 0.0, 0.0, float("-inf"), -0.7, 0.0]},
    ],
    ids=["info", "turn_rewards", "time_s", "logprobs"],
)
def test_nan_and_infinity_reach_the_page_as_null_or_text(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    """Per-token values and env info as null; what the page shows as text (rewards) as NaN."""
    viewer = client(one_part(tmp_path, change))
    page = viewer.get("/api/episodes")
    assert page.status_code == 200 and page.json()["total"] == 3, page.text
    episode = viewer.get("/api/episode", params={"key": "train:1:0"})
    assert episode.status_code == 200, episode.text
    body = episode.json()
    if "info" in change:
        assert body["info"] == {"score": None}
    if "turn_rewards" in change:
        assert body["turn_rewards"] == ["NaN"]
    if "logprobs" in change:
        assert body["tokens"][3]["logprob"] is None and body["tokens"][4]["logprob"] is not None


# ---------------------------------------------------------------- 4. what a run folder holds
def test_a_huge_integer_in_metrics_is_left_out_not_a_server_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "x": 1}\n{"step": 2, "x": ' + "9" * 400 + "}\n"
    )
    response = TestClient(create_app([tmp_path]), base_url=LOCAL, raise_server_exceptions=False)
    metrics = response.get("/api/metrics")
    assert metrics.status_code == 200, metrics.text
    assert [row.get("x") for row in metrics.json()["rows"]] == [1, None]


@pytest.mark.parametrize("name", ["metrics.jsonl", "episodes.jsonl", "summary.json"])
def test_a_fifo_in_the_run_folder_does_not_hang_the_viewer(tmp_path: Path, name: str) -> None:
    """Reading a FIFO (or a device) waits forever; the viewer reads regular files only and
    names the others as problems."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n')
    write_part(tmp_path / "trajectories", "train", 1, [record(0, 1)])
    (tmp_path / name).unlink(missing_ok=True)
    fifos = [tmp_path / name, tmp_path / "trajectories" / "train-000000002.parquet"]
    for fifo in fifos:
        os.mkfifo(fifo)
    try:
        with serve_app(create_app([tmp_path])) as url:
            answers = {}
            for path in ("/api/metrics", "/api/episodes", "/api/summary", "/api/runs"):
                with urllib.request.urlopen(url + path, timeout=20) as answer:
                    answers[path] = json.loads(answer.read())
    finally:
        for fifo in fifos:  # wake a reader the bug left waiting, so the server can stop
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # nobody is reading it: nothing to wake
    problems = answers["/api/runs"][0]["problems"]
    assert any("train-000000002.parquet: not a regular file" in p for p in problems), problems
    if name != "episodes.jsonl":  # (the store has a part: episodes.jsonl is not read)
        assert any(f"{name}: not a regular file" in p for p in problems), problems


# ---------------------------------------------------------------- 6. one slow request
def test_a_slow_request_does_not_stall_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one request is stuck reading a run, the page's other requests are answered."""
    from envhub.runs.reader import Run

    write_run(tmp_path, steps=1, per_step=2)
    entered, release = threading.Event(), threading.Event()
    original = Run.metrics

    def stuck(self: Run) -> list[dict[str, Any]]:
        entered.set()
        release.wait(60)
        return original(self)

    monkeypatch.setattr(Run, "metrics", stuck)
    outcome: dict[str, int] = {}
    with serve_app(create_app([tmp_path])) as url:

        def slow() -> None:
            with urllib.request.urlopen(url + "/api/metrics", timeout=60) as answer:
                outcome["slow"] = answer.status

        thread = threading.Thread(target=slow)
        thread.start()
        try:
            assert entered.wait(30), "the metrics request never reached the handler"
            with urllib.request.urlopen(url + "/api/runs", timeout=30) as answer:
                assert answer.status == 200
            assert "slow" not in outcome  # answered while the other was still stuck
        finally:
            release.set()
            thread.join(60)
    assert outcome == {"slow": 200}


# ---------------------------------------------------------------- 7. parameters
def test_bad_page_parameters_are_refused_with_the_valid_range(tmp_path: Path) -> None:
    write_run(tmp_path, steps=1, per_step=2)
    viewer = client(tmp_path)
    for params in ({"limit": -5}, {"offset": -1}):
        response = viewer.get("/api/episodes", params=params)
        assert response.status_code == 400 and "must be >= 0" in response.json()["error"]
    other = tmp_path / "other"
    write_run(other, steps=1, per_step=2)
    two = client(tmp_path, other)
    response = two.get("/api/episodes", params={"run": -1})
    assert response.status_code == 400 and "runs are 0..1" in response.json()["error"]
    assert two.get("/api/episodes", params={"run": 2}).status_code == 404


def test_view_listens_on_the_ipv6_loopback() -> None:
    """``--host ::1`` is loopback like 127.0.0.1: it binds (an IPv4 socket cannot)."""
    import socket

    from envhub.errors import EnvhubError
    from envhub.ports import listen

    if not socket.has_ipv6:
        pytest.skip("this machine has no IPv6")
    try:
        sock = listen("::1", 0)
    except EnvhubError as error:  # an IPv6 stack without a loopback address
        pytest.skip(f"no ::1 here ({error})")
    with sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"
