"""web/browser-v0 when its callers or its browser misbehave: calls from many threads, envs on
concurrent threads, a Chromium that crashes, a renderer that stops answering.

These tests start and reap Chromium themselves (no shared warm browser): what they check is
what happens to the processes. ``leftovers`` kills anything a failing run leaves behind."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

import envhub
from envhub.evaluation import AGENTS, run_episode
from envs.web.browser_pool import chromium_path

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        chromium_path() is None, reason="Chromium is not installed (apt-get install -y chromium)"
    ),
]
pytest.importorskip("playwright", reason="Playwright is not installed (pip install 'envhub[web]')")

from envs.web.browser import BrowserCrashed
from envs.web.browser_pool import BrowserPool


def playwright_processes() -> dict[int, psutil.Process]:
    """This process's descendants that are a Playwright driver or a Chromium, by pid."""
    found = {}
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "chrom" in process.name().lower() or "run-driver" in " ".join(process.cmdline()):
                found[process.pid] = process
    return found


def alive(processes: dict[int, psutil.Process]) -> list[int]:
    """The pids of ``processes`` still running (a zombie has exited)."""
    running = []
    for pid, process in processes.items():
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
    return running


def resume(processes: list[psutil.Process]) -> None:
    """SIGCONT each of ``processes``, so none stays stopped after a test."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGCONT)


@pytest.fixture
def leftovers() -> Iterator[dict[int, psutil.Process]]:
    """Processes a test saw (add to the dict); after it, they and any new driver or Chromium
    are killed, so a failing run leaks nothing into the next test."""
    before = set(playwright_processes())
    seen: dict[int, psutil.Process] = {}
    yield seen
    extra = {pid: p for pid, p in playwright_processes().items() if pid not in before}
    resume([*seen.values(), *extra.values()])
    for process in {**seen, **extra}.values():
        with contextlib.suppress(psutil.Error):
            process.kill()


def on_new_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a thread of its own that ends with the call: how the trainer's
    ``LocalEnvSource(threaded=True)`` (``rollout.env_timeout_s``) runs every env call."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), f"{fn.__name__} did not return within 120 s"
    if "error" in box:
        raise box["error"]
    return box["result"]


def plays_again(env: Any, leftovers: dict[int, Any]) -> None:
    """The next reset opens a working page and a step acts on it (the env recovered)."""
    messages, _ = env.reset(seed=1)
    assert "[1] link" in messages[-1]["content"]
    leftovers.update(playwright_processes())
    _, _, terminated, _, info = env.step("<answer>scroll [down]</answer>")
    assert not terminated and not info["invalid_action"]


def test_reset_step_and_close_on_threads_of_their_own_play_and_leave_nothing(leftovers):
    env = envhub.make("web/browser-v0")
    try:
        for task_id in ("signup-001", "member-id-001"):
            on_new_thread(env.reset, options={"task_id": task_id})
            leftovers.update(playwright_processes())
            info: dict[str, Any] = {}
            while not env.done:
                reply, _, _, _, info = on_new_thread(env.step, env.unwrapped.expert_action())
                assert not info["invalid_action"], reply[-1]["content"][:200]
            assert info["success"], reply[-1]["content"][:200]
    finally:
        on_new_thread(env.close)
    assert leftovers, "the env should have started a Playwright driver and Chromium"
    assert alive(leftovers) == [], "closing the env left a Playwright driver or Chromium running"
    assert alive(playwright_processes()) == []


def test_envs_on_concurrent_threads_never_kill_each_others_browser(leftovers):
    """``envhub eval --concurrency N`` plays browser envs on N threads; one thread closing its
    env (its jobs done) must not end another thread's episode."""
    barrier = threading.Barrier(2, timeout=120)
    closed = threading.Event()
    replies: dict[str, Any] = {}

    def worker(name: str) -> None:
        env = envhub.make("web/browser-v0")
        try:
            barrier.wait()  # both reset at once: their browsers start together
            env.reset(seed=0)
            leftovers.update(playwright_processes())
            barrier.wait()
            if name == "A":
                env.close()
                closed.set()
            else:
                assert closed.wait(120)
                replies[name] = env.step("<answer>scroll [down]</answer>")
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            replies[name] = error
        finally:
            env.close()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in "AB"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    reply = replies.get("B")
    assert isinstance(reply, tuple), f"B's step after A closed its env: {reply!r:.300}"
    messages, _, terminated, _, info = reply
    assert not terminated and not info["invalid_action"], messages[-1]["content"][:200]
    assert "URL: /" in messages[-1]["content"]
    assert alive(leftovers) == []


