"""``envhub serve``: serve env pools over WebSocket sessions and HTTP.

Only click is imported at module level; FastAPI, uvicorn and Ray load when the command runs.
``-k [ID:]KEY=VALUE`` sets an env's constructor kwargs (as ``envhub check -k``; with several
``--env``, each flag names its env). Before serving, one env per ``--env`` is built in this
process (not with ``--backend ray``, whose workers may have packages this machine lacks): an
env that cannot be built is one ``error: cannot serve ID: ...`` line and exit code 2. Then
the port is bound, before anything starts: a port in use is one ``error: cannot listen on
HOST:PORT (...); pick another --port`` line and exit code 2.

SIGTERM (or a first Ctrl-C) drains: new sessions and resets are refused, running episodes
get ``--drain-timeout`` seconds to finish (the line it prints says how many and how long),
then every session and worker is closed and the process exits 0. A second signal stops now:
every connected client is told the hub is going away (close code 1001: ``RemoteEnv`` raises
``SessionLostError`` instead of trying to resume), the workers are stopped, and the process
prints ``stopped`` and exits 128 + the signal's number (130 for Ctrl-C). A third signal skips
the workers' shutdown.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from envhub.cli import import_option

__all__ = ["env_kwargs", "run", "serve", "unbuildable", "uvicorn_config"]

BACKLOG = 4096
"""Connections the listening socket queues before the hub accepts them."""


@click.command("serve")
@click.option("--env", "envs", multiple=True, required=True, help="Env id to serve (repeatable).")
@click.option(
    "--kwarg",
    "-k",
    "kwarg_flags",
    multiple=True,
    metavar="[ID:]KEY=VALUE",
    help=(
        "Constructor kwarg of a served env (repeatable; VALUE is JSON, else text); with several "
        "--env, name the env: -k games/guess-number-v0:high=1000."
    ),
)
@click.option("--workers", default=2, show_default=True, help="Workers per env.")
@click.option(
    "--backend",
    type=click.Choice(["local", "ray", "inline"]),
    default="local",
    show_default=True,
    help=(
        "local: worker processes; ray: Ray actors; inline: in the server process (trusted envs "
        "only)."
    ),
)
@click.option(
    "--address",
    "ray_address",
    default=None,
    help="Ray cluster address for --backend ray ('auto' joins the local cluster).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--protocol",
    type=click.Choice(["envhub", "openenv"]),
    default="envhub",
    show_default=True,
    help=(
        "openenv: also speak OpenEnv's protocol at the root (one --env), so OpenEnv's client "
        "connects to http://HOST:PORT; every hub speaks it under /openenv/<env id>."
    ),
)
@click.option("--port", default=8000, show_default=True)
@click.option(
    "--token",
    envvar="ENVHUB_TOKEN",
    default=None,
    help="Bearer token clients must send, at least 8 characters (or set ENVHUB_TOKEN).",
)
@click.option("--no-auth", is_flag=True, help="Serve without a token (loopback hosts only).")
@click.option(
    "--max-sessions", default=4096, show_default=True, help="Open sessions, all clients together."
)
@click.option("--max-sessions-per-client", default=1024, show_default=True)
@click.option("--max-message-bytes", default=1 << 20, show_default=True)
@click.option(
    "--idle-timeout",
    "idle_timeout_s",
    default=600.0,
    show_default=True,
    help="Close a connected session silent this long (s).",
)
@click.option(
    "--stall-timeout",
    "stall_timeout_s",
    default=20.0,
    show_default=True,
    help="Drop a connection whose client leaves what it is sent unread this long (s).",
)
@click.option(
    "--grace",
    "grace_s",
    default=120.0,
    show_default=True,
    help="How long a dropped session may be resumed (s).",
)
@click.option(
    "--step-timeout",
    "step_timeout_s",
    default=60.0,
    show_default=True,
    help="Kill a worker whose env call runs longer (s).",
)
@click.option(
    "--worker-restarts",
    default=5,
    show_default=True,
    help="Starts of a crashed worker's replacement tried before its pool gives up.",
)
@click.option(
    "--worker-retry",
    "worker_retry_s",
    default=30.0,
    show_default=True,
    help="How long a pool that gave up answers env_unavailable before a reset retries (s).",
)
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    default=30.0,
    show_default=True,
    help="On SIGTERM or Ctrl-C, time running episodes get to finish (s); a second one stops now.",
)
@click.option(
    "--request-timeout",
    "request_timeout_s",
    default=10.0,
    show_default=True,
    help="Close a connection that has not sent its whole HTTP request or upgrade in this time (s).",
)
@click.option(
    "--max-unauthenticated",
    default=256,
    show_default=True,
    help="Connections without the token held at once; past it the oldest is closed.",
)
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
)
@import_option
def serve(
    envs: tuple[str, ...],
    kwarg_flags: tuple[str, ...],
    port: int,
    log_level: str,
    no_auth: bool,
    **settings: Any,
) -> None:
    """Serve environments to remote clients: envhub.make(ID, hub="ws://HOST:PORT", token=...)."""
    from pydantic import ValidationError

    from envhub.errors import EnvhubError
    from envhub.server.config import HubConfig

    kwargs = env_kwargs(envs, kwarg_flags)
    try:
        config = HubConfig(envs=list(envs), env_kwargs=kwargs, allow_no_auth=no_auth, **settings)
    except ValidationError as exc:
        problems = "; ".join(
            (
                f"{'.'.join(map(str, e['loc'])) or 'settings'}: "
                f"{e['msg'].removeprefix('Value error, ')}"
            )
            for e in exc.errors()
        )
        raise click.UsageError(problems) from None
    if config.backend != "ray":
        problem = unbuildable(config)
        if problem is not None:
            click.echo(f"error: cannot serve {problem}", err=True)
            sys.exit(2)
    try:
        run(config, port=port, log_level=log_level)
    except EnvhubError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)


def env_kwargs(envs: tuple[str, ...], flags: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``-k`` flags as kwargs per env id: ``KEY=VALUE`` for the only ``--env``, ``ID:KEY=VALUE``
    for any; values read as ``envhub check -k`` reads them (JSON, else text)."""
    from envhub.cli import _parse_kwargs

    kwargs: dict[str, dict[str, Any]] = {}
    for flag in flags:
        head, sep, value = flag.partition("=")
        env_id, colon, key = head.rpartition(":")
        if not colon:
            if len(envs) != 1:
                raise click.UsageError(
                    f"-k {flag!r}: with several --env, name the env the kwarg is for: "
                    f"-k {envs[0]}:{flag}"
                )
            env_id = envs[0]
        elif env_id not in envs:
            raise click.UsageError(
                f"-k {flag!r} names {env_id}, which is not served (--env {' --env '.join(envs)})"
            )
        kwargs.setdefault(env_id, {}).update(_parse_kwargs((f"{key}{sep}{value}",)))
    return kwargs


