"""``web/shop-v0``: buy the product an instruction describes, on a locally served shop.

In the spirit of WebShop (Yao et al., 2022). Each episode draws a target product from the
generated catalogue and writes an instruction from it ("i need a waterproof, lightweight
running shoes in navy, size 9, price lower than 80.00 dollars"). The agent sees the text
of each page (``[label]`` marks what can be clicked) and acts with ``search[query]`` on the
search page or ``click[label]`` on any page. Buying ends the episode with

    reward = type_match * (matched attributes + matched options + price ok)
                        / (attributes + options + 1)

where ``type_match`` is 1 for the requested category and 0.1 otherwise: the WebShop
reward, simplified. The site is the WSGI app in ``shop_site``; pages are fetched
in-process by default, or over real HTTP from a local server with ``transport="http"``
(same observations). Tasks can be bound with ``dataset=`` (records with ``instruction``
and ``goal``: ``{"category", "attributes", "options", "max_price"}``), and so can one task
with ``reset(options={"task": ...})``: both fields, or neither (then the instruction and its
goal are drawn from the task's ``seed``); an instruction without its goal is refused.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import numpy as np

from envhub.core import TextEnv, Turn
from envhub.errors import ActionParseError
from envhub.parsing import ActionParser
from envs.datasets import Split, TaskSet, TaskSetError, as_taskset
from envs.web.page_text import PageText, page_to_text
from envs.web.shop_site import Catalogue, Product, ShopSite, serve_site

__all__ = ["ShopEnv", "shop_reward"]

TASK_FIELDS = ("instruction", "goal")
"""A custom task's fields: the instruction shown and the goal it is graded against."""
GOAL_FIELDS = '{"category", "attributes", "options", "max_price"}'
_ACTION = re.compile(r"^(search|click)\s*\[(.*)\]$", re.IGNORECASE | re.DOTALL)


def shop_reward(
    product: Product, chosen: Mapping[str, str], goal: Mapping[str, Any]
) -> dict[str, float]:
    """The reward of buying ``product`` with ``chosen`` options for ``goal`` and its parts."""
    attributes = list(goal.get("attributes", []))
    options = dict(goal.get("options", {}))
    matched_attributes = sum(a in product.attributes for a in attributes)
    matched_options = sum(chosen.get(k) == v for k, v in options.items())
    price_ok = float(product.price <= float(goal.get("max_price", float("inf"))))
    type_match = 1.0 if product.category == goal.get("category") else 0.1
    total = (matched_attributes + matched_options + price_ok) / (len(attributes) + len(options) + 1)
    return {
        "reward": round(type_match * total, 6),
        "type_match": type_match,
        "attributes": matched_attributes,
        "options": matched_options,
        "price_ok": price_ok,
    }


