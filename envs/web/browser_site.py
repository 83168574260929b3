"""The local website and built-in tasks of ``web/browser-v0``.

``TaskSite`` is a small WSGI app (a members' club site: home, sign-up form, settings with a
profile page, contact form, store pages) that records every form submission, so task
checkers can look at what the agent really submitted. A site built with ``slow_seconds``
also serves ``/slow``, which answers only after that long, for tests of page-load timeouts; the
env's site has none (an agent's ``goto [/slow]`` finds "Not found", not a step that waits out
the page timeout while a server thread sleeps). Each task is a dict ``{"kind", "instruction",
...}`` drawn from a seed; ``check(task, site, url, answer)`` says whether it is done.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

import numpy as np

__all__ = ["TASK_KINDS", "TaskSite", "check", "make_task"]

TASK_KINDS = ("signup", "member-id", "contact", "store-hours")
NAVIGATION_KINDS = ("member-id", "store-hours")
"""Tasks of finding a page through the site's links (``goto`` goes home only)."""
_NAMES = [
    "Ada Park",
    "Bruno Diaz",
    "Chen Wei",
    "Dara Okafor",
    "Elin Berg",
    "Farah Haddad",
    "Goran Petrovic",
    "Hana Sato",
]
_PLANS = ["Basic", "Plus", "Pro"]
_SUBJECTS = ["Billing question", "Lost card", "Change address", "Opening hours"]
_CITIES = ["Lisbon", "Oslo", "Tallinn", "Porto", "Ghent"]


def make_task(kind: str, seed: int) -> dict[str, Any]:
    """A task of ``kind`` with its values drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    if kind == "signup":
        name = str(rng.choice(_NAMES))
        email = name.split()[0].lower() + f"{int(rng.integers(10, 99))}@example.org"
        plan = str(rng.choice(_PLANS))
        return {
            "kind": kind,
            "name": name,
            "email": email,
            "plan": plan,
            "instruction": (
                f"Sign up as {name} with the email {email}, "
                f"choose the {plan} plan and accept the terms."
            ),
        }
    if kind == "member-id":
        member_id = f"M-{int(rng.integers(100000, 999999))}"
        return {
            "kind": kind,
            "member_id": member_id,
            "instruction": (
                "Find your member ID on your profile page (under Settings) and reply answer [ID]."
            ),
        }
    if kind == "contact":
        subject = str(rng.choice(_SUBJECTS))
        body = f"Please call me back about reference {int(rng.integers(1000, 9999))}."
        return {
            "kind": kind,
            "subject": subject,
            "message": body,
            "instruction": (
                f"Send a message through the contact form with the subject '{subject}' "
                f"and the text '{body}'."
            ),
        }
    if kind == "store-hours":
        city = str(rng.choice(_CITIES))
        return {
            "kind": kind,
            "city": city,
            "instruction": f"Open the page with the opening hours of the {city} store.",
        }
    raise ValueError(f"unknown browser task kind {kind!r}; use one of {TASK_KINDS}")


def check(task: dict[str, Any], site: TaskSite, url_path: str, answer: str | None) -> bool:
    """Whether ``task`` is accomplished given the site's records, the page and any answer."""
    kind = task["kind"]
    if kind == "signup":
        want = {"name": task["name"], "email": task["email"], "plan": task["plan"], "terms": "on"}
        return any(
            all(record.get(k) == v for k, v in want.items())
            for record in site.submissions.get("/signup", [])
        )
    if kind == "contact":
        want = {"subject": task["subject"], "message": task["message"]}
        return any(
            all(record.get(k, "").strip() == v for k, v in want.items())
            for record in site.submissions.get("/contact", [])
        )
    if kind == "member-id":
        return answer is not None and answer.strip().strip(".") == task["member_id"]
    if kind == "store-hours":
        return url_path == f"/stores/{task['city'].lower()}"
    return False


