"""Web environments, registered under the ``web/`` namespace.

``web/shop-v0`` is a WebShop-like text shop served locally (``search[...]``/``click[...]``);
``web/browser-v0`` drives real headless Chromium through Playwright on local pages, with
accessibility-tree text observations and element-id actions.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register every web env with the envhub registry (called by the registry itself)."""
    from envhub.registry import register
    from envs.web.browser_site import NAVIGATION_KINDS

    register(
        "web/shop-v0",
        "envs.web.shop:ShopEnv",
        max_turns=15,
        description=(
            "WebShop-style shopping on a local site: "
            "search[...] and click[...] to buy the instructed product."
        ),
        variants={"http": {"transport": "http"}},
    )
    register(
        "web/browser-v0",
        "envs.web.browser:BrowserEnv",
        max_turns=15,
        description=(
            "Real headless Chromium on local pages: "
            "forms and navigation by element id (needs chromium)."
        ),
        variants={
            "forms": {"kinds": ["signup", "contact"]},
            "navigation": {"kinds": list(NAVIGATION_KINDS)},
        },
    )
