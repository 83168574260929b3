"""What ``envhub view`` protects against, and how. One property per item; one test guards each
(``tests/envhub/test_view_api.py``, ``test_view_page.py``, ``test_view_hostile_page.py``).

1. **Other people on the network.** The server binds loopback unless told otherwise; another
   host needs a token (``cli.py`` refuses to start without one), checked on every request.
2. **Websites the user visits (DNS rebinding).** A page on ``attacker.example`` can make its
   name resolve to 127.0.0.1 and then read the viewer as its own origin. Bound to loopback,
   the app answers only requests whose ``Host`` is a loopback name (``127.0.0.1``,
   ``localhost``, ``[::1]``, any port) or the ``--host`` value; any other is refused (400) by
   Starlette's ``TrustedHostMiddleware``. Bound elsewhere, the token is the guard.
3. **Env text that holds markup.** Run text reaches the page as JSON and is put in the DOM as
   text (``viewer.js``); the ``Content-Security-Policy`` (``default-src 'self'``) would also
   keep an injected inline script or a foreign resource from loading.
4. **Framing and sniffing.** ``frame-ancestors 'none'`` keeps other sites from framing the page
   (click-jacking); ``X-Content-Type-Options: nosniff`` keeps a browser from running a JSON
   answer or a run's file as a script.
5. **Paths.** ``/static/NAME`` serves only the files of ``static/``, nothing above it.

Not covered: a local user of the same machine (loopback is theirs too; use ``--token``), and TLS
(put a reverse proxy in front to serve beyond a trusted network).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["LOOPBACK", "SECURITY_HEADERS", "SecurityHeaders", "allowed_hosts"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
"""Host names that reach only this machine (the viewer binds ``127.0.0.1`` by default)."""

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}
"""Sent with every response (property 3 and 4)."""


def allowed_hosts(host: str) -> list[str]:
    """The ``Host`` header names the app answers when bound to ``host`` (property 2):
    loopback names and ``host`` itself, or any name (``*``) when ``host`` is not loopback."""
    if host not in LOOPBACK:
        return ["*"]
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6
    return sorted({"127.0.0.1", "localhost", "[::1]", bracketed})


class SecurityHeaders:
    """ASGI middleware: adds ``SECURITY_HEADERS`` to every HTTP response (errors included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.headers = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in self.headers}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [*kept, *self.headers]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