def _page(title: str, body: str) -> bytes:
    nav = (
        '<nav><a href="/">Home</a> <a href="/signup">Sign up</a> <a href="/settings">Settings</a> '
        '<a href="/contact">Contact</a> <a href="/stores">Stores</a></nav>'
    )
    return (
        f"<!doctype html><html><head><title>{html.escape(title)}</title></head>"
        f"<body>{nav}<h1>{html.escape(title)}</h1>{body}</body></html>"
    ).encode()


class TaskSite:
    """The members' club site; ``submissions`` maps a form path to the records posted to it.

    ``slow_seconds``: serve ``/slow`` after sleeping that long (tests of page timeouts only)."""

    def __init__(self, member_id: str = "M-000000", slow_seconds: float | None = None) -> None:
        self.member_id = member_id
        self.slow_seconds = slow_seconds
        self.submissions: dict[str, list[dict[str, str]]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "member_id": self.member_id,
            "slow_seconds": self.slow_seconds,
            "submissions": self.submissions,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self, member_id: str) -> None:
        with self._lock:
            self.member_id = member_id
            self.submissions = {}

    def render(self, method: str, path: str, form: dict[str, str]) -> tuple[int, bytes]:
        if method == "POST" and path in ("/signup", "/contact"):
            with self._lock:
                self.submissions.setdefault(path, []).append(form)
            return 200, _page("Thank you", "<p>We received your submission.</p>")
        if path == "/":
            return 200, _page(
                "Members' Club", "<p>Welcome. Use the links above to manage your membership.</p>"
            )
        if path == "/signup":
            options = "".join(f"<option>{p}</option>" for p in _PLANS)
            return 200, _page(
                "Sign up",
                (
                    '<form method="post" action="/signup">'
                    '<label for="name">Full name</label><input id="name" name="name" type="text">'
                    '<label for="email">Email</label><input id="email" name="email" type="email">'
                    '<label for="plan">Plan</label><select id="plan" name="plan">'
                    f'<option value="">Choose a plan</option>{options}</select>'
                    '<label><input name="terms" type="checkbox"> I accept the terms</label>'
                    '<button type="submit">Create account</button></form>'
                ),
            )
        if path == "/settings":
            return 200, _page(
                "Settings",
                (
                    '<ul><li><a href="/settings/notifications">Notifications</a></li>'
                    '<li><a href="/settings/profile">Profile</a></li></ul>'
                ),
            )
        if path == "/settings/notifications":
            return 200, _page(
                "Notifications",
                '<label><input type="checkbox" name="weekly"> Weekly newsletter</label>',
            )
        if path == "/settings/profile":
            return 200, _page(
                "Profile", f"<p>Member since 2019.</p><p>Member ID: {self.member_id}</p>"
            )
        if path == "/contact":
            return 200, _page(
                "Contact us",
                (
                    '<form method="post" action="/contact">'
                    '<label for="subject">Subject</label>'
                    '<input id="subject" name="subject" type="text">'
                    '<label for="message">Message</label>'
                    '<textarea id="message" name="message"></textarea>'
                    '<button type="submit">Send message</button></form>'
                ),
            )
        if path == "/stores":
            links = "".join(f'<li><a href="/stores/{c.lower()}">{c}</a></li>' for c in _CITIES)
            return 200, _page("Our stores", f"<ul>{links}</ul>")
        if path.startswith("/stores/") and path[8:].capitalize() in _CITIES:
            return 200, _page(
                f"{path[8:].capitalize()} store",
                "<p>Opening hours: Mon-Fri 9:00-18:00, Sat 10:00-14:00.</p>",
            )
        if path == "/slow" and self.slow_seconds is not None:  # a test page only
            time.sleep(self.slow_seconds)
            return 200, _page("Finally", "<p>Loaded.</p>")
        return 404, _page("Not found", "<p>There is no such page.</p>")

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        form: dict[str, str] = {}
        if method == "POST":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            raw = environ["wsgi.input"].read(min(length, 100_000)).decode("utf-8", "replace")
            form = {k: v[-1] for k, v in parse_qs(raw, keep_blank_values=True).items()}
        status, body = self.render(method, environ.get("PATH_INFO", "/"), form)
        start_response(
            f"{status} {'OK' if status == 200 else 'Not Found'}",
            [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]
