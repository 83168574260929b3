"""HTML to the text a model reads: visible text, with links and buttons as ``[label]``.

``page_to_text(html)`` returns the page text and the *clickables*: a mapping from each
link or button label to its target, in page order. Text-only web envs (``web/shop-v0``)
show ``[label]`` where the element is and accept ``click[label]``; a form with a text
input named ``q`` is a search box and accepts ``search[...]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

__all__ = ["PageText", "page_to_text"]

_BLOCK = {"p", "div", "li", "h1", "h2", "h3", "ul", "form", "br", "tr", "title", "section"}
_SKIP = {"script", "style", "head"}


@dataclass
class PageText:
    text: str
    clickables: dict[str, str] = field(default_factory=dict)
    """Label -> href (links) or ``"submit"`` (buttons)."""
    has_search: bool = False


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.clickables: dict[str, str] = {}
        self.has_search = False
        self._skip = 0
        self._href: str | None = None
        self._label: list[str] = []
        self._button = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag in _SKIP:
            self._skip += 1
        elif tag == "a" and attributes.get("href"):
            self._href, self._label = attributes["href"], []
        elif tag == "button":
            self._button, self._label = True, []
        elif tag == "input" and attributes.get("name") == "q":
            self.has_search = True
            self.out.append("[Search box: use search[your query]]")
        if tag in _BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP:
            self._skip = max(0, self._skip - 1)
        elif tag == "a" and self._href is not None:
            self._emit(self._href)
            self._href = None
        elif tag == "button" and self._button:
            self._button = False
            if not self.has_search:
                self._emit("submit")
        if tag in _BLOCK:
            self.out.append("\n")

    def _emit(self, target: str) -> None:
        label = " ".join("".join(self._label).split())
        if label:
            key = label.removesuffix(" (selected)")
            self.clickables.setdefault(key, target)
            self.out.append(f"[{label}]")

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        if self._href is not None or self._button:
            self._label.append(data)
        else:
            self.out.append(data)


def page_to_text(html: str) -> PageText:
    """The visible text of ``html`` with its clickables (see the module docstring)."""
    reader = _Reader()
    reader.feed(html)
    reader.close()
    lines = [" ".join(line.split()) for line in "".join(reader.out).split("\n")]
    text = re.sub(r"\n{2,}", "\n", "\n".join(line for line in lines if line)).strip()
    return PageText(text=text, clickables=reader.clickables, has_search=reader.has_search)