def make_goal(product: Product, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
    """An instruction and its goal for buying ``product`` (drawn with ``rng``)."""
    attributes = sorted(
        str(a)
        for a in rng.choice(product.attributes, size=min(2, len(product.attributes)), replace=False)
    )
    options = {name: str(rng.choice(values)) for name, values in product.options.items()}
    max_price = round(product.price * float(rng.uniform(1.1, 1.6)) + 1, 0)
    wants = ", ".join(f"{name} {value}" for name, value in options.items())
    text = (
        f"i need {' and '.join(attributes)} {product.category} with {wants}, "
        f"and price lower than {max_price:.2f} dollars"
    )
    return text, {
        "category": product.category,
        "attributes": attributes,
        "options": options,
        "max_price": max_price,
        "target": product.id,
    }


class ShopEnv(TextEnv):
    """Find and buy the instructed product with ``search[...]`` and ``click[...]``."""

    def __init__(
        self,
        *,
        catalogue_seed: int = 0,
        catalogue_size: int = 320,
        transport: Literal["inprocess", "http"] = "inprocess",
        dataset: str | TaskSet | Iterable[Mapping[str, Any]] | None = None,
        split: Split = "all",
        max_turns: int | None = 15,
        page_timeout_s: float = 10.0,
        invalid_action_penalty: float = -0.05,
        render_mode: Any = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if transport not in ("inprocess", "http"):
            raise ValueError(f"transport must be 'inprocess' or 'http', got {transport!r}")
        self.catalogue_seed, self.catalogue_size, self.transport = (
            catalogue_seed,
            catalogue_size,
            transport,
        )
        self.catalogue = Catalogue(catalogue_seed, catalogue_size)
        self.site = ShopSite(self.catalogue)
        self.page_timeout_s = page_timeout_s
        self.invalid_action_penalty = invalid_action_penalty
        builtin = [{"id": f"shop-{i:04d}", "seed": 30_000 + i} for i in range(500)]
        self.tasks = as_taskset(
            dataset,
            default=builtin,
            split=split,
            required=TASK_FIELDS if dataset is not None else (),
        )
        self.parser = ActionParser(format="tag", max_length=500)
        self.system_prompt = (
            "You are shopping on a website. "
            "Each page is shown as text; [label] marks a link or button. "
            "Act with search[query] on the search page or click[label] to click. "
            "Buy the product that best "
            f"matches the instruction, with the requested options. {self.parser.instructions}"
        )
        self.goal: dict[str, Any] = {}
        self.url = "/"
        self.page = PageText("")
        self._base_url: str | None = None
        self._stop_server: Callable[[], None] | None = None

    # ------------------------------------------------------------------ pages
    def _fetch(self, url: str) -> str:
        if self.transport == "inprocess":
            return self.site.get(url)[1]
        if self._base_url is None:
            self._base_url, self._stop_server = serve_site(self.site)
        try:
            with urllib.request.urlopen(
                urljoin(self._base_url, url), timeout=self.page_timeout_s
            ) as response:
                return response.read().decode()
        except urllib.error.HTTPError as error:
            return error.read().decode()

    def _goto(self, url: str) -> str:
        self.url = url
        self.page = page_to_text(self._fetch(url))
        return self.page.text

    # ------------------------------------------------------------------ episode
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        task = self.tasks.select(options, self.np_random)
        given = [key for key in TASK_FIELDS if key in task]
        if given and len(given) < len(TASK_FIELDS):  # a dataset's records were checked when bound
            missing = [key for key in TASK_FIELDS if key not in task]
            raise TaskSetError(
                f"options['task'] has {given} but lacks {missing}: a shop "
                f"instruction is graded against its goal {GOAL_FIELDS}; give both, or neither "
                "to draw an instruction and its goal from the task's seed"
            )
        if given:
            instruction, self.goal = str(task["instruction"]), dict(task["goal"])
        else:
            rng = np.random.default_rng(int(task["seed"]))
            product = self.catalogue.products[int(rng.integers(len(self.catalogue.products)))]
            instruction, self.goal = make_goal(product, rng)
        self.site.instruction = instruction
        return self._goto("/"), {"task_id": task["id"], "instruction": instruction}

    def on_step(self, action: str) -> Turn:
        try:
            verb, argument = self._parse(action)
        except ActionParseError as error:
            return self.invalid_action(error.feedback)
        if verb == "search":
            return Turn(self._goto("/search?" + urlencode({"q": argument, "page": 1})))
        target = self._match_clickable(argument)
        if target is None:
            shown = ", ".join(f"[{label}]" for label in list(self.page.clickables)[:15])
            return self.invalid_action(
                f"There is no [{argument[:80]}] on this page. You can click: {shown or 'nothing'}."
            )
        text = self._goto(target)
        if urlsplit(target).path.startswith("/buy/"):
            return self._bought(target, text)
        return Turn(text)

    def _parse(self, text: str) -> tuple[str, str]:
        raw = self.parser.parse(text)
        match = _ACTION.match(raw.strip())
        if match is None:
            raise ActionParseError(
                f"not an action: {raw!r:.80}",
                feedback=(
                    f"{raw[:80]!r} is not an action. Use search[query] or click[label]. "
                    f"{self.parser.instructions}"
                ),
            )
        verb, argument = match.group(1).lower(), match.group(2).strip()
        if verb == "search" and not self.page.has_search:
            raise ActionParseError(
                "no search box",
                feedback="There is no search box on this page; click [Back to Search] first.",
            )
        if not argument:
            raise ActionParseError(
                "empty argument", feedback=f"{verb}[...] needs something inside the brackets."
            )
        return verb, argument

    def _match_clickable(self, label: str) -> str | None:
        clickables = self.page.clickables
        if label in clickables:
            return clickables[label]
        folded = {key.lower(): value for key, value in clickables.items()}
        return folded.get(label.lower().removesuffix(" (selected)"))

    def _bought(self, url: str, text: str) -> Turn:
        parts = urlsplit(url)
        product = self.catalogue.by_id[parts.path.rsplit("/", 1)[-1]]
        chosen = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        score = shop_reward(product, chosen, self.goal)
        reward = score.pop("reward")
        return Turn(
            text + f"\nReward: {reward:.2f}",
            reward=reward,
            terminated=True,
            success=reward >= 1.0,
            info={"bought": product.id, "options": chosen, **score},
        )

    # ------------------------------------------------------------------ agents
    def expert_action(self) -> str | None:
        if self.done or not self.goal.get("target"):
            return None
        target = self.catalogue.by_id[self.goal["target"]]
        wrap = self.parser.wrap
        path = urlsplit(self.url).path
        if self.page.has_search:
            return wrap(f"search[{target.title}]")
        if path == "/search":
            if target.id in self.page.clickables:
                return wrap(f"click[{target.id}]")
            return (
                wrap("click[Next >]")
                if "Next >" in self.page.clickables
                else wrap("click[Back to Search]")
            )
        if path == f"/item/{target.id}":
            chosen = {k: v[-1] for k, v in parse_qs(urlsplit(self.url).query).items()}
            for name, value in self.goal["options"].items():
                if chosen.get(name) != value:
                    return wrap(f"click[{value}]")
            return wrap("click[Buy Now]")
        return wrap("click[Back to Search]")

    def sample_action(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        labels = list(self.page.clickables)
        if self.page.has_search and roll < 0.8:
            words = [
                "shoes",
                "mug",
                "lamp",
                "black",
                "waterproof",
                "bottle",
                "mat",
                "headphones",
                "large",
                "cheap",
            ]
            return self.parser.wrap(
                f"search[{' '.join(str(w) for w in np_random.choice(words, size=2))}]"
            )
        if labels and roll < 0.85:
            return self.parser.wrap(f"click[{labels[int(np_random.integers(len(labels)))]}]")
        return "I will look around." if roll < 0.93 else self.parser.wrap("click[Checkout]")

    def on_close(self) -> None:
        if self._stop_server is not None:
            self._stop_server()
            self._stop_server, self._base_url = None, None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_stop_server"], state["_base_url"] = None, None  # a copy serves its own site
        return state
