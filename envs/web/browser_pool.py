"""Headless Chromium for the browser envs: one pool per process, driven from a thread it owns.

**Any caller thread.** Playwright's sync API is bound to the thread that started it, but an
env's calls come from whatever thread its user runs: ``rollout.env_timeout_s`` runs every
reset, step and close on a new thread, ``envhub eval`` plays envs on worker threads. The pool
therefore runs Playwright's *async* API on an event loop in a daemon thread of its own;
``run(fn, timeout_s, doing)`` hands a call to that loop from any thread and waits for it. The
calls of several envs run concurrently there.

**Every call bounded.** Playwright bounds navigation and element actions itself, but not
``evaluate``, mouse input, CDP commands or closing a context: a renderer that stops answering
(a frozen cgroup, heavy swapping, a page script in a loop) would block those for as long as it
hangs. ``run`` gives up after ``timeout_s`` and raises ``BrowserTimeout``; the env then closes
its tab, which kills that tab's renderer, or ``kill_browser`` if the browser itself is stuck.

**Shared.** Starting Chromium costs ~0.3 s, a browser context (fresh cookies and storage) a few
milliseconds, so ``BrowserPool.shared()`` keeps ``size`` Chromium processes for every env of the
process and hands out contexts round-robin. Envs ``attach()`` on first use and ``detach()`` on
close; the last detach closes the browsers, stops the driver and kills whatever of its process
tree is left, so closing envs never leaves a browser behind. A browser that crashed is
replaced on the next ``context()``, a driver that died on the next start.

**Exactly its own processes.** The pool owns the process tree of the Playwright driver it
started (a ``node`` child of this process): every Chromium it launches is a child of that
driver, and a browser's root process is the driver's one new child after its launch (launches
are serialised on the pool's loop). A Chromium anyone else started in this process is never
counted, nor killed. (Chromium's crash handler daemonises itself out of that tree; it exits
with its browser.)

Chromium comes from the system (``apt-get install chromium``; ``ENVHUB_CHROMIUM`` overrides the
path); envhub never runs ``playwright install``. Flags keep it off the network except for the
pages we serve.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psutil

__all__ = ["CHROMIUM_FLAGS", "BrowserPool", "BrowserTimeout", "BrowserUnavailable", "chromium_path"]

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

START_TIMEOUT_S = 30.0
"""Bound on starting the driver or launching Chromium (~0.3 s each on an idle machine)."""
_STOP_TIMEOUT_S = 10.0
"""Bound on closing the browsers and stopping the driver at shutdown (then they are killed)."""
_LOOP_GRACE_S = 2.0
"""How much longer than a call's bound the caller waits for the loop to report the timeout."""


class BrowserUnavailable(RuntimeError):
    """Chromium or Playwright is missing; the message says how to install them."""


class BrowserTimeout(TimeoutError):
    """A browser call did not finish within its bound; the message says which call."""


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


_SHARED: tuple[int, BrowserPool] | None = None
_SHARED_LOCK = threading.Lock()


