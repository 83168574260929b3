"""The shop website behind ``web/shop-v0``: a generated catalogue served as plain HTML.

``Catalogue(seed)`` draws a few hundred products (category, brand, attributes, option
choices such as colour and size, price) from one seed. ``ShopSite`` is a WSGI application
with the pages of a small online shop, in the spirit of WebShop:

``/``                       the search page (a search form)
``/search?q=...&page=N``    ten results per page, with next/previous links
``/item/<id>?q=..&page=..&<option>=<value>``   a product page: options, description, buy
``/buy/<id>?<option>=<value>``                 the order confirmation

All state lives in the URL (chosen options, the query, the page), so the site is stateless
and deterministic. The env drives it in-process (``ShopSite.get``) or over real HTTP
(``serve_site``), and a browser can use it too.
"""

from __future__ import annotations

import html
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import numpy as np

__all__ = ["RESULTS_PER_PAGE", "Catalogue", "Product", "ShopSite", "serve_site"]

RESULTS_PER_PAGE = 10
CATEGORIES: dict[str, dict[str, Any]] = {
    "running shoes": {
        "attributes": ["waterproof", "lightweight", "breathable", "cushioned", "vegan", "wide fit"],
        "options": {
            "color": ["black", "white", "navy", "red", "grey"],
            "size": ["7", "8", "9", "10", "11", "12"],
        },
        "price": (35, 160),
    },
    "headphones": {
        "attributes": [
            "wireless",
            "noise cancelling",
            "foldable",
            "long battery",
            "waterproof",
            "lightweight",
        ],
        "options": {"color": ["black", "silver", "blue", "rose gold"]},
        "price": (15, 320),
    },
    "backpack": {
        "attributes": [
            "waterproof",
            "anti theft",
            "laptop sleeve",
            "lightweight",
            "usb charging",
            "large capacity",
        ],
        "options": {
            "color": ["black", "olive", "grey", "blue"],
            "capacity": ["20 l", "30 l", "40 l"],
        },
        "price": (20, 140),
    },
    "coffee mug": {
        "attributes": [
            "insulated",
            "dishwasher safe",
            "ceramic",
            "leak proof",
            "microwave safe",
            "stainless steel",
        ],
        "options": {
            "color": ["white", "black", "green", "red"],
            "capacity": ["12 oz", "16 oz", "20 oz"],
        },
        "price": (8, 45),
    },
    "desk lamp": {
        "attributes": [
            "dimmable",
            "led",
            "usb charging",
            "adjustable arm",
            "touch control",
            "eye caring",
        ],
        "options": {"color": ["white", "black", "silver"]},
        "price": (14, 90),
    },
    "t-shirt": {
        "attributes": [
            "organic cotton",
            "slim fit",
            "moisture wicking",
            "quick dry",
            "crew neck",
            "v neck",
        ],
        "options": {
            "color": ["white", "black", "navy", "heather grey", "red"],
            "size": ["small", "medium", "large", "x-large"],
        },
        "price": (9, 55),
    },
    "yoga mat": {
        "attributes": [
            "non slip",
            "extra thick",
            "eco friendly",
            "lightweight",
            "with strap",
            "foldable",
        ],
        "options": {
            "color": ["purple", "blue", "black", "green"],
            "thickness": ["4 mm", "6 mm", "8 mm"],
        },
        "price": (15, 95),
    },
    "water bottle": {
        "attributes": [
            "insulated",
            "bpa free",
            "leak proof",
            "stainless steel",
            "with straw",
            "lightweight",
        ],
        "options": {
            "color": ["black", "white", "teal", "orange"],
            "capacity": ["500 ml", "750 ml", "1 l"],
        },
        "price": (9, 50),
    },
}
_BRAND_PARTS = ["Arc", "Nor", "Vel", "Kin", "Tor", "Lum", "Sol", "Bri", "Cor", "Zen", "Pel", "Dax"]
_BRAND_ENDS = ["ora", "ix", "ex", "umi", "ant", "ova", "ly", "en"]
_WORD = re.compile(r"[a-z0-9]+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Product:
    id: str
    category: str
    brand: str
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]] = field(hash=False)
    price: float
    rating: float

    @property
    def title(self) -> str:
        return f"{self.brand} {' '.join(self.attributes[:2])} {self.category}".replace("  ", " ")


