"""One browser env's tab: a browser context and page on the process's ``BrowserPool``.

What the env needs from a browser, and what this class guarantees:

- **Any thread.** Every Playwright call goes through ``call``, which runs it on the pool's
  loop thread; the env may be reset on one thread, stepped on others and closed on another.
- **Bounded.** ``call`` gives up after its bound. A browser that did not answer in time costs
  the env its tab: ``close_context`` closes it (which kills the tab's renderer) or, when the
  browser itself does not answer that either, kills that Chromium; then ``BrowserFailure``.
- **Nothing between episodes.** ``clear`` empties what a reused tab keeps (the site's
  storage and cookies, the HTTP cache; ``reset_history`` the history after the page loads).
- **Released.** ``close`` closes the context and detaches from the pool; the pool's last user
  stops its browsers and driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from envs.web.browser_pool import BrowserPool, BrowserTimeout, BrowserUnavailable

__all__ = ["GRACE_S", "BrowserFailure", "BrowserTab"]

GRACE_S = 2.0
"""Added to the bound of a call Playwright bounds itself (navigation, element actions), so its
own timeout, which the agent sees as a note, fires first."""


class BrowserFailure(Exception):
    """The browser died or stopped answering; the episode cannot go on."""


class BrowserTab:
    """A page in a browser context of its own (see the module docstring)."""

    def __init__(self, *, page_timeout_s: float, action_timeout_s: float) -> None:
        self.page_timeout_s, self.action_timeout_s = page_timeout_s, action_timeout_s
        self.pool: BrowserPool | None = None
        self.context: Any = None
        self.page: Any = None
        self.cdp: Any = None

    def call(self, fn: Callable[[], Any], seconds: float, doing: str) -> Any:
        """``fn()`` (Playwright calls, on the pool's loop thread) within ``seconds``, from any
        thread. A browser that does not answer in time costs the tab (closing it kills its
        renderer) and raises ``BrowserFailure``; ``fn``'s own errors pass through."""
        if self.pool is None:
            raise BrowserFailure("the env's browser is closed")
        try:
            return self.pool.run(fn, seconds, doing)
        except BrowserTimeout as timeout:
            self.close_context()
            raise BrowserFailure(
                f"{timeout}; its tab was closed (on a machine that is only slow, raise "
                "page_timeout_s / action_timeout_s)"
            ) from None

    def new(self) -> None:
        """A new page in a new browser context (on a new Chromium if the pool's died)."""
        if self.pool is None:
            self.pool = BrowserPool.shared()
            self.pool.attach()
        self.close_context()
        pool, bound = self.pool, self.page_timeout_s + GRACE_S
        try:
            self.context = context = pool.context(bound, viewport={"width": 1024, "height": 768})
        except BrowserTimeout as timeout:
            raise BrowserFailure(str(timeout)) from None
        except BrowserUnavailable:
            raise
        except Exception as error:  # a launch that failed: reset tries once more
            raise BrowserFailure(f"no browser tab: {error}") from error

        async def open_page() -> tuple[Any, Any]:
            page = await context.new_page()
            page.set_default_timeout(self.action_timeout_s * 1000)
            page.set_default_navigation_timeout(self.page_timeout_s * 1000)
            return page, await context.new_cdp_session(page)

        try:
            self.page, self.cdp = self.call(open_page, bound, "opening a tab")
        except BrowserFailure:
            raise
        except Exception as error:
            raise BrowserFailure(f"no browser tab: {error}") from error

    def clear(self, origin: str) -> None:
        """Empty what the tab keeps of ``origin`` (storage, cookies, HTTP cache); a tab that
        cannot be cleared is replaced by a new one."""
        if self.page is None:
            self.new()
            return
        cdp, context = self.cdp, self.context

        async def clear() -> None:
            await cdp.send("Storage.clearDataForOrigin", {"origin": origin, "storageTypes": "all"})
            await cdp.send("Network.clearBrowserCache")
            await context.clear_cookies()

        try:
            self.call(clear, self.action_timeout_s, "clearing the last episode's data")
        except BrowserFailure:
            raise
        except Exception as error:  # a dead browser: a new one; anything else: a new tab
            if self.dead(error):
                raise BrowserFailure(str(error)) from error
            self.new()

    def reset_history(self) -> None:
        """Forget the tab's history (a fresh tab's would hold ``about:blank``)."""
        cdp = self.cdp
        try:
            self.call(
                lambda: cdp.send("Page.resetNavigationHistory"),
                self.action_timeout_s,
                "clearing the tab's history",
            )
        except BrowserFailure:
            raise
        except Exception as error:  # (the env retries once in a new tab)
            raise BrowserFailure(str(error)) from error

    def goto(self, url: str) -> str | None:
        """Navigate; return a note if the page did not load (the episode goes on)."""
        page, path = self.page, urlsplit(url).path
        try:
            self.call(
                lambda: page.goto(url, wait_until="domcontentloaded"),
                self.page_timeout_s + GRACE_S,
                f"opening {path}",
            )
        except BrowserFailure:
            raise
        except Exception as error:
            if self.dead(error):
                raise BrowserFailure(str(error)) from error
            if "timeout" in str(error).lower():
                self.stop_loading()
                return f"The page {path} did not load within {self.page_timeout_s:g}s."
            return f"The page {path} could not be opened: {str(error).splitlines()[0][:200]}"
        return None

    def stop_loading(self) -> None:
        """Stop a navigation that ran out of time, as a browser's stop button does: the tab
        keeps the page it showed (reading the page would otherwise wait for the slow one)."""
        cdp = self.cdp
        try:
            self.call(lambda: cdp.send("Page.stopLoading"), self.action_timeout_s, "stopping")
        except BrowserFailure:
            raise
        except Exception as error:  # the snapshot then says what it can read
            if self.dead(error):
                raise BrowserFailure(str(error)) from error

    def dead(self, error: BaseException) -> bool:
        """Whether ``error`` (from a Playwright call) means the browser is gone."""
        message = str(error).lower()
        try:
            connected = (
                self.context is not None
                and self.context.browser is not None
                and self.context.browser.is_connected()
            )
        except Exception:  # noqa: BLE001 - a browser that cannot answer counts as disconnected
            connected = False
        return (
            not connected or "closed" in message or "crash" in message or "disconnected" in message
        )

    @property
    def path(self) -> str:
        """The path of the page's URL (a plain attribute of the page: no call to the browser)."""
        try:
            return urlsplit(self.page.url).path or "/"
        except Exception:  # noqa: BLE001 - a closed or crashed page has no URL to show
            return "/"

    def close_context(self) -> None:
        """Close the tab (bounded: a browser that does not answer is killed instead)."""
        context, pool = self.context, self.pool
        self.context = self.page = self.cdp = None
        if context is None or pool is None:
            return
        try:
            pool.run(context.close, self.action_timeout_s, "closing a tab")
        except BrowserTimeout:  # the browser itself is stuck
            pool.kill_browser(context.browser)
        except Exception:  # noqa: BLE001, S110 - its browser crashed: nothing left to close
            pass

    def close(self) -> None:
        """Close the tab and leave the pool (its last user stops the browsers)."""
        self.close_context()
        if self.pool is not None:
            self.pool.detach()
            self.pool = None
