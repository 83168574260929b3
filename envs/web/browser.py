"""``web/browser-v0``: a real headless Chromium (Playwright) on locally served pages.

Observation: an accessibility-tree-style text of the page — one line per heading, text
block and interactive element, each interactive element numbered ``[id]`` with its role,
accessible name, value and state — built by a DOM walk in the page (the numbering is
written into the DOM as ``data-envhub-id``, so actions find exactly that element).
``screenshot=True`` adds a base64 PNG in ``info["screenshot_png"]``.

Actions (inside ``<answer>...</answer>`` or alone)::

    click [id]            type [id] [text]       select [id] [option]
    goto [url]            scroll [up|down]        back
    answer [text]         (ends the episode; for question tasks)

Built-in tasks (``envs.web.browser_site``): a sign-up form, a contact form, finding a member
ID under Settings, reaching a store's opening-hours page. A checker looks at what the site
recorded, the URL or the answer after every step; success gives reward 1 and ends the
episode. Navigation is confined to the local site; in the navigation tasks (member ID, store
hours) ``goto`` goes home only, since typing a guessed address would skip the task.

Failures, and what they cost:

- A page that does not load within ``page_timeout_s`` is an observation saying so.
- Every call to the browser is bounded (``page_timeout_s`` for pages, ``action_timeout_s`` for
  actions, plus a 2 s grace where Playwright bounds the call itself): a renderer that stops
  answering costs a step about that long, never a hang; the env's tab is closed (its renderer
  killed with it) or, if the browser itself is stuck, that Chromium is killed.
- A browser that crashed or stopped answering fails the episode: ``step`` raises
  ``BrowserCrashed``, which ``envhub eval``, pool workers and the trainer all record as a
  failed episode (``env_error``), never as a reward-0 loss. The next ``reset`` opens a new tab,
  on a new Chromium if it died.

The env can be called from any thread, each call from a different one if need be (the
trainer's ``rollout.env_timeout_s`` does that): its tab (``envs.web.browser_tab``) runs every
Playwright call on the thread of the process's ``BrowserPool``, which every browser env shares
(``envs.web.browser_pool``).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

import numpy as np

from envhub.core import TextEnv, Turn
from envhub.errors import ActionParseError
from envhub.parsing import ActionParser
from envs.datasets import Split, TaskSet, as_taskset
from envs.web.browser_site import NAVIGATION_KINDS, TASK_KINDS, TaskSite, check, make_task
from envs.web.browser_snapshot import SNAPSHOT_JS
from envs.web.browser_tab import GRACE_S, BrowserFailure, BrowserTab
from envs.web.shop_site import serve_site

__all__ = ["BrowserCrashed", "BrowserEnv"]

_ACTION = re.compile(
    r"^(click|type|select|goto|scroll|back|answer)\b\s*(?:\[(.*?)\])?\s*(?:\[(.*)\])?\s*$",
    re.IGNORECASE | re.DOTALL,
)


class BrowserCrashed(RuntimeError):
    """The episode's browser crashed or stopped answering: the episode cannot go on.

    Raised from ``step`` (and from ``reset`` when a new tab fails too), the way every envhub
    consumer reads an env failure: ``envhub eval`` records ``failure="env_error"``, a pool
    worker fails the episode, the trainer drops or replaces the trajectory; none of them
    scores it as a loss. The next ``reset()`` opens a new tab, on a new Chromium if it died."""


class BrowserEnv(TextEnv):
    """Web tasks in real headless Chromium (see the module docstring)."""

    def __init__(
        self,
        *,
        kinds: Iterable[str] = TASK_KINDS,
        dataset: str | TaskSet | Iterable[Mapping[str, Any]] | None = None,
        split: Split = "all",
        max_turns: int | None = 15,
        page_timeout_s: float = 5.0,
        action_timeout_s: float = 3.0,
        screenshot: bool = False,
        max_observation_chars: int = 6_000,
        invalid_action_penalty: float = -0.05,
        render_mode: Any = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        kinds = list(kinds)
        unknown = sorted(set(kinds) - set(TASK_KINDS))
        if unknown:
            raise ValueError(f"unknown task kind(s) {unknown}; use some of {list(TASK_KINDS)}")
        builtin = [
            {"id": f"{kind}-{i:03d}", "kind": kind, "seed": 40_000 + i}
            for i in range(100)
            for kind in kinds
        ]
        self.tasks = as_taskset(
            dataset, default=builtin, split=split, required=("kind",) if dataset is not None else ()
        )
        self.page_timeout_s, self.action_timeout_s = page_timeout_s, action_timeout_s
        self.screenshot, self.max_observation_chars = screenshot, max_observation_chars
        self.invalid_action_penalty = invalid_action_penalty
        self.parser = ActionParser(format="tag", max_length=2_000)
        self.system_prompt = (
            "You control a web browser. Each observation lists the page's elements; "
            "[id] marks one you can act on. "
            "Actions: click [id], type [id] [text], select [id] [option], goto [url], "
            "scroll [up|down], back, "
            f"answer [text]. One action per turn. {self.parser.instructions}"
        )
        self.task: dict[str, Any] = {}
        self.elements: list[dict[str, Any]] = []
        self._answer: str | None = None
        self._failure: str | None = None
        """Why this episode's browser failed (then every step raises until the next reset)."""
        self._site = TaskSite()
        self._base_url: str | None = None
        self._stop_server: Callable[[], None] | None = None
        self._tab = BrowserTab(page_timeout_s=page_timeout_s, action_timeout_s=action_timeout_s)

    # ------------------------------------------------------------------ browser plumbing
    def _ensure_server(self) -> str:
        if self._base_url is None:
            self._base_url, self._stop_server = serve_site(self._site)
        return self._base_url

    def _open_home(self, base: str) -> str | None:
        """Show the site's home page in a tab that holds nothing of an earlier episode; return a
        note if it did not load.

        The env keeps its tab between episodes: a new context and page start a renderer
        process, most of what a reset used to cost. What a tab keeps is cleared instead: the
        site's storage and cookies and the HTTP cache before the page loads, the history after
        it (a fresh tab's history would hold ``about:blank``, where ``back`` used to lead)."""
        self._tab.clear(base)
        note = self._tab.goto(base + "/")
        self._tab.reset_history()
        return note

    def _snapshot(self) -> str:
        page = self._tab.page
        try:
            data = self._tab.call(
                lambda: page.evaluate(SNAPSHOT_JS), self.page_timeout_s, "reading the page"
            )
        except BrowserFailure:
            raise
        except Exception as error:
            if self._tab.dead(error):
                raise BrowserFailure(str(error)) from error
            return f"(the page could not be read: {str(error).splitlines()[0][:200]})"
        self.elements = data["elements"]
        text = f"URL: {self._path()}\nTitle: {data['title']}\n{data['text']}"
        if len(text) > self.max_observation_chars:
            text = text[: self.max_observation_chars] + "\n... [page truncated]"
        return text

    def _path(self) -> str:
        return self._tab.path

    # ------------------------------------------------------------------ episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        chosen = self.tasks.select(options, self.np_random)
        self.task = {
            **make_task(chosen["kind"], int(chosen["seed"])),
            **{k: v for k, v in chosen.items() if k not in ("id", "seed", "split")},
        }
        self._site.reset(member_id=self.task.get("member_id", "M-000000"))
        base = self._ensure_server()
        self._answer = self._failure = None
        try:
            try:
                note = self._open_home(base)
                page = self._snapshot()
            except BrowserFailure:  # a crashed or stuck browser: a new tab, on a new one if dead
                self._tab.new()
                note, page = self._open_home(base), self._snapshot()
            shot = self._screenshot_info()
        except BrowserFailure as failure:
            self._tab.close_context()
            raise BrowserCrashed(
                f"web/browser-v0 could not open its page: the browser crashed or stopped "
                f"answering twice ({_first_line(failure)}). Check that Chromium runs "
                "(`chromium --headless=new --dump-dom about:blank`); reset() tries again."
            ) from None
        text = f"Task: {self.task['instruction']}\n\n{page}" + (f"\n{note}" if note else "")
        return text, {"task_id": chosen["id"], "kind": self.task["kind"], **shot}

    def _screenshot_info(self) -> dict[str, Any]:
        if not self.screenshot or self._tab.page is None:
            return {}
        page = self._tab.page
        try:
            png = self._tab.call(page.screenshot, self.action_timeout_s + GRACE_S, "screenshotting")
        except BrowserFailure:
            raise
        except Exception:  # noqa: BLE001 - the screenshot is optional: the step goes on without it
            return {}
        return {"screenshot_png": base64.b64encode(png).decode()}

    def on_step(self, action: str) -> Turn:
        if self._failure is not None:
            raise BrowserCrashed(
                f"web/browser-v0: {self._failure} earlier in this episode; "
                "call reset() to start a new one"
            )
        try:
            verb, first, second = self._parse(action)
        except ActionParseError as error:
            return self.invalid_action(error.feedback)
        try:
            return self._play(verb, first, second)
        except BrowserFailure as failure:
            self._tab.close_context()
            self._failure = f"the browser crashed or stopped answering ({_first_line(failure)})"
            raise BrowserCrashed(
                f"web/browser-v0: {self._failure}; the episode cannot go on. The next reset() "
                "opens a new tab (and starts a new Chromium if this one died)."
            ) from None

    def _play(self, verb: str, first: str, second: str) -> Turn:
        problem = self._act(verb, first, second)
        observation = self._snapshot()
        if problem is not None and problem.startswith("!"):
            return self.invalid_action(problem[1:] + "\n\n" + observation)
        done = check(self.task, self._site, self._path(), self._answer)
        text = (f"{problem}\n" if problem else "") + observation
        if done:
            return Turn(
                text + "\nTask complete.",
                reward=1.0,
                terminated=True,
                success=True,
                info=self._screenshot_info(),
            )
        if verb == "answer":
            return Turn(
                text + f"\nThe answer {first!r} is wrong.",
                reward=0.0,
                terminated=True,
                info=self._screenshot_info(),
            )
        return Turn(text, info=self._screenshot_info())

    def _parse(self, text: str) -> tuple[str, str, str]:
        raw = self.parser.parse(text)
        match = _ACTION.match(raw.strip())
        if match is None:
            raise ActionParseError(
                f"not an action: {raw!r:.80}",
                feedback=(
                    f"{raw[:80]!r} is not an action. Use click [id], type [id] [text], "
                    "select [id] [option], goto [url], "
                    f"scroll [up|down], back or answer [text]. {self.parser.instructions}"
                ),
            )
        verb, first, second = (
            match.group(1).lower(),
            (match.group(2) or "").strip(),
            (match.group(3) or "").strip(),
        )
        needs = {
            "click": 1,
            "type": 2,
            "select": 2,
            "goto": 1,
            "scroll": 1,
            "answer": 1,
            "back": 0,
        }[verb]
        if needs >= 1 and not first or needs == 2 and not match.group(3):
            example = {
                "click": "click [3]",
                "type": "type [3] [hello]",
                "select": "select [4] [Pro]",
                "goto": "goto [/contact]",
                "scroll": "scroll [down]",
                "answer": "answer [42]",
            }[verb]
            raise ActionParseError(
                f"{verb} without arguments",
                feedback=f"{verb} needs arguments in brackets, e.g. {example}.",
            )
        return verb, first, second

    def _element(self, ref: str) -> str | None:
        """The selector of element ``[ref]`` of the latest observation, or None."""
        if not ref.isdigit() or not any(e["id"] == int(ref) for e in self.elements):
            return None
        return f'[data-envhub-id="{int(ref)}"]'

    def _act(self, verb: str, first: str, second: str) -> str | None:
        """Do the action; return None, a note, or '!feedback' for an invalid action."""
        tab, page, action_s = self._tab, self._tab.page, self.action_timeout_s + GRACE_S
        try:
            if verb == "answer":
                self._answer = first
                return None
            if verb == "back":
                tab.call(
                    lambda: page.go_back(wait_until="domcontentloaded"),
                    self.page_timeout_s + GRACE_S,
                    "going back",
                )
                return None
            if verb == "scroll":
                if first.lower() not in ("up", "down"):
                    return f"!scroll takes [up] or [down], not [{first[:20]}]."
                delta = 600 if first.lower() == "down" else -600
                tab.call(lambda: page.mouse.wheel(0, delta), self.action_timeout_s, "scrolling")
                return None
            if verb == "goto":
                base = self._ensure_server()
                url = urljoin(base + "/", first)
                if not url.startswith(base + "/"):
                    return f"!goto is limited to this site ({base}); use a path like /contact."
                if self.task.get("kind") in NAVIGATION_KINDS and urlsplit(url).path != "/":
                    return (
                        "!goto is off in navigation tasks (finding the page is the task): "
                        "follow the site's links; goto [/] returns to the home page."
                    )
                return tab.goto(url)
            selector = self._element(first)
            if selector is None:
                return (
                    f"!There is no element [{first[:20]}] on this page; "
                    "use an id from the latest observation."
                )
            doing = f"{verb}ing [{first[:20]}]".replace("typeing", "typing")
            if verb == "click":
                tab.call(lambda: page.locator(selector).click(), action_s, doing)
                try:
                    tab.call(
                        lambda: page.wait_for_load_state(
                            "domcontentloaded", timeout=self.page_timeout_s * 1000
                        ),
                        self.page_timeout_s + GRACE_S,
                        "waiting for the page to load",
                    )
                except BrowserFailure:
                    raise
                except Exception as error:
                    if "timeout" in str(error).lower():
                        tab.stop_loading()
                        return f"The page did not load within {self.page_timeout_s:g}s."
                    raise
            elif verb == "type":
                tab.call(lambda: page.locator(selector).fill(second), action_s, doing)
            else:
                tab.call(
                    lambda: page.locator(selector).select_option(label=second), action_s, doing
                )
        except BrowserFailure:
            raise
        except Exception as error:
            if tab.dead(error):
                raise BrowserFailure(str(error)) from error
            if "timeout" in str(error).lower():
                tab.stop_loading()  # e.g. ``back`` to a page that did not load
            return f"!The {verb} did not work: {str(error).splitlines()[0][:200]}"
        return None

    # ------------------------------------------------------------------ agents
    def _find(self, role: str, name: str) -> int | None:
        for element in self.elements:
            if element["role"] == role and element["name"].lower().startswith(name.lower()):
                return int(element["id"])
        return None

    def expert_action(self) -> str | None:
        if self.done or not self.task:
            return None
        wrap, path, kind = self.parser.wrap, self._path(), self.task["kind"]
        if kind == "member-id":
            if path == "/settings/profile":
                return wrap(f"answer [{self.task['member_id']}]")
            target = ("link", "Profile") if path == "/settings" else ("link", "Settings")
        elif kind == "store-hours":
            target = ("link", self.task["city"]) if path == "/stores" else ("link", "Stores")
        else:
            form = "/signup" if kind == "signup" else "/contact"
            if path != form:
                return wrap(
                    f"click [{self._find('link', 'Sign up' if kind == 'signup' else 'Contact')}]"
                )
            fields = [
                ("textbox", "Full name", self.task.get("name")),
                ("textbox", "Email", self.task.get("email")),
                ("textbox", "Subject", self.task.get("subject")),
                ("textbox", "Message", self.task.get("message")),
            ]
            for role, name, want in fields:
                element = next(
                    (e for e in self.elements if e["role"] == role and e["name"] == name), None
                )
                if want and element is not None and element["value"] != want:
                    return wrap(f"type [{element['id']}] [{want}]")
            plan = next((e for e in self.elements if e["role"] == "combobox"), None)
            if kind == "signup" and plan is not None and plan["value"] != self.task["plan"]:
                return wrap(f"select [{plan['id']}] [{self.task['plan']}]")
            terms = next((e for e in self.elements if e["role"] == "checkbox"), None)
            if kind == "signup" and terms is not None and not terms["checked"]:
                return wrap(f"click [{terms['id']}]")
            target = ("button", "Create account" if kind == "signup" else "Send message")
        return wrap(f"click [{self._find(*target)}]")

    def sample_action(self, np_random: np.random.Generator) -> str:
        ids = [e["id"] for e in self.elements] or [1]
        pick = int(np_random.choice(ids))
        roll = np_random.random()
        if roll < 0.55:
            return self.parser.wrap(f"click [{pick}]")
        if roll < 0.75:
            return self.parser.wrap(
                f"type [{pick}] [{np_random.choice(['hello', 'Ada Park', 'test@example.org'])!s}]"
            )
        if roll < 0.82:
            return self.parser.wrap(f"scroll [{np_random.choice(['up', 'down'])!s}]")
        if roll < 0.88:
            return self.parser.wrap("back")
        if roll < 0.94:
            return self.parser.wrap(
                f"goto [{np_random.choice(['/', '/contact', '/stores', '/nowhere'])!s}]"
            )
        return "I am not sure what to do."

    # ------------------------------------------------------------------ lifecycle
    def on_close(self) -> None:
        self._tab.close()
        if self._stop_server is not None:
            self._stop_server()
            self._stop_server, self._base_url = None, None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_stop_server", "_base_url", "_failure"):
            state[key] = None  # a copy opens its own browser context and site
        state["_site"] = TaskSite()
        state["_tab"] = BrowserTab(
            page_timeout_s=self.page_timeout_s, action_timeout_s=self.action_timeout_s
        )
        return state


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0][:200] if str(error) else type(error).__name__