class Catalogue:
    """``size`` products drawn from ``seed``; a BM25 index over title and attributes."""

    def __init__(self, seed: int = 0, size: int = 320) -> None:
        rng = np.random.default_rng(seed)
        self.seed = seed
        brands = sorted({f"{a}{b}" for a in _BRAND_PARTS for b in _BRAND_ENDS})
        self.products: list[Product] = []
        categories = list(CATEGORIES)
        for index in range(size):
            category = categories[index % len(categories)]
            spec = CATEGORIES[category]
            attributes = tuple(
                str(a)
                for a in rng.choice(spec["attributes"], size=int(rng.integers(2, 4)), replace=False)
            )
            options = {
                name: tuple(
                    sorted(
                        (
                            str(v)
                            for v in rng.choice(
                                values, size=int(rng.integers(2, len(values) + 1)), replace=False
                            )
                        ),
                        key=values.index,
                    )
                )
                for name, values in spec["options"].items()
            }
            low, high = spec["price"]
            self.products.append(
                Product(
                    id=f"P{index:04d}",
                    category=category,
                    brand=str(rng.choice(brands)),
                    attributes=attributes,
                    options=options,
                    price=round(float(rng.uniform(low, high)), 2),
                    rating=round(float(rng.uniform(2.5, 5.0)), 1),
                )
            )
        self.by_id = {p.id: p for p in self.products}
        self._terms = [
            Counter(
                _tokens(
                    f"{p.title} {p.category} {' '.join(p.attributes)} "
                    f"{' '.join(v for vs in p.options.values() for v in vs)}"
                )
            )
            for p in self.products
        ]
        frequency: Counter[str] = Counter()
        for terms in self._terms:
            frequency.update(terms.keys())
        self._idf = {t: math.log(1 + (size - f + 0.5) / (f + 0.5)) for t, f in frequency.items()}
        self._average = sum(sum(t.values()) for t in self._terms) / size

    def search(self, query: str) -> list[Product]:
        """Products matching ``query``, best first (ties broken by id, so deterministic)."""
        words = _tokens(query)
        scored = []
        for index, terms in enumerate(self._terms):
            length = sum(terms.values())
            score = sum(
                self._idf[w]
                * terms[w]
                * 2.2
                / (terms[w] + 1.2 * (0.25 + 0.75 * length / self._average))
                for w in words
                if w in terms
            )
            if score > 0:
                scored.append((-round(score, 9), index))
        return [self.products[index] for _, index in sorted(scored)]


def _page(title: str, instruction: str, body: str) -> bytes:
    banner = (
        f'<div id="instruction">Instruction: {html.escape(instruction)}</div>'
        if instruction
        else ""
    )
    return (
        f"<!doctype html><html><head><title>{html.escape(title)}</title></head>"
        f"<body>{banner}{body}</body></html>"
    ).encode()


def _link(href: str, label: str) -> str:
    return f'<a href="{html.escape(href, quote=True)}">{html.escape(label)}</a>'


