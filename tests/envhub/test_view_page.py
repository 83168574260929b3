"""``envhub view`` in real Chromium (Playwright): what a person looking at the page sees.

The curves draw one point per metrics row, filtering ``success = no`` lists only failures, a
transcript colours policy tokens, and an env message holding ``<script>alert(1)</script>`` is
shown as text (no dialog opens). The screenshots of ``docs/view.md`` are taken here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the web extra")

from envhub.view import create_app
from envs.web.browser_pool import CHROMIUM_FLAGS, chromium_path
from tests.envhub.openai_servers import serve_app
from tests.envhub.test_runs import SCRIPT, write_run

pytestmark = pytest.mark.browser
DOCS = Path(__file__).resolve().parents[2] / "docs" / "view"


def test_the_page_shows_curves_failures_tokens_and_env_text_as_text(tmp_path: Path) -> None:
    write_run(tmp_path, steps=3, per_step=12)
    dialogs: list[str] = []
    with serve_app(create_app([tmp_path])) as url, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        page.goto(url + "/")
        page.wait_for_selector("body[data-ready='1']")
        line = page.locator("svg.chart[data-key='train/success'] polyline.series")
        assert line.get_attribute("data-points") == "4"  # steps 0..3 of metrics.jsonl
        DOCS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(DOCS / "curves.png"))

        page.click("nav button[data-tab='episodes']")
        page.select_option("#filters select[name='success']", "false")
        page.wait_for_function(
            "document.querySelector('#page-info').textContent.includes('of 26 episodes')"
        )
        marks = page.locator("#episode-table tbody td.ok, #episode-table tbody td.fail")
        assert marks.count() > 0
        assert set(marks.all_inner_texts()) == {"\u2717"}  # only failures

        page.locator("#episode-table tbody tr").first.click()
        page.wait_for_selector(".transcript .tok.policy")
        assert page.locator(".transcript .tok.policy").count() == 2
        assert page.locator(".transcript .tok.context").count() == 4
        user = page.locator(".transcript .message.user").first
        assert SCRIPT in user.inner_text()  # the env's text, shown as text
        assert page.locator(".transcript script").count() == 0 and not dialogs
        assert "--replay" in page.locator(".transcript code.replay").inner_text()
        page.screenshot(path=str(DOCS / "transcript.png"), full_page=True)
        browser.close()