class BrowserPool:
    """Up to ``size`` Chromium processes shared by the envs of this process (module docstring)."""

    def __init__(self, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"a browser pool needs size >= 1, got {size}")
        self.size = size
        self._lock = threading.Lock()  # users, and starting/stopping the loop thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._users = 0
        # owned by the loop thread:
        self._launching: asyncio.Lock | None = None
        self._manager: Any = None
        self._playwright: Any = None
        self._executable = ""
        self._driver: psutil.Process | None = None
        self._browsers: list[tuple[Any, psutil.Process | None]] = []  # (browser, its root)
        self._killed: set[int] = set()  # ids of browsers kill_browser() ended
        self._next = 0

    @classmethod
    def shared(cls) -> BrowserPool:
        """This process's pool (a forked child makes its own: the loop thread did not fork)."""
        global _SHARED
        with _SHARED_LOCK:
            if _SHARED is None or _SHARED[0] != os.getpid():
                _SHARED = (os.getpid(), cls())
            return _SHARED[1]

    # ------------------------------------------------------------------ users
    def attach(self) -> None:
        with self._lock:
            self._users += 1

    def detach(self) -> None:
        """One user fewer; the last one shuts the pool down (it starts again when next used)."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users == 0:
                self._shutdown_locked()

    # ------------------------------------------------------------------ calls
    def run(self, fn: Callable[[], Any], timeout_s: float, doing: str) -> Any:
        """``fn()`` on the pool's loop (awaited if it returns an awaitable), from any thread.

        Raises ``BrowserTimeout`` ("... did not answer within Xs while <doing>") when it takes
        longer than ``timeout_s``; whatever ``fn`` raises comes back as it is."""
        with self._lock:
            if self._users == 0:  # (a call left over from a closed env must not restart it)
                raise RuntimeError(
                    "BrowserPool.run() with no env attached: call attach() first (the pool "
                    "shuts down when its last user detaches)"
                )
            loop = self._start_loop_locked()
        return self._submit(loop, fn, timeout_s, doing)

    @staticmethod
    def _submit(
        loop: asyncio.AbstractEventLoop, fn: Callable[[], Any], timeout_s: float, doing: str
    ) -> Any:
        async def call() -> Any:
            result = fn()
            return await result if inspect.isawaitable(result) else result

        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(call(), timeout_s), loop)
        try:
            return future.result(timeout_s + _LOOP_GRACE_S)
        except TimeoutError:  # asyncio's (wait_for) or the future's: the same class since 3.11
            future.cancel()
            raise BrowserTimeout(
                f"the browser did not answer within {timeout_s:g}s while {doing}"
            ) from None

    def context(self, timeout_s: float, **options: Any) -> Any:
        """A fresh browser context on a live pooled browser (launching one if needed)."""
        browser = self.run(self._browser, START_TIMEOUT_S, "starting Chromium")
        return self.run(lambda: browser.new_context(**options), timeout_s, "opening a tab")

    def kill_browser(self, browser: Any) -> None:
        """Kill ``browser``'s processes (it stopped answering); the next ``context()`` launches
        another. Safe from any thread: only pids are touched."""
        for candidate, root in list(self._browsers):
            if candidate is browser:
                self._killed.add(id(browser))
                if root is not None:
                    _kill([root, *_descendants(root)])

    @property
    def pids(self) -> set[int]:
        """The Chromium processes running now that this pool's driver started."""
        import psutil

        driver = self._driver
        if driver is None:
            return set()
        found = set()
        for process in _descendants(driver):
            with contextlib.suppress(psutil.Error):
                if "chrom" in process.name().lower():
                    found.add(process.pid)
        return found

    @property
    def driver_pid(self) -> int | None:
        """The pool's Playwright driver process, while it runs."""
        return None if self._driver is None else self._driver.pid

    # ------------------------------------------------------------------ on the loop thread
    async def _browser(self) -> Any:
        if self._launching is None:
            self._launching = asyncio.Lock()
        async with self._launching:
            if self._playwright is not None and not _running(self._driver):
                await self._forget_driver()  # it died: its browsers went with it
            if self._playwright is None:
                await self._start_driver()
            self._browsers = [entry for entry in self._browsers if self._usable(*entry)]
            self._killed.clear()
            if len(self._browsers) < self.size:
                self._browsers.append(await self._launch())
            browser = self._browsers[self._next % len(self._browsers)][0]
            self._next += 1
            return browser

    def _usable(self, browser: Any, root: psutil.Process | None) -> bool:
        """``browser`` can take a context: connected, not killed, its process running (one that
        died reads as connected until the driver notices)."""
        return (
            browser.is_connected()
            and id(browser) not in self._killed
            and (root is None or _running(root))
        )

    async def _start_driver(self) -> None:
        executable = chromium_path()
        if executable is None:
            raise BrowserUnavailable(
                "no Chromium found: install it with `apt-get install -y chromium` "
                "(or set ENVHUB_CHROMIUM)"
            )
        try:
            from playwright.async_api import async_playwright
        except ImportError as exc:
            raise BrowserUnavailable(
                "Playwright is not installed: "
                "pip install 'envhub[web]' (never `playwright install`)"
            ) from exc
        self._executable = executable
        import psutil

        before = {p.pid for p in psutil.Process().children()}
        manager = async_playwright()
        self._playwright = await manager.start()
        self._manager = manager
        self._driver = _driver_process(manager, before)

    async def _launch(self) -> tuple[Any, psutil.Process | None]:
        before = {p.pid for p in _children(self._driver)}
        browser = await self._playwright.chromium.launch(
            executable_path=self._executable,
            headless=True,
            args=CHROMIUM_FLAGS,
            timeout=START_TIMEOUT_S * 1000,
        )
        roots = [p for p in _children(self._driver) if p.pid not in before]
        return browser, (roots[0] if len(roots) == 1 else None)

    async def _forget_driver(self) -> None:
        """Close what is left of the browsers (so the driver deletes their profiles) and the
        driver, each bounded; kill what remains of its tree; forget them."""
        closing = [browser.close() for browser, _ in self._browsers]
        with contextlib.suppress(Exception):  # already dead, or does not answer
            await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), 2)
        if self._manager is not None:
            with contextlib.suppress(Exception):  # the driver may be gone already
                await asyncio.wait_for(self._manager.__aexit__(), 2)
        tree = [] if self._driver is None else [self._driver, *_descendants(self._driver)]
        _kill(tree)
        self._browsers, self._manager, self._playwright, self._driver = [], None, None, None

    # ------------------------------------------------------------------ lifecycle
    def _start_loop_locked(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_serve, args=(loop,), name="envhub-browser", daemon=True
            )
            thread.start()
            self._loop, self._thread = loop, thread
        return self._loop

    def shutdown(self) -> None:
        """Close every browser and the driver; kill any process of the driver's tree left."""
        with self._lock:
            self._shutdown_locked()

    def _shutdown_locked(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        tree = [] if self._driver is None else [self._driver, *_descendants(self._driver)]
        if thread.is_alive():
            with contextlib.suppress(Exception):  # a stuck driver: its tree is killed below
                self._submit(loop, self._forget_driver, _STOP_TIMEOUT_S, "shutting down")
            with contextlib.suppress(Exception):
                self._submit(loop, _cancel_other_tasks, _STOP_TIMEOUT_S, "shutting down")
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_STOP_TIMEOUT_S)
        _kill(tree)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = self._launching = None
        self._browsers, self._manager, self._playwright, self._driver = [], None, None, None


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


