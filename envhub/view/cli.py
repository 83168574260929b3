"""``envhub view RUN_DIR ... [--host 127.0.0.1] [--port 8080] [--token T]``."""

from __future__ import annotations

import secrets
import socket

import click

from envhub.cli import _fail, console
from envhub.errors import EnvhubError
from envhub.ports import listen
from envhub.view.security import LOOPBACK

__all__ = ["link", "view_command"]

_ANY = ("0.0.0.0", "::", "")
"""Hosts that bind every interface: no address another machine can open."""


def link(host: str, port: int, token: str | None) -> str:
    """The URL to open the page at. Bound to every interface (``0.0.0.0``, ``::``), it names
    this machine (its host name) instead: ``http://0.0.0.0:8080/`` opens nothing on the machine
    of a colleague it is sent to."""
    name = socket.gethostname() if host in _ANY else host
    shown = f"[{name}]" if ":" in name else name  # an IPv6 address in a URL is bracketed
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


@click.command("view")
@click.argument("run_dirs", nargs=-1, required=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--port", default=8080, show_default=True, help="Port (0: any free port).")
@click.option(
    "--token",
    default=None,
    help="Needed by every request; required to bind anywhere but loopback ('auto' makes one).",
)
def view_command(run_dirs: tuple[str, ...], host: str, port: int, token: str | None) -> None:
    """Browse runs in a web page: curves, episodes, transcripts token by token (read-only).

    A folder of runs (runs/) shows every run in it."""
    import uvicorn

    from envhub.view.app import create_app

    if token == "auto":
        token = secrets.token_urlsafe(16)
    if host not in LOOPBACK and not token:
        _fail(
            EnvhubError(
                f"--host {host} exposes the runs beyond this machine; add --token SECRET "
                "(or --token auto) so only people with the link can read them"
            )
        )
    try:
        app = create_app(run_dirs, token=token, host=host)
    except EnvhubError as error:
        _fail(error)
    try:
        sock = listen(host, port)
    except EnvhubError as error:
        _fail(error)
    url = link(host, sock.getsockname()[1], token)
    console.print(f"envhub view: {', '.join(run_dirs)} at {url}", soft_wrap=True, highlight=False)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])
