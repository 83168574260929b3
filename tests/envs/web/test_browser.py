"""web/browser-v0 in real headless Chromium: tasks, timeouts, crashes, and reaping."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import psutil
import pytest

import envhub
from envhub.evaluation import AGENTS, run_episode
from envs.web.browser_pool import BrowserPool, chromium_path

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        chromium_path() is None, reason="Chromium is not installed (apt-get install -y chromium)"
    ),
]
pytest.importorskip("playwright", reason="Playwright is not installed (pip install 'envhub[web]')")


def chromium_alive(pids):
    alive = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_envs_share_chromium_and_the_last_close_leaves_none_behind():
    # (the env contract itself is checked with every built-in id in tests/envhub/test_check_all.py)
    first, second = envhub.make("web/browser-v0"), envhub.make("web/browser-forms-v0")
    first.reset(seed=0)
    pids = BrowserPool.shared().pids
    assert pids, "the pool should have started Chromium"
    second.reset(seed=1)
    browsers = psutil.Process(BrowserPool.shared().driver_pid).children()  # one per Chromium
    assert len(browsers) == 1, "the second env started its own Chromium"
    pids |= BrowserPool.shared().pids
    first.close()
    assert chromium_alive(pids), "closing one env killed the browser the other one uses"
    second.step("<answer>scroll [down]</answer>")
    driver = BrowserPool.shared().driver_pid
    second.close()
    second.close()
    assert chromium_alive(pids) == [] and chromium_alive([driver]) == []


def in_page(env, script):
    """``script`` evaluated in the env's tab (on the browser pool's thread, as the env does)."""
    page = env.unwrapped._tab.page
    return env.unwrapped._tab.call(lambda: page.evaluate(script), 5, "a test script")


@pytest.fixture(scope="class")
def warm_chromium() -> Iterator[None]:
    """One Chromium for a class of tests: an extra user of this thread's pool keeps it running
    between them, so each test's last ``close()`` does not reap it and the next launch it again.
    Each env still gets a browser context of its own, cleared at every ``reset``."""
    pool = BrowserPool.shared()
    pool.attach()
    yield
    pool.detach()


@pytest.mark.usefixtures("warm_chromium")
class TestOnOneChromium:
    """Tasks and observations; they do not need a Chromium of their own (the tests of starting
    and reaping it, and of its crash, are outside this class)."""

    def test_oracle_solves_every_task_kind_and_random_rarely_does(self) -> None:
        env = envhub.make("web/browser-v0")
        try:
            for kind in ("signup", "contact", "member-id", "store-hours"):
                messages, _ = env.reset(options={"task_id": f"{kind}-002"})
                assert "Task:" in messages[-1]["content"] and "[1] link" in messages[-1]["content"]
                while not env.done:
                    _, reward, terminated, _, info = env.step(env.expert_action())
                assert terminated and info["success"] and reward == 1.0, kind
            forms = envhub.make("web/browser-forms-v0", max_turns=6)
            try:
                random = [run_episode(forms, AGENTS["random"], seed=s) for s in range(3)]
            finally:
                forms.close()
            assert not any(r.success for r in random)
        finally:
            env.close()

    def test_a_navigation_task_is_not_solved_by_typing_the_pages_address(self) -> None:
        """Navigation tasks train finding a page through the site's links: ``goto`` to a guessed
        path is refused there (home stays reachable), so it earns nothing."""
        env = envhub.make("web/browser-navigation-v0")
        try:
            for task_id, guess in (
                ("store-hours-002", None),
                ("member-id-002", "/settings/profile"),
            ):
                env.reset(options={"task_id": task_id})
                path = guess or f"/stores/{env.unwrapped.task['city'].lower()}"
                reply, reward, terminated, _, info = env.step(f"<answer>goto [{path}]</answer>")
                assert "goto" in reply[-1]["content"] and "links" in reply[-1]["content"]
                assert (reward <= 0, terminated, info["success"]) == (True, False, False)
                assert env.unwrapped._path() != path
                _, _, _, _, info = env.step("<answer>goto [/]</answer>")
                assert env.unwrapped._path() == "/" and not info.get("invalid_action")
        finally:
            env.close()

    def test_observation_has_element_ids_roles_and_values(self) -> None:
        env = envhub.make("web/browser-v0")
        try:
            env.reset(options={"task_id": "signup-000"})
            env.step("<answer>goto [/signup]</answer>")
            reply, *_ = env.step("<answer>type [6] [Ada Park]</answer>")
            text = reply[0]["content"]
            assert '[6] textbox "Full name" value="Ada Park"' in text
            assert (
                'combobox "Plan" value="Choose a plan" options=[Choose a plan, Basic, Plus, Pro]'
                in text
            )
            assert 'checkbox "I accept the terms" unchecked' in text
            reply, _, _, _, info = env.step("<answer>click [99]</answer>")
            assert "There is no element [99]" in reply[0]["content"] and info["invalid_action"]
            reply, _, _, _, info = env.step("<answer>goto [http://example.com/]</answer>")
            assert "limited to this site" in reply[0]["content"]
        finally:
            env.close()

    def test_the_slow_test_page_is_not_part_of_the_site_an_agent_browses(self) -> None:
        """``/slow`` exists to test page-load timeouts; an agent's ``goto [/slow]`` must not cost
        a step the whole page timeout (and park a server thread asleep)."""
        env = envhub.make("web/browser-v0", page_timeout_s=1.5)
        try:
            env.reset(options={"task_id": "signup-000"})
            reply, _, terminated, _, _ = env.step("<answer>goto [/slow]</answer>")
            text = reply[0]["content"]
            assert "Title: Not found" in text and "did not load" not in text and not terminated
        finally:
            env.close()

    def test_a_page_that_never_loads_is_an_observation_not_a_hang(self) -> None:
        env = envhub.make("web/browser-v0", page_timeout_s=1.5)
        try:
            env.reset(seed=0)
            env._site.slow_seconds = 4  # turns /slow on: a page that answers after 4 s
            reply, _, terminated, _, _ = env.step("<answer>goto [/slow]</answer>")
            assert "did not load within 1.5s" in reply[0]["content"] and not terminated
        finally:
            env.close()

    def test_nothing_of_an_episode_reaches_the_next(self) -> None:
        """An env keeps its tab between episodes (a new one costs a renderer process); what a
        tab keeps - history, cookies, storage - is cleared at reset, so ``back`` at the start of
        an episode stays home and no page reads what the last one stored."""
        env = envhub.make("web/browser-v0")
        try:
            env.reset(options={"task_id": "contact-000"})
            env.step("<answer>goto [/contact]</answer>")
            in_page(
                env,
                "() => { localStorage.setItem('k', 'v'); sessionStorage.setItem('k', 'v');"
                " document.cookie = 'k=v; path=/'; }",
            )
            first, _ = env.reset(options={"task_id": "contact-000"})
            assert in_page(
                env, "() => [localStorage.length, sessionStorage.length, document.cookie]"
            ) == [0, 0, ""]
            context = env.unwrapped._tab.context
            assert env.unwrapped._tab.call(context.cookies, 5, "reading cookies") == []
            env.step("<answer>back</answer>")
            assert env.unwrapped._path() == "/"
            again, _ = env.reset(options={"task_id": "contact-000"})
            assert again == first  # a reused tab shows what a new one shows
        finally:
            env.close()


def test_a_browser_that_dies_between_episodes_is_replaced_at_reset():
    """(A crash mid-episode: tests/envs/web/test_browser_failures.py.)"""
    env = envhub.make("web/browser-v0")
    try:
        env.reset(seed=0)
        pids = BrowserPool.shared().pids
        for pid in chromium_alive(pids):
            os.kill(pid, signal.SIGKILL)
        messages, _ = env.reset(seed=2)
        assert "[1] link" in messages[-1]["content"]
        assert BrowserPool.shared().pids.isdisjoint(pids), "the dead Chromium is still in use"
        _, _, terminated, _, info = env.step("<answer>scroll [down]</answer>")
        assert not terminated and not info["invalid_action"]
        pids |= BrowserPool.shared().pids
    finally:
        env.close()
    assert chromium_alive(pids) == []
