"""``envhub view`` in real Chromium (Playwright): what a person looking at the page sees.

Two runs side by side: a real short ``envhub train`` of the quickstart (its own store, metrics
and tokenizer) and a run whose env text holds ``<script>alert(1)</script>``. The curves draw one
point per metrics row and grow live when the run writes a row, filtering ``success = no`` lists
exactly the run's failures, a transcript colours the policy's tokens (decoded with the run's
tokenizer), the same seed at another step opens beside it, and the hostile env text is shown as
text (no dialog opens), and nothing the page needs is refused by its Content-Security-Policy.
The screenshots of ``docs/view.md`` are taken here: into
``docs/view/`` with ``ENVHUB_UPDATE_SCREENSHOTS=1``, else into the test's temporary folder (a
test run leaves the checkout as it was).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")
pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the web extra")
from click.testing import CliRunner

import envhub.runs
from envhub.cli import main
from envhub.view import create_app
from envs.web.browser_pool import CHROMIUM_FLAGS, chromium_path
from tests.envhub.openai_servers import serve_app
from tests.envhub.test_runs import SCRIPT, write_run

pytestmark = pytest.mark.browser
DOCS = Path(__file__).resolve().parents[2] / "docs" / "view"
"""Where the screenshots go with ``ENVHUB_UPDATE_SCREENSHOTS=1``."""


def count(page: sync_api.Page, selector: str) -> int:
    return page.locator(selector).count()


def test_the_page_shows_curves_failures_tokens_and_env_text_as_text(
    quickstart_run: Path, tmp_path: Path
) -> None:
    shots = DOCS if os.environ.get("ENVHUB_UPDATE_SCREENSHOTS") == "1" else tmp_path / "shots"
    hostile = tmp_path / "hostile"
    write_run(hostile, steps=3, per_step=12)
    evals = tmp_path / "eval"  # an envhub eval --out folder: its summary is the Eval tab
    played = CliRunner().invoke(
        main, ["eval", "games/guess-number-v0", "--episodes", "4", "--out", str(evals)]
    )
    assert played.exit_code == 0, played.output
    run = envhub.runs.open(quickstart_run)
    trained = [r for r in run.metrics() if "train/success" in r]
    failures = run.episodes(kind="train", success=False, limit=None)
    assert failures.total > 0  # an untrained tiny policy fails most episodes
    dialogs: list[str] = []
    app = create_app([quickstart_run, hostile, evals])
    with serve_app(app) as url, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        refused: list[str] = []  # what the Content-Security-Policy blocked (page must need none)
        page.on("console", lambda m: "Content Security Policy" in m.text and refused.append(m.text))
        page.goto(url + "/?poll=200")
        page.wait_for_selector("body[data-ready='1']")
        swatch = page.locator("#runs label span").nth(1)  # the second run's colour
        assert swatch.evaluate("s => getComputedStyle(s).color") == "rgb(217, 72, 15)"

        # curves: both runs overlaid, one point per metrics row
        chart = "svg.chart[data-key='train/success']"
        page.locator("#runs input[data-run='1']").check()
        page.wait_for_selector(f"{chart} path.series[data-run='1']")
        real = page.locator(f"{chart} path.series[data-run='0']")
        assert real.get_attribute("data-points") == str(len(trained)) == "4"
        assert (
            page.locator(f"{chart} path.series[data-run='1']").get_attribute("data-points") == "4"
        )
        evals = page.locator("svg.chart[data-key='eval/success'] path.series[data-run='0']")
        assert evals.get_attribute("data-points") == "3"  # steps 0, 2, 4
        shots.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shots / "curves.png"))
        # live: a row the run writes appears without a reload
        with (hostile / "metrics.jsonl").open("a") as metrics:
            metrics.write("\n" + json.dumps({"step": 4, "time_s": 8.0, "train/success": 0.5}))
        # (selectors, not wait_for_function: the page's CSP refuses the eval that one uses)
        page.wait_for_selector(f"{chart} path.series[data-run='1'][data-points='5']")

        # the episode table: success = no lists exactly the run's failures
        page.click("nav button[data-tab='episodes']")
        page.select_option("#filters select[name='kind']", "train")
        page.select_option("#filters select[name='success']", "false")
        page.locator("#page-info", has_text=f"of {failures.total} episodes").wait_for()
        marks = page.locator("#episode-table tbody td.ok, #episode-table tbody td.fail")
        assert set(marks.all_inner_texts()) == {"\u2717"}
        assert marks.count() == min(failures.total, 50)
        page.screenshot(path=str(shots / "episodes.png"))

        # a transcript: the policy's tokens coloured, decoded with the run's tokenizer
        page.select_option("#filters select[name='kind']", "eval")
        page.select_option("#filters select[name='success']", "")
        page.wait_for_selector("#episode-table tbody tr[data-key^='eval:0:']")
        first = page.locator("#episode-table tbody tr").first
        key = str(first.get_attribute("data-key"))
        episode = run.episode(key)
        first.click()
        page.wait_for_selector(".transcript .tok.policy")
        assert count(page, ".transcript .tok.policy") == sum(episode["response_mask"])
        assert count(page, ".transcript .tok") == len(episode["token_ids"])
        assert not page.locator(".transcript .tok").first.inner_text().startswith("[")
        assert "--replay" in page.locator(".transcript code.replay").inner_text()
        # the same seed two evaluations later, side by side
        compare = page.locator(".transcript select.compare")
        later = compare.locator("option").nth(1).get_attribute("value")
        compare.select_option(later)
        page.locator("#transcripts .transcript").nth(1).wait_for()
        panels = page.locator("#transcripts .transcript")
        assert [panels.nth(i).get_attribute("data-key") for i in (0, 1)] == [key, later]
        page.locator("#transcripts").scroll_into_view_if_needed()
        page.evaluate("document.querySelector('#transcripts').scrollIntoView()")
        page.screenshot(path=str(shots / "transcript.png"))

        # the envhub eval run's summary: one row per (env, agent)
        page.click("nav button[data-tab='eval']")
        page.wait_for_selector("#eval-tables table tbody tr")
        rows = page.locator("#eval-tables table tbody tr").all_inner_texts()
        assert len(rows) == 2 and all("games/guess-number-v0" in r for r in rows)
        assert {"random", "expert"} == {a for r in rows for a in ("random", "expert") if a in r}
        page.click("nav button[data-tab='episodes']")

        # env text that holds markup is shown as text, never run
        page.select_option("#episode-run", "1")
        page.select_option("#filters select[name='kind']", "")
        page.locator("#page-info", has_text="of 40 episodes").wait_for()
        row = page.locator("#episode-table tbody tr").first
        key = row.get_attribute("data-key")
        panel = f"#transcripts .transcript[data-run='1'][data-key='{key}']"
        row.click()
        # (not just any transcript: the first run's stays on screen until this one has loaded)
        page.wait_for_selector(f"{panel} .message.user")
        assert SCRIPT in page.locator(f"{panel} .message.user").first.inner_text()
        assert count(page, ".transcript script") == 0 and not dialogs
        assert not refused
        browser.close()