async def _cancel_other_tasks() -> None:
    """Cancel what the driver's connection left running, so stopping the loop drops nothing."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _driver_process(manager: Any, before: set[int]) -> psutil.Process:
    """The driver ``manager`` started: the pid of its transport's subprocess, or else the one
    new child of ours running Playwright's ``run-driver``."""
    import psutil

    transport = getattr(getattr(manager, "_client", None), "_transport", None)
    pid = getattr(getattr(transport, "_proc", None), "pid", None)
    if isinstance(pid, int):
        return psutil.Process(pid)
    fresh = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.pid not in before and "run-driver" in " ".join(child.cmdline()):
                fresh.append(child)
    if len(fresh) != 1:
        raise BrowserUnavailable(
            f"cannot tell which Playwright driver is this pool's ({len(fresh)} new ones); "
            "envhub needs it to reap its browsers: install the Playwright of "
            "pip install 'envhub[web]'"
        )
    return fresh[0]


def _children(process: psutil.Process | None) -> list[psutil.Process]:
    import psutil

    if process is None:
        return []
    try:
        return list(process.children())
    except psutil.Error:
        return []


def _descendants(process: psutil.Process) -> list[psutil.Process]:
    import psutil

    try:
        return list(process.children(recursive=True))
    except psutil.Error:
        return []


def _running(process: psutil.Process | None) -> bool:
    """``process`` runs: neither gone nor a zombie nobody reaped yet."""
    import psutil

    if process is None:
        return False
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(processes: list[psutil.Process]) -> None:
    """SIGKILL each of ``processes`` still running and wait (at most 5 s) until each is gone or
    a zombie: Chromium's helpers are not our children, and a zombie waits for the host's PID 1
    to reap it (1.4-2 s on a host whose init reaps late, for ever in a container whose PID 1
    does not reap); the driver, our child, is reaped by asyncio. psutil refuses to signal a pid
    that was reused by another process."""
    import psutil

    survivors = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if _running(process):
                process.kill()
                survivors.append(process)
    deadline = time.monotonic() + 5
    while survivors and time.monotonic() < deadline:
        time.sleep(0.02)  # polled, not waited for: reaping the driver would rob asyncio's watcher
        survivors = [process for process in survivors if _running(process)]


@atexit.register
def _reap_all() -> None:
    shared = _SHARED
    if shared is not None and shared[0] == os.getpid():
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            shared[1].shutdown()
