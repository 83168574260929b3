"""Headless Chromium processes, pooled per thread and always reaped.

Starting Chromium costs ~0.5 s; a new browser *context* (fresh cookies and storage) costs a
few milliseconds. ``BrowserPool`` therefore keeps a few browser processes warm and hands out
contexts round-robin (an env keeps its own, and its tab, clearing both between episodes). Envs
``attach()`` on first use and ``detach()`` on close; when the last env detaches, the pool
closes its browsers, stops the Playwright driver and kills any Chromium process it started
that is still alive — so closing envs never leaves a browser behind. A browser that crashed
is replaced on the next ``context()``.

Playwright's sync API is bound to the thread that started it, so there is one pool per
thread (``BrowserPool.for_this_thread()``). Chromium comes from the system
(``apt-get install chromium``; ``ENVHUB_CHROMIUM`` overrides the path); envhub never runs
``playwright install``. Flags keep it off the network except for the pages we serve.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import threading
import time
import weakref
from typing import Any

__all__ = ["CHROMIUM_FLAGS", "BrowserPool", "BrowserUnavailable", "chromium_path"]

CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--metrics-recording-only",
    "--mute-audio",
]


class BrowserUnavailable(RuntimeError):
    """Chromium or Playwright is missing; the message says how to install them."""


def chromium_path() -> str | None:
    """The Chromium binary to use, or ``None`` if there is none."""
    override = os.environ.get("ENVHUB_CHROMIUM")
    if override:
        return override if os.path.exists(override) else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


_LOCAL = threading.local()
_ALL_POOLS: weakref.WeakSet[BrowserPool] = weakref.WeakSet()


class BrowserPool:
    """Up to ``size`` Chromium processes shared by the envs of one thread."""

    def __init__(self, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"a browser pool needs size >= 1, got {size}")
        self.size = size
        self._playwright: Any = None
        self._manager: Any = None
        self._browsers: list[Any] = []
        self._pids: set[int] = set()
        self._users = 0
        self._next = 0
        _ALL_POOLS.add(self)

    @classmethod
    def for_this_thread(cls) -> BrowserPool:
        pool = getattr(_LOCAL, "pool", None)
        if pool is None:
            pool = _LOCAL.pool = cls()
        return pool

    # ------------------------------------------------------------------ users
    def attach(self) -> None:
        self._users += 1

    def detach(self) -> None:
        self._users = max(0, self._users - 1)
        if self._users == 0:
            self.shutdown()

    # ------------------------------------------------------------------ browsers
    def _start(self) -> None:
        if self._playwright is not None:
            return
        executable = chromium_path()
        if executable is None:
            raise BrowserUnavailable(
                "no Chromium found: install it with `apt-get install -y chromium` "
                "(or set ENVHUB_CHROMIUM)"
            )
        try:
            from playwright.sync_api import sync_playwright
        except ImportError as exc:
            raise BrowserUnavailable(
                "Playwright is not installed: "
                "pip install 'envhub[web]' (never `playwright install`)"
            ) from exc
        self._executable = executable
        self._manager = sync_playwright()
        self._playwright = self._manager.start()

    def _launch(self) -> Any:
        import psutil

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        browser = self._playwright.chromium.launch(
            executable_path=self._executable, headless=True, args=CHROMIUM_FLAGS
        )
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                try:
                    if "chrom" in child.name().lower():
                        self._pids.add(child.pid)
                except psutil.Error:
                    pass
        return browser

    def context(self, **options: Any) -> Any:
        """A fresh browser context on a live pooled browser (launching one if needed)."""
        self._start()
        self._browsers = [b for b in self._browsers if b.is_connected()]
        if len(self._browsers) < self.size:
            self._browsers.append(self._launch())
        browser = self._browsers[self._next % len(self._browsers)]
        self._next += 1
        return browser.new_context(**options)

    @property
    def pids(self) -> set[int]:
        """Chromium processes this pool started (some may have exited)."""
        return set(self._pids)

    def shutdown(self) -> None:
        """Close every browser and the driver; kill any Chromium process left behind."""
        import psutil

        for browser in self._browsers:
            with contextlib.suppress(Exception):  # already dead
                browser.close()
        self._browsers = []
        if self._manager is not None:
            with contextlib.suppress(Exception):  # the driver may be gone already
                self._manager.__exit__(None, None, None)
        self._manager = self._playwright = None
        survivors = []
        for pid in self._pids:
            try:
                process = psutil.Process(pid)
                if "chrom" in process.name().lower() and not _dead(process):
                    process.kill()
                    survivors.append(process)
            except psutil.Error:
                pass
        # until each is gone or a zombie: Chromium's helpers are not our children, and a zombie
        # waits for the host's PID 1 to reap it (1.4-2 s of every last close on a host whose
        # init reaps late, forever in a container whose PID 1 does not reap)
        deadline = time.monotonic() + 5
        while survivors and time.monotonic() < deadline:
            _, running = psutil.wait_procs(survivors, timeout=0.05)
            survivors = [process for process in running if not _dead(process)]
        self._pids.clear()


def _dead(process: Any) -> bool:
    """``process`` (a ``psutil.Process``) has exited: gone, or a zombie nobody reaped yet."""
    import psutil

    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return True


@atexit.register
def _reap_all() -> None:
    for pool in list(_ALL_POOLS):
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            pool.shutdown()