def test_the_pool_kills_only_the_processes_its_own_driver_started(leftovers):
    """A Chromium some other code of this process started (a test, a screenshot tool) is not
    the pool's: closing the last env leaves it running."""
    from playwright.sync_api import sync_playwright

    from envs.web.browser_pool import CHROMIUM_FLAGS

    with sync_playwright() as playwright:
        other = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        theirs = playwright_processes()
        env = envhub.make("web/browser-v0")
        env.reset(seed=0)
        ours = BrowserPool.shared().pids
        leftovers.update(playwright_processes())
        assert ours and not ours & set(theirs), "the pool counts another Chromium as its own"
        env.close()
        assert other.is_connected() and sorted(alive(theirs)) == sorted(theirs)
        page = other.new_page()
        page.goto("data:text/html,<title>still here</title>")
        assert page.title() == "still here"
        other.close()
    assert alive({pid: p for pid, p in leftovers.items() if pid in ours}) == []


def kill_chromium() -> None:
    for pid in BrowserPool.shared().pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_browser_crash_fails_the_episode_with_a_clear_error_and_reset_recovers(leftovers):
    env = envhub.make("web/browser-v0")
    try:
        env.reset(seed=0)
        leftovers.update(playwright_processes())
        kill_chromium()
        with pytest.raises(BrowserCrashed, match=r"(?s)browser crashed.*next reset\(\)"):
            env.step("<answer>click [2]</answer>")
        with pytest.raises(BrowserCrashed, match=r"call reset\(\)"):  # the episode stays over
            env.step("<answer>scroll [down]</answer>")
        plays_again(env, leftovers)
    finally:
        env.close()
    assert alive(leftovers) == []


def test_eval_records_a_browser_crash_as_a_failed_episode_not_a_loss(leftovers):
    """What ``envhub eval`` and the trainer read: an env that raises fails the episode
    (``failure="env_error"``), where an ordinary reward-0 ending would count as a loss."""

    def crash_then_random(env: Any, observation: Any) -> str:
        leftovers.update(playwright_processes())
        kill_chromium()
        return str(AGENTS["random"](env, observation))

    env = envhub.make("web/browser-v0")
    try:
        stats = run_episode(env, crash_then_random, seed=0)
    finally:
        env.close()
    assert stats.failure == "env_error" and "browser crashed" in stats.detail
    assert not stats.success and alive(leftovers) == []


def test_a_renderer_that_stops_answering_fails_the_step_and_reset_recovers(leftovers):
    """A renderer that never answers (stopped here; in life a frozen cgroup, heavy swapping, a
    script in a loop) costs a step about the env's timeouts, never a hang."""
    env = envhub.make("web/browser-v0", page_timeout_s=1.0, action_timeout_s=1.0)
    watchdog = None
    try:
        env.reset(seed=0)
        leftovers.update(playwright_processes())
        renderers = [p for p in leftovers.values() if "--type=renderer" in " ".join(p.cmdline())]
        assert renderers
        for process in renderers:
            process.send_signal(signal.SIGSTOP)
        # a safety net, not a synchronisation: ends a step that would block for ever
        watchdog = threading.Timer(60, lambda: resume(renderers))
        watchdog.start()
        with pytest.raises(BrowserCrashed, match=r"did not answer within"):
            env.step("<answer>scroll [down]</answer>")
        plays_again(env, leftovers)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        resume(list(leftovers.values()))
        env.close()
    assert alive(leftovers) == []


def test_a_browser_that_stops_answering_is_killed_and_replaced_at_reset(leftovers):
    """When the browser process itself does not answer, closing the tab cannot help: the env
    kills that Chromium (only the pool's own: it knows the browser's process) and the next
    reset launches another."""
    env = envhub.make("web/browser-v0", page_timeout_s=1.0, action_timeout_s=1.0)
    watchdog = None
    try:
        env.reset(seed=0)
        leftovers.update(playwright_processes())
        driver = psutil.Process(BrowserPool.shared().driver_pid)
        (browser,) = driver.children()  # the browser process; its helpers are its children
        browser.send_signal(signal.SIGSTOP)
        watchdog = threading.Timer(60, lambda: resume([browser]))
        watchdog.start()  # a safety net, not a synchronisation: ends a step blocked for ever
        with pytest.raises(BrowserCrashed, match=r"did not answer within"):
            env.step("<answer>scroll [down]</answer>")
        assert alive({browser.pid: browser}) == [], "the stuck Chromium was not killed"
        messages, _ = env.reset(seed=1)
        assert "[1] link" in messages[-1]["content"]
        assert [p.pid for p in driver.children()] != [browser.pid]
        leftovers.update(playwright_processes())
    finally:
        if watchdog is not None:
            watchdog.cancel()
        resume(list(leftovers.values()))
        env.close()
    assert alive(leftovers) == []
