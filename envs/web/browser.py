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
episode. A page that does not load within ``page_timeout_s`` is an observation saying so;
a browser that crashes ends the episode as failed (``info["failed"]``), never a hang.
Navigation is confined to the local site; in the navigation tasks (member ID, store hours)
``goto`` goes home only, since typing a guessed address would skip the task.
"""

from __future__ import annotations

import base64
import contextlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

import numpy as np

from envhub.core import TextEnv, Turn
from envhub.errors import ActionParseError
from envhub.parsing import ActionParser
from envs.datasets import Split, TaskSet, as_taskset
from envs.web.browser_pool import BrowserPool
from envs.web.browser_site import NAVIGATION_KINDS, TASK_KINDS, TaskSite, check, make_task
from envs.web.shop_site import serve_site

__all__ = ["SNAPSHOT_JS", "BrowserEnv"]

SNAPSHOT_JS = r"""
() => {
  const lines = [], elements = [];
  let next = 0;
  const clean = (s) => (s || '').replace(/\s+/g, ' ').trim().slice(0, 100);
  const visible = (el) => {
    const s = getComputedStyle(el);
    return s.display !== 'none' && s.visibility !== 'hidden';
  };
  const roleOf = (el) => {
    if (el.getAttribute('role')) return el.getAttribute('role');
    const t = el.tagName;
    if (t === 'A') return 'link';
    if (t === 'BUTTON') return 'button';
    if (t === 'SELECT') return 'combobox';
    if (t === 'TEXTAREA') return 'textbox';
    const type = (el.getAttribute('type') || 'text').toLowerCase();
    const roles = {checkbox: 'checkbox', radio: 'radio', submit: 'button', button: 'button'};
    return roles[type] || 'textbox';
  };
  const nameOf = (el) => clean(el.getAttribute('aria-label')
      || (el.labels && el.labels.length ? el.labels[0].innerText : '')
      || el.getAttribute('placeholder') || (el.tagName === 'SELECT' ? '' : el.innerText)
      || el.getAttribute('name') || '');
  document.querySelectorAll('[data-envhub-id]')
    .forEach((el) => el.removeAttribute('data-envhub-id'));
  const walk = (node, depth) => {
    for (const child of node.childNodes) {
      if (child.nodeType === 3) {
        const text = clean(child.textContent);
        if (text && !child.parentElement.closest('a,button,label,select,textarea,option')) {
          lines.push('  '.repeat(depth) + 'text "' + text + '"');
        }
        continue;
      }
      if (child.nodeType !== 1 || !visible(child)) continue;
      if (['SCRIPT', 'STYLE', 'NOSCRIPT'].includes(child.tagName)) continue;
      const tag = child.tagName;
      const control = ['A', 'BUTTON', 'INPUT', 'SELECT', 'TEXTAREA'].includes(tag);
      if (control && !(tag === 'INPUT' && child.type === 'hidden')) {
        next += 1;
        child.setAttribute('data-envhub-id', String(next));
        const role = roleOf(child), name = nameOf(child);
        let line = '  '.repeat(depth) + '[' + next + '] ' + role + ' "' + name + '"';
        let value = '';
        if (role === 'checkbox' || role === 'radio') {
          line += child.checked ? ' checked' : ' unchecked';
        } else if (tag === 'SELECT') {
          value = child.selectedIndex >= 0 ? clean(child.options[child.selectedIndex].text) : '';
          const options = Array.from(child.options).map((o) => clean(o.text)).join(', ');
          line += ' value="' + value + '" options=[' + options + ']';
        } else if (tag === 'INPUT' || tag === 'TEXTAREA') {
          value = child.value;
          line += ' value="' + clean(value) + '"';
        }
        lines.push(line);
        elements.push({id: next, role: role, name: name, value: value, checked: !!child.checked});
        continue;
      }
      if (/^H[1-6]$/.test(tag)) {
        lines.push('  '.repeat(depth) + 'heading "' + clean(child.innerText) + '"');
        continue;
      }
      if (tag === 'LABEL') {
        const own = Array.from(child.childNodes).filter((n) => n.nodeType === 3);
        const text = clean(own.map((n) => n.textContent).join(' '));
        if (text && !child.control) lines.push('  '.repeat(depth) + 'text "' + text + '"');
      }
      walk(child, ['FORM', 'UL', 'NAV', 'MAIN', 'SECTION'].includes(tag) ? depth + 1 : depth);
    }
  };
  walk(document.body, 0);
  return {text: lines.join('\n'), elements: elements, title: document.title};
}
"""
_ACTION = re.compile(
    r"^(click|type|select|goto|scroll|back|answer)\b\s*(?:\[(.*?)\])?\s*(?:\[(.*)\])?\s*$",
    re.IGNORECASE | re.DOTALL,
)


class BrowserFailure(Exception):
    """The browser died or stopped answering; the episode cannot go on."""


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
        self._site = TaskSite()
        self._base_url: str | None = None
        self._stop_server: Callable[[], None] | None = None
        self._pool: BrowserPool | None = None
        self._context: Any = None
        self._page: Any = None
        self._cdp: Any = None

    # ------------------------------------------------------------------ browser plumbing
    def _ensure_server(self) -> str:
        if self._base_url is None:
            self._base_url, self._stop_server = serve_site(self._site)
        return self._base_url

    def _new_page(self) -> None:
        if self._pool is None:
            self._pool = BrowserPool.for_this_thread()
            self._pool.attach()
        self._drop_context()
        self._context = self._pool.context(viewport={"width": 1024, "height": 768})
        self._page = self._context.new_page()
        self._page.set_default_timeout(self.action_timeout_s * 1000)
        self._page.set_default_navigation_timeout(self.page_timeout_s * 1000)
        self._cdp = self._context.new_cdp_session(self._page)

    def _open_home(self, base: str) -> str | None:
        """Show the site's home page in a tab that holds nothing of an earlier episode; return a
        note if it did not load.

        The env keeps its tab between episodes: a new context and page start a renderer
        process, most of what a reset used to cost. What a tab keeps is cleared instead: the
        site's storage and cookies and the HTTP cache before the page loads, the history after
        it (a fresh tab's history would hold ``about:blank``, where ``back`` used to lead)."""
        if self._page is None:
            self._new_page()
        else:
            try:
                self._cdp.send(
                    "Storage.clearDataForOrigin", {"origin": base, "storageTypes": "all"}
                )
                self._cdp.send("Network.clearBrowserCache")
                self._context.clear_cookies()
            except Exception as error:  # a dead browser: a new one; anything else: a new tab
                if self._browser_dead(error):
                    raise BrowserFailure(str(error)) from error
                self._new_page()
        note = self._goto(base + "/")
        try:
            self._cdp.send("Page.resetNavigationHistory")
        except Exception as error:  # (the caller retries once in a new tab)
            raise BrowserFailure(str(error)) from error
        return note

    def _drop_context(self) -> None:
        if self._context is not None:
            with contextlib.suppress(Exception):  # its browser may have crashed
                self._context.close()
        self._context = self._page = self._cdp = None

    def _snapshot(self) -> str:
        try:
            data = self._page.evaluate(SNAPSHOT_JS)
        except Exception as error:
            if self._browser_dead(error):
                raise BrowserFailure(str(error)) from error
            return f"(the page could not be read: {str(error).splitlines()[0][:200]})"
        self.elements = data["elements"]
        text = f"URL: {self._path()}\nTitle: {data['title']}\n{data['text']}"
        if len(text) > self.max_observation_chars:
            text = text[: self.max_observation_chars] + "\n... [page truncated]"
        return text

    def _browser_dead(self, error: BaseException) -> bool:
        message = str(error).lower()
        try:
            connected = (
                self._context is not None
                and self._context.browser is not None
                and self._context.browser.is_connected()
            )
        except Exception:  # noqa: BLE001 - a browser that cannot answer counts as disconnected
            connected = False
        return (
            not connected or "closed" in message or "crash" in message or "disconnected" in message
        )

    def _path(self) -> str:
        try:
            return urlsplit(self._page.url).path or "/"
        except Exception:  # noqa: BLE001 - a closed or crashed page has no URL to show
            return "/"

    def _goto(self, url: str) -> str | None:
        """Navigate; return a note if the page did not load (the episode goes on)."""
        try:
            self._page.goto(url, wait_until="domcontentloaded")
        except Exception as error:
            if self._browser_dead(error):
                raise BrowserFailure(str(error)) from error
            if "timeout" in str(error).lower():
                return (
                    f"The page {urlsplit(url).path} did not load within {self.page_timeout_s:g}s."
                )
            return (
                f"The page {urlsplit(url).path} could not be opened: "
                f"{str(error).splitlines()[0][:200]}"
            )
        return None

    # ------------------------------------------------------------------ episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        chosen = self.tasks.select(options, self.np_random)
        self.task = {
            **make_task(chosen["kind"], int(chosen["seed"])),
            **{k: v for k, v in chosen.items() if k not in ("id", "seed", "split")},
        }
        self._site.reset(member_id=self.task.get("member_id", "M-000000"))
        base = self._ensure_server()
        self._answer = None
        try:
            note = self._open_home(base)
            page = self._snapshot()
        except BrowserFailure:  # a crashed pooled browser: the pool relaunches on retry
            self._new_page()
            note, page = self._open_home(base), self._snapshot()
        text = f"Task: {self.task['instruction']}\n\n{page}" + (f"\n{note}" if note else "")
        return text, {"task_id": chosen["id"], "kind": self.task["kind"], **self._screenshot_info()}

    def _screenshot_info(self) -> dict[str, Any]:
        if not self.screenshot or self._page is None:
            return {}
        try:
            return {"screenshot_png": base64.b64encode(self._page.screenshot()).decode()}
        except Exception:  # noqa: BLE001 - the screenshot is optional: the step goes on without it
            return {}

    def on_step(self, action: str) -> Turn:
        try:
            verb, first, second = self._parse(action)
        except ActionParseError as error:
            return self.invalid_action(error.feedback)
        try:
            problem = self._act(verb, first, second)
            observation = self._snapshot()
        except BrowserFailure as failure:
            self._drop_context()
            return Turn(
                f"The browser crashed ({str(failure).splitlines()[0][:200]}). The episode ends.",
                terminated=True,
                info={"failed": True, "error": str(failure)[:500]},
            )
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

    def _element(self, ref: str) -> Any:
        if not ref.isdigit() or not any(e["id"] == int(ref) for e in self.elements):
            return None
        return self._page.locator(f'[data-envhub-id="{int(ref)}"]')

    def _act(self, verb: str, first: str, second: str) -> str | None:
        """Do the action; return None, a note, or '!feedback' for an invalid action."""
        try:
            if verb == "answer":
                self._answer = first
                return None
            if verb == "back":
                self._page.go_back(wait_until="domcontentloaded")
                return None
            if verb == "scroll":
                if first.lower() not in ("up", "down"):
                    return f"!scroll takes [up] or [down], not [{first[:20]}]."
                self._page.mouse.wheel(0, 600 if first.lower() == "down" else -600)
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
                return self._goto(url)
            element = self._element(first)
            if element is None:
                return (
                    f"!There is no element [{first[:20]}] on this page; "
                    "use an id from the latest observation."
                )
            if verb == "click":
                element.click()
                try:
                    self._page.wait_for_load_state(
                        "domcontentloaded", timeout=self.page_timeout_s * 1000
                    )
                except Exception as error:
                    if "timeout" in str(error).lower():
                        return f"The page did not load within {self.page_timeout_s:g}s."
                    raise
            elif verb == "type":
                element.fill(second)
            else:
                element.select_option(label=second)
        except BrowserFailure:
            raise
        except Exception as error:
            if self._browser_dead(error):
                raise BrowserFailure(str(error)) from error
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
        self._drop_context()
        if self._pool is not None:
            self._pool.detach()
            self._pool = None
        if self._stop_server is not None:
            self._stop_server()
            self._stop_server, self._base_url = None, None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_pool", "_context", "_page", "_cdp", "_stop_server", "_base_url"):
            state[key] = None  # a copy opens its own browser context and site
        state["_site"] = TaskSite()
        return state
