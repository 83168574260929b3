"""``envhub view`` in real Chromium with runs an env (or a pruning writer) made awkward.

A message whose role is ``"user hidden"`` is still shown (roles are text, not CSS classes),
content or tool calls given as objects render instead of breaking the transcript, an episode
that can no longer be read replaces the transcript on screen with the reason (never leaves the
previous episode's there as if it were this one), and a poll waits for the one in flight
instead of piling up requests on a slow server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pyarrow", reason="needs the view extra: pip install -e '.[view]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the web extra")

from envhub.runs import write_part
from envhub.view import create_app
from envs.web.browser_pool import CHROMIUM_FLAGS, chromium_path
from tests.envhub.openai_servers import serve_app
from tests.envhub.test_runs import record

pytestmark = pytest.mark.browser
HIDDEN = "HIDDEN-INJECTED-INSTRUCTIONS"


def hostile_run(folder: Path) -> Path:
    records = [record(i, 1) for i in range(4)]
    records[0]["messages"] = json.dumps(
        [
            {"role": "user", "content": "visible prompt"},
            {"role": "user hidden", "content": HIDDEN},
            {"role": "assistant", "content": "ok"},
        ]
    )
    records[1]["messages"] = json.dumps([{"role": "user", "content": {"text": "dict content"}}])
    records[2]["messages"] = json.dumps(
        [{"role": "assistant", "content": "a", "tool_calls": {"function": {"name": "f"}}}]
    )
    records[3]["messages"] = json.dumps({"not": "a list"})
    write_part(folder / "trajectories", "train", 1, records)
    write_part(folder / "trajectories", "train", 2, [record(i, 2) for i in range(2)])
    (folder / "metrics.jsonl").write_text('{"step": 1, "train/success": 0.5}\n')
    return folder


def open_row(page: sync_api.Page, key: str) -> sync_api.Locator:
    page.locator(f"#episode-table tbody tr[data-key='{key}']").click()
    panel = page.locator(f"#transcripts .transcript[data-key='{key}']")
    panel.wait_for()
    return panel


def test_hostile_messages_render_as_text_and_a_failed_open_clears_the_transcript(
    tmp_path: Path,
) -> None:
    run = hostile_run(tmp_path / "run")
    errors: list[str] = []
    with serve_app(create_app([run])) as url, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        page = browser.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(url + "/?poll=600000")
        page.wait_for_selector("body[data-ready='1']")
        page.click("nav button[data-tab='episodes']")
        page.wait_for_selector("#episode-table tbody tr[data-key='train:2:1']")

        panel = open_row(page, "train:1:0")
        hidden = panel.locator(".message", has_text=HIDDEN)
        assert hidden.is_visible()
        assert hidden.locator(".role").text_content() == "user hidden"  # the role, as text
        assert "hidden" not in str(hidden.get_attribute("class")).split()

        assert "dict content" in open_row(page, "train:1:1").inner_text()
        assert "\u2192 f()" in open_row(page, "train:1:2").inner_text()  # a call, as a call
        assert '{"not":"a list"}' in open_row(page, "train:1:3").inner_text()
        assert not errors

        # the writer prunes step 2 after the table was listed: its episode cannot be read
        (run / "trajectories" / "train-000000002.parquet").unlink()
        open_row(page, "train:1:0")
        page.locator("#episode-table tbody tr[data-key='train:2:1']").click()
        failed = page.locator("#transcripts .transcript.error")
        failed.wait_for()
        assert "train:2:1" in failed.inner_text()
        assert page.locator("#transcripts .transcript[data-key='train:1:0']").count() == 0
        assert not errors
        browser.close()


def test_a_poll_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    """On a slow server (here: metrics answers never come) the page sends one poll at a time."""
    run = hostile_run(tmp_path / "run")
    count_and_hold = """
        window.metricsRequests = 0; window.holdMetrics = false;
        const realFetch = window.fetch;
        window.fetch = (url, ...rest) => {
          if (String(url).startsWith("api/metrics") && window.holdMetrics) {
            window.metricsRequests += 1;
            return new Promise(() => {});  // an answer that never comes
          }
          return realFetch(url, ...rest);
        };
    """
    with serve_app(create_app([run])) as url, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        page = browser.new_page()
        page.clock.install()
        page.add_init_script(count_and_hold)
        page.goto(url + "/?poll=1000")
        page.wait_for_selector("body[data-ready='1']")
        page.evaluate("window.holdMetrics = true")
        page.clock.run_for(10_000)  # ten poll intervals
        assert page.evaluate("window.metricsRequests") == 1
        browser.close()