def unbuildable(config: Any) -> str | None:
    """``"ID: why"`` for the first env of ``config`` that cannot be built with its kwargs, on one
    line (the error, and where the env's code raised it), or ``None`` when each builds."""
    for env_id in config.envs:
        why = _why_unbuildable(env_id, config.env_kwargs.get(env_id, {}))
        if why is not None:
            return f"{env_id}: " + " / ".join(filter(None, map(str.strip, why.splitlines())))
    return None


def _why_unbuildable(env_id: str, kwargs: dict[str, Any]) -> str | None:
    """Build ``env_id`` once and close it; why that failed (as ``envhub check`` says it), or
    ``None``."""
    from envhub.check_workers import why_build_failed
    from envhub.errors import EnvhubError, describe_error
    from envhub.registry import make

    try:
        make(env_id, **kwargs).close()
    except EnvhubError as exc:  # the registry's own errors say what to fix
        return describe_error(exc)
    except Exception as exc:  # noqa: BLE001 - an env's constructor may raise anything
        return why_build_failed(exc)
    return None


def run(config: Any, *, port: int, log_level: str = "warning") -> None:
    """Run a hub on ``config.host`` and ``port`` until SIGTERM/SIGINT, then drain and return;
    a second signal stops it at once and exits 128 + its number (module docstring).
    ``EnvhubError`` naming the fix when the port cannot be bound (before anything starts)."""
    from envhub.gc_tuning import relax_gc
    from envhub.ports import listen
    from envhub.server.app import create_app
    from envhub.server.guard import raise_fd_limit

    sock = listen(config.host, port, BACKLOG)  # bound first: a port in use is one error line
    if config.backend == "ray":
        # Join before uvicorn starts: a failure is a clean error (exit 2) instead of a lifespan
        # traceback, and uvicorn installs its SIGTERM handler (the drain) after ray.init installed
        # its own.
        from envhub.pool.ray import connect

        connect(config.ray_address)
    fd_limit = raise_fd_limit()
    relax_gc()  # this process holds every session's socket, request and answer in flight
    app = create_app(config)
    guard = app.state.hub.guard
    # flooders may take a quarter of the fds
    guard.max_unauthenticated = min(guard.max_unauthenticated, max(8, fd_limit // 4))
    # a burst of clients still being read may use the fds that sessions leave free
    guard.burst_limit = max(guard.max_unauthenticated, fd_limit - config.max_sessions - 64)
    if fd_limit < config.max_sessions + guard.max_unauthenticated + 64:
        click.echo(
            (
                f"envhub: warning: the open-file limit is {fd_limit}, below --max-sessions "
                f"{config.max_sessions} plus headroom; sessions past it will be refused: raise the "
                "hard limit (ulimit -Hn, LimitNOFILE=) or lower --max-sessions"
            ),
            err=True,
        )
    server = DrainingServer(
        uvicorn_config(app, port=port, log_level=log_level, loop="uvloop"), hub=app.state.hub
    )
    host = f"[{config.host}]" if ":" in config.host else config.host  # (IPv6, bracketed)
    click.echo(
        (
            f"envhub: serving {', '.join(config.envs)} on ws://{host}:{sock.getsockname()[1]} "
            f"(pid {os.getpid()})"
        ),
        err=True,
    )
    server.run(sockets=[sock])
    if server.stopped_by is not None:
        click.echo("envhub: stopped", err=True)
        sys.exit(128 + server.stopped_by)


def uvicorn_config(app: Any, *, port: int, log_level: str = "warning", loop: str = "auto") -> Any:
    """The ``uvicorn.Config`` a hub runs under: guarded httptools, sans-io websockets, the hub's
    size limits.

    Tests start their hubs with it too, so they exercise the same timeouts and guards.
    """
    import uvicorn

    from envhub.server.guard import guarded_protocol, ws_protocol

    hub = app.state.hub
    return uvicorn.Config(
        app,
        host=hub.config.host,
        port=port,
        loop=loop,
        # request read timeout, head size cap, cap on connections without the token
        http=guarded_protocol(hub.guard),
        ws=ws_protocol(hub.config.stall_timeout_s),  # sans-io websockets
        ws_max_size=2 * hub.config.max_message_bytes,
        ws_per_message_deflate=False,
        ws_ping_interval=20.0,  # a client that vanishes is dropped after ~40 s, one that stops
        ws_ping_timeout=20.0,  # reading after --stall-timeout; its session then waits --grace
        timeout_keep_alive=5,  # an idle HTTP connection between requests
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
        backlog=BACKLOG,
    )


def _server_class() -> Any:
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn, with a first SIGTERM/SIGINT starting the hub's drain instead of exiting, and
        a second one stopping at once after telling every client (module docstring).

        Signals are handled here, not passed to ``uvicorn.Server.handle_exit``: uvicorn would
        raise them again once stopped, and a Ctrl-C then ends as click's ``Aborted!``."""

        def __init__(self, config: Any, hub: Any) -> None:
            super().__init__(config)
            self.hub = hub
            self.signals: list[int] = []
            self.stopped_by: int | None = None
            """The signal that stopped the hub without a drain (None: it drained)."""
            self._drain_task: Any = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signals.append(sig)
            if len(self.signals) == 2:
                self.stopped_by = sig  # (on_tick tells the clients, then stops)
            elif len(self.signals) > 2:  # stop without waiting for the workers' shutdown
                self.should_exit = self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.stopped_by is not None:
                if self._drain_task is not None:
                    self._drain_task.cancel()
                click.echo(
                    "envhub: stopping now: telling every client the hub is going away", err=True
                )
                await self.hub.go_away()
                return True
            if self.signals and self._drain_task is None:
                import asyncio

                click.echo(f"envhub: draining: {self._waits_for()}", err=True)
                self._drain_task = asyncio.get_running_loop().create_task(self.hub.drain())
            if self._drain_task is not None and self._drain_task.done():
                return True
            return await super().on_tick(counter)

        def _waits_for(self) -> str:
            running = self.hub.running_episodes()
            if not running:
                return "no episode is running; closing the sessions"
            them = "it" if running == 1 else "them"
            return (
                f"{running} episode{'s' if running != 1 else ''} running; waiting up to "
                f"{self.hub.config.drain_timeout_s:g} s (--drain-timeout) for {them} to finish; "
                "Ctrl-C again to stop now"
            )

    return _DrainingServer


def DrainingServer(config: Any, *, hub: Any) -> Any:  # a class-named factory: keeps uvicorn lazy
    """A ``uvicorn.Server`` that drains the hub on the first SIGTERM/SIGINT."""
    return _server_class()(config, hub)