class ShopSite:
    """The shop as a WSGI app (see the module docstring). ``instruction`` is shown on every page."""

    def __init__(self, catalogue: Catalogue, instruction: str = "") -> None:
        self.catalogue = catalogue
        self.instruction = instruction

    # ------------------------------------------------------------------ pages
    def render(self, path: str, query: dict[str, str]) -> tuple[int, bytes]:
        if path in ("", "/"):
            return 200, self._search_page()
        if path == "/search":
            return 200, self._results(query.get("q", ""), int(query.get("page", "1") or 1))
        match = re.fullmatch(r"/(item|buy)/(P\d{4})", path)
        if match and match.group(2) in self.catalogue.by_id:
            product = self.catalogue.by_id[match.group(2)]
            return 200, (
                self._item(product, query)
                if match.group(1) == "item"
                else self._bought(product, query)
            )
        return 404, _page(
            "Not found",
            self.instruction,
            f"<p>No page at {html.escape(path)}.</p>{_link('/', 'Back to Search')}",
        )

    def _search_page(self) -> bytes:
        form = (
            '<form action="/search" method="get">'
            '<input type="text" name="q" aria-label="Search">'
            '<button type="submit">Search</button></form>'
        )
        return _page("Shop", self.instruction, f"<h1>Shop</h1>{form}")

    def _results(self, q: str, page: int) -> bytes:
        hits = self.catalogue.search(q)
        pages = max(1, math.ceil(len(hits) / RESULTS_PER_PAGE))
        page = min(max(1, page), pages)
        parts = [
            _link("/", "Back to Search"),
            f"<p>Page {page} of {pages} (total results: {len(hits)})</p>",
        ]
        if page > 1:
            parts.append(_link("/search?" + urlencode({"q": q, "page": page - 1}), "< Prev"))
        if page < pages:
            parts.append(_link("/search?" + urlencode({"q": q, "page": page + 1}), "Next >"))
        parts.append("<ul>")
        for product in hits[(page - 1) * RESULTS_PER_PAGE : page * RESULTS_PER_PAGE]:
            href = f"/item/{product.id}?" + urlencode({"q": q, "page": page})
            parts.append(
                f"<li>{_link(href, product.id)} {html.escape(product.title)} "
                f"| ${product.price:.2f}</li>"
            )
        parts.append("</ul>")
        return _page(f"Results for {q}", self.instruction, "".join(parts))

    def _item(self, product: Product, query: dict[str, str]) -> bytes:
        chosen = {
            k: v for k, v in query.items() if k in product.options and v in product.options[k]
        }
        base = {"q": query.get("q", ""), "page": query.get("page", "1")}
        parts = [
            _link("/", "Back to Search"),
            _link("/search?" + urlencode(base), "< Prev"),
            f"<h1>{html.escape(product.title)}</h1>",
            f"<p>Price: ${product.price:.2f}</p><p>Rating: {product.rating}</p>",
        ]
        for name, values in product.options.items():
            parts.append(f"<div><span>{html.escape(name)}:</span> ")
            for value in values:
                href = f"/item/{product.id}?" + urlencode({**base, **chosen, name: value})
                label = f"{value} (selected)" if chosen.get(name) == value else value
                parts.append(_link(href, label) + " ")
            parts.append("</div>")
        parts.append(f"<p>Features: {html.escape(', '.join(product.attributes))}</p>")
        parts.append(_link(f"/buy/{product.id}?" + urlencode(chosen), "Buy Now"))
        return _page(product.title, self.instruction, "".join(parts))

    def _bought(self, product: Product, query: dict[str, str]) -> bytes:
        chosen = ", ".join(f"{k}: {v}" for k, v in query.items() if k in product.options)
        return _page(
            "Thank you",
            self.instruction,
            (
                "<h1>Thank you for your order</h1>"
                f"<p>You bought {product.id} ({html.escape(product.title)}) "
                f"{html.escape(chosen)}.</p>"
            ),
        )

    # ------------------------------------------------------------------ transports
    def get(self, url: str) -> tuple[int, str]:
        """Fetch a page in-process (no socket): ``(status, html)``."""
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        status, body = self.render(parts.path, query)
        return status, body.decode()

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        query = {
            k: v[-1]
            for k, v in parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).items()
        }
        status, body = self.render(environ.get("PATH_INFO", "/"), query)
        start_response(
            f"{status} {'OK' if status == 200 else 'Not Found'}",
            [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def serve_site(app: Callable[..., Any], port: int = 0) -> tuple[str, Callable[[], None]]:
    """Serve a WSGI app on ``127.0.0.1:port`` in a daemon thread; return ``(base_url, stop)``."""
    server = make_server(
        "127.0.0.1", port, app, server_class=_ThreadingServer, handler_class=_QuietHandler
    )
    # shutdown() waits for the loop's next poll: 0.1 s (not the default 0.5 s) per env close
    thread = threading.Thread(
        target=server.serve_forever, args=(0.1,), name="envhub-site", daemon=True
    )
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return f"http://127.0.0.1:{server.server_address[1]}", stop
