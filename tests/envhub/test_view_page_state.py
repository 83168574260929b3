"""``envhub view`` in real Chromium: what a researcher reading a live, long or odd run sees.

The episode table follows a ``keep_last`` run (the total stays, the steps move on), a link
brings back the tab, filters, sort and open episodes, an eval run's agents are a column and a
filter, the eval summary shows every column (NaN as NaN, failures by reason), a diverged value
is visible on a curve and in the table, a long failure text does not widen the page, a long
episode's tokens come in pages, and per-turn rewards, info and missing returns are shown.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the web extra")

from envhub.runs import write_part
from envhub.view import create_app
from envs.web.browser_pool import CHROMIUM_FLAGS, chromium_path
from tests.envhub.openai_servers import serve_app
from tests.envhub.test_runs import record

pytestmark = pytest.mark.browser
WAIT_MS = 15_000
"""How long a condition may take to appear (a poll every 200 ms: many polls)."""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        yield chromium
        chromium.close()


def open_page(browser: Any, url: str, errors: list[str] | None = None) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    if errors is not None:
        page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']")
    return page


def episodes_tab(page: Any) -> None:
    page.click("nav button[data-tab='episodes']")
    page.wait_for_selector("#episode-table tbody tr")


def cells(page: Any, column: str) -> list[str]:
    """The texts of one column of the episode table."""
    heads = page.locator("#episode-table thead th").evaluate_all(
        "hs => hs.map(h => h.dataset.sort)"
    )
    i = heads.index(column) + 1
    return page.locator(f"#episode-table tbody td:nth-child({i})").all_inner_texts()


def train_run(folder: Path, steps: tuple[int, ...] = (1, 2), per_step: int = 8) -> Path:
    for step in steps:
        write_part(
            folder / "trajectories", "train", step, [record(i, step) for i in range(per_step)]
        )
    (folder / "metrics.jsonl").write_text('{"step": 1, "train/success": 0.5}\n')
    return folder


# ---------------------------------------------------------------- 2. live with keep_last
def test_the_table_follows_a_run_whose_total_stays_the_same(browser: Any, tmp_path: Path) -> None:
    run = train_run(tmp_path / "run")
    with serve_app(create_app([run])) as url:
        page = open_page(browser, url + "/?poll=200")
        episodes_tab(page)
        page.wait_for_selector("#episode-table tbody tr[data-key='train:1:0']")
        # keep_last=2: step 3 is stored and step 1 pruned; 16 episodes before and after
        write_part(run / "trajectories", "train", 3, [record(i, 3) for i in range(8)])
        (run / "trajectories" / "train-000000001.parquet").unlink()
        page.wait_for_selector("#episode-table tbody tr[data-key='train:3:0']", timeout=WAIT_MS)
        assert page.locator("#episode-table tbody tr[data-key='train:1:0']").count() == 0
        page.close()


# ---------------------------------------------------------------- 4. links
def test_a_link_brings_back_the_tab_filters_sort_and_open_episodes(
    browser: Any, tmp_path: Path
) -> None:
    run = train_run(tmp_path / "run", steps=(1, 2, 3))
    write_part(run / "trajectories", "eval", 0, [record(i, 0) for i in range(4)])
    with serve_app(create_app([run])) as url:
        page = open_page(browser, url + "/?poll=600000")
        episodes_tab(page)
        page.select_option("#filters select[name='kind']", "train")
        page.fill("#filters input[name='seed']", "101")
        page.press("#filters input[name='seed']", "Enter")
        page.locator("#page-info", has_text="of 6 episodes").wait_for()
        page.click("#episode-table th[data-sort='return']")
        page.click("#episode-table th[data-sort='return']")
        page.wait_for_selector("#episode-table th.sorted.desc[data-sort='return']")
        page.locator("#episode-table tbody tr[data-key='train:2:5']").click()
        page.locator("#episode-table tbody tr[data-key='train:3:1']").click(modifiers=["Shift"])
        page.wait_for_selector("#transcripts .transcript[data-key='train:3:1']")
        link = page.url
        page.close()

        again = open_page(browser, link)
        again.wait_for_selector("#transcripts .transcript[data-key='train:3:1']")
        panels = again.locator("#transcripts .transcript")
        assert [panels.nth(i).get_attribute("data-key") for i in (0, 1)] == [
            "train:2:5",
            "train:3:1",
        ]
        assert again.locator("#episodes").is_visible()
        assert again.locator("#filters select[name='kind']").input_value() == "train"
        assert again.locator("#filters input[name='seed']").input_value() == "101"
        assert again.locator("#episode-table th.sorted.desc[data-sort='return']").count() == 1
        again.locator("#page-info", has_text="of 6 episodes").wait_for()
        again.close()


# ---------------------------------------------------------------- 5. eval agents
def eval_run(folder: Path) -> Path:
    records = [record(i, 0) for i in range(6)]
    for i, row in enumerate(records):
        row["agent"] = "random" if i % 2 else "expert"
        row["sample"] = i // 2
    write_part(folder / "trajectories", "envhub-eval", 0, records)
    return folder


def test_an_eval_runs_agent_is_a_column_a_filter_and_in_the_transcript(
    browser: Any, tmp_path: Path
) -> None:
    run = eval_run(tmp_path / "eval")
    with serve_app(create_app([run])) as url:
        page = open_page(browser, url + "/?poll=600000")
        episodes_tab(page)
        assert sorted(set(cells(page, "agent"))) == ["expert", "random"]
        options = page.locator("#filters select[name='agent'] option").all_inner_texts()
        assert {"expert", "random"} <= set(options)
        page.select_option("#filters select[name='agent']", "random")
        page.locator("#page-info", has_text="of 3 episodes").wait_for()
        assert set(cells(page, "agent")) == {"random"}
        page.locator("#episode-table tbody tr").first.click()
        header = page.locator("#transcripts .transcript h2").first
        header.wait_for()
        assert "agent random" in header.inner_text()
        page.close()


# ---------------------------------------------------------------- 6. eval results
def test_the_eval_summary_shows_every_column_nan_and_failures_by_reason(
    browser: Any, tmp_path: Path
) -> None:
    run = eval_run(tmp_path / "eval")
    rows = [
        {"env_id": "a", "agent": "random", "mean_return": float("nan"), "failures": {}},
        {
            "env_id": "b",
            "agent": "expert",
            "mean_return": 0.5,
            "pass_at_k": 1.0,
            "failures": {"timeout": 2, "crash": 1},
        },
    ]
    (run / "summary.json").write_text(json.dumps(rows))
    with serve_app(create_app([run])) as url:
        page = open_page(browser, url + "/?poll=600000")
        page.click("nav button[data-tab='eval']")
        page.wait_for_selector("#eval-tables table tbody tr")
        heads = page.locator("#eval-tables th").all_inner_texts()
        assert {"mean_return", "pass_at_k", "failures"} <= set(heads), heads
        table = page.locator("#eval-tables table tbody tr")
        first = dict(zip(heads, table.nth(0).locator("td").all_inner_texts(), strict=True))
        second = dict(zip(heads, table.nth(1).locator("td").all_inner_texts(), strict=True))
        assert first["mean_return"] == "NaN" and second["mean_return"] == "0.5"
        assert first["pass_at_k"] == "\u2014"
        assert second["failures"] == "timeout: 2, crash: 1"
        page.close()


# ---------------------------------------------------------------- 7. NaN and infinity
def test_a_diverged_value_is_marked_on_its_curve_and_shown_in_the_table(
    browser: Any, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    records = [record(i, 1) for i in range(4)]
    records[1]["return"] = float("inf")
    records[2]["return"] = float("nan")
    write_part(run / "trajectories", "train", 1, records)
    losses = [{"step": s, "actor/pg_loss": 1.0 / (s + 1)} for s in range(10)]
    lines = [json.dumps(row) for row in losses]
    lines[5] = '{"step": 5, "actor/pg_loss": null}'  # as the trainer writes a NaN loss
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with serve_app(create_app([run])) as url:
        page = open_page(browser, url + "/?poll=600000")
        page.fill("#metric-filter", "loss")
        chart = page.locator("svg.chart[data-key='actor/pg_loss']")
        chart.wait_for()
        assert chart.locator("path.series").get_attribute("data-points") == "9"
        assert chart.locator(".nonfinite").count() == 1
        assert "5" in chart.locator(".nonfinite title").text_content()
        episodes_tab(page)
        page.click("#episode-table th[data-sort='return']")
        page.click("#episode-table th[data-sort='return']")
        page.wait_for_selector("#episode-table th.sorted.desc[data-sort='return']")
        returns = cells(page, "return")
        assert returns[0] == "1" and set(returns[2:]) == {"inf", "NaN"}, returns
        page.close()


# ---------------------------------------------------------------- 11. long content
def test_a_long_failure_is_cut_and_a_long_episode_comes_in_pages(
    browser: Any, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    records = [record(i, 1) for i in range(3)]
    trace = "Traceback (most recent call last): " + "x" * 5000
    records[0].update(failed=True, failure=trace)
    many = 9000
    records[1].update(
        token_ids=list(range(many)),
        response_mask=[i % 2 for i in range(many)],
        logprobs=[-0.5] * many,
        advantages=[0.1] * many,
    )
    write_part(run / "trajectories", "train", 1, records)
    with serve_app(create_app([run])) as url:
        page = open_page(browser, url + "/?poll=600000")
        episodes_tab(page)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 1280, width
        cell = page.locator("#episode-table tbody tr[data-key='train:1:0'] td[title]").last
        assert cell.get_attribute("title") == trace
        page.locator("#episode-table tbody tr[data-key='train:1:1']").click()
        more = page.locator(".transcript button.more-tokens")
        more.wait_for()
        assert page.locator(".transcript .tok").count() == 4000
        more.click()
        page.wait_for_selector(".transcript .tok >> nth=7999")
        more.click()
        page.wait_for_selector(".transcript .tok >> nth=8999")
        assert page.locator(".transcript .tok").count() == many
        assert page.locator(".transcript button.more-tokens").count() == 0
        page.close()


# ---------------------------------------------------------------- 13. smaller gaps
def test_rewards_info_tool_ids_missing_returns_and_the_env_and_failed_filters(
    browser: Any, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    records = [record(i, 1) for i in range(4)]
    records[0].update(
        turn_rewards=[0.0, 0.5, 1.0],
        info=json.dumps({"won": True}),
        messages=json.dumps(
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "call_7", "function": {"name": "look", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "name": "look", "tool_call_id": "call_7", "content": "a wall"},
            ]
        ),
    )
    records[2].update(failed=True, failure="timeout: the env took too long")
    write_part(run / "trajectories", "train", 1, records)
    later = [record(i, 2) for i in range(4)]
    later[0]["return"] = None  # same seed as records[0], no return
    write_part(run / "trajectories", "train", 2, later)
    errors: list[str] = []
    with serve_app(create_app([run])) as url:
        page = open_page(browser, url + "/?poll=600000", errors)
        episodes_tab(page)
        page.locator("#episode-table tbody tr[data-key='train:1:0']").click()
        panel = page.locator("#transcripts .transcript[data-key='train:1:0']")
        panel.wait_for()
        assert "rewards per turn: 0, 0.5, 1" in panel.inner_text()
        assert '"won":true' in panel.locator(".info").text_content().replace(" ", "")
        assert "call_7" in panel.locator(".message.tool").inner_text()
        assert "call_7" in panel.locator(".message.assistant .tool-call").inner_text()
        other = panel.locator("select.compare option[value='train:2:0']")
        other.wait_for(state="attached")
        assert "return \u2014" in other.inner_text()
        assert cells(page, "return")[4] == "\u2014"  # train:2:0

        page.fill("#filters input[name='env']", "frozen")
        page.press("#filters input[name='env']", "Enter")
        page.locator("#page-info", has_text="of 4 episodes").wait_for()
        assert set(cells(page, "env_id")) == {"games/frozen-lake-v0"}
        page.fill("#filters input[name='env']", "")
        page.select_option("#filters select[name='failed']", "true")
        page.locator("#page-info", has_text="of 1 episodes").wait_for()
        assert cells(page, "failure") == ["timeout: the env took too long"]
        assert not errors
        page.close()


# ---------------------------------------------------------------- 12. metrics polls
def test_curves_grow_from_polls_that_ask_only_for_new_rows(browser: Any, tmp_path: Path) -> None:
    run = train_run(tmp_path / "run")
    metrics = run / "metrics.jsonl"
    metrics.write_text(
        "".join(json.dumps({"step": s, "train/success": s / 10}) + "\n" for s in range(3))
    )
    with serve_app(create_app([run])) as url:
        page = browser.new_page()
        asked: list[str] = []
        page.on("request", lambda r: "api/metrics" in r.url and asked.append(r.url))
        page.goto(url + "/?poll=200")
        page.wait_for_selector("body[data-ready='1']")
        chart = "svg.chart[data-key='train/success'] path.series"
        page.wait_for_selector(f"{chart}[data-points='3']")
        with metrics.open("a") as file:
            file.write(json.dumps({"step": 3, "train/success": 0.3}) + "\n")
        page.wait_for_selector(f"{chart}[data-points='4']", timeout=WAIT_MS)
        assert any("after=2" in u for u in asked), asked
        page.close()


def test_a_metric_filter_from_a_link_cannot_freeze_the_page(browser: Any, tmp_path: Path) -> None:
    """The metrics filter comes from the URL too (a shared link): it is words to look for,
    not a regular expression, so ``(.*)*x`` over a long metric name is no catastrophic
    backtracking, and ``|`` still separates words."""
    run = tmp_path / "run"
    long_key = "rollout/a_metric_name_long_enough_to_backtrack_for_ever"
    rows = [{"step": s, long_key: float(s), "actor/pg_loss": 1.0} for s in range(3)]
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with serve_app(create_app([run])) as url:
        page = open_page(browser, url + "/?poll=600000")
        page.fill("#metric-filter", "(.*)*x")
        page.get_by_text("No metric matches the filter").wait_for()
        page.fill("#metric-filter", "nothing|LOSS")
        page.locator("svg.chart[data-key='actor/pg_loss']").wait_for()
        page.close()
