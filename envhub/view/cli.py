"""``envhub view RUN_DIR ... [--host 127.0.0.1] [--port 8080] [--token T]``."""

from __future__ import annotations

import secrets

import click

from envhub.cli import _fail, console
from envhub.errors import EnvhubError
from envhub.ports import listen
from envhub.view.security import LOOPBACK

__all__ = ["view_command"]


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
    """Browse runs in a web page: curves, episodes, transcripts token by token (read-only)."""
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
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL is bracketed
    url = f"http://{shown}:{bound}/" + (f"?token={token}" if token else "")
    console.print(f"envhub view: {', '.join(run_dirs)} at {url}", soft_wrap=True, highlight=False)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])
