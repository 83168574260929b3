"""``Hub``: the state behind one ``envhub serve``: pools, sessions, metrics, drain.

The FastAPI app (``envhub.server.app``) and the WebSocket handler (``envhub.server.ws``)
hold no state of their own; they call into the ``Hub`` kept on ``app.state.hub``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
from typing import Any

from envhub.pool import EnvPool
from envhub.server.config import HubConfig
from envhub.server.guard import ConnectionGuard
from envhub.server.metrics import HubMetrics
from envhub.server.sessions import Session, SessionManager

__all__ = ["Hub"]


class Hub:
    """Pools (one per served env), the session manager, metrics and the drain logic."""

    def __init__(self, config: HubConfig) -> None:
        from envhub.registry import spec

        self.config = config
        self.specs = {env_id: spec(env_id) for env_id in config.envs}  # fail fast on unknown ids
        self.pools: dict[str, EnvPool] = {}
        self.sessions = SessionManager(
            max_sessions=config.max_sessions,
            max_sessions_per_client=config.max_sessions_per_client,
            idle_timeout_s=config.idle_timeout_s,
            grace_s=config.grace_s,
            on_close=self._on_session_closed,
        )
        self.metrics = HubMetrics(lambda: self.pools, self.sessions.counts)
        self.awaiting_hello: dict[str, int] = {}
        """WebSocket connections per client that are authenticated but have not sent ``hello``
        yet."""
        self.draining = False
        self.drained = asyncio.Event()
        self._token = config.token.encode() if config.token else None
        self._reaper: asyncio.Task[None] | None = None
        self.guard = ConnectionGuard(
            read_timeout_s=config.request_timeout_s,
            max_unauthenticated=config.max_unauthenticated,
            authorised=self.authorised,
            on_drop=lambda reason: self.metrics.rejected.labels(reason).inc(),
        )
        """Bounds connections that have not shown the token (used by
        ``envhub.server.cli.uvicorn_config``)."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start every pool and the reaper; raises ``WorkerStartError`` on a bad env,
        ``RayConnectError`` when ``--backend ray`` cannot join its cluster."""
        # `envhub serve` has joined already (envhub.server.cli.run)
        if self.config.backend == "ray":
            from envhub.pool.ray import connect

            connect(self.config.ray_address)
        for env_id, env_spec in self.specs.items():
            pool = EnvPool(
                env_spec,
                num_workers=self.config.workers,
                backend=self.config.backend,
                env_kwargs=self.config.env_kwargs.get(env_id),
                step_timeout_s=self.config.step_timeout_s,
                max_episodes=self.config.max_sessions,
                restart_attempts=self.config.worker_restarts,
                retry_after_s=self.config.worker_retry_s,
            )
            self.pools[env_id] = pool
            try:
                await pool.start()
            except BaseException:
                await asyncio.gather(
                    *(p.aclose() for p in self.pools.values()), return_exceptions=True
                )
                raise
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def stop(self) -> None:
        """Close every session and pool (after a drain, or at once). The sessions' envs are
        closed in the background (``SessionManager.discard``): their workers get the closes
        before they are stopped, and nothing waits behind a busy worker's queue."""
        if self._reaper is not None:
            self._reaper.cancel()
        await self.go_away()
        for session in list(self.sessions.sessions.values()):
            self.sessions.discard(session, "shutdown")
        await asyncio.gather(
            *(pool.aclose() for pool in self.pools.values()), return_exceptions=True
        )
        # the workers are stopped: every close left has its answer (or never will)
        await self.sessions.wait_closed(timeout_s=1.0)

    async def go_away(self, timeout_s: float = 2.0) -> None:
        """Tell every connected client that the hub is shutting down now: the ``draining`` error,
        then close code 1001, on which ``RemoteEnv`` raises ``SessionLostError`` at once instead
        of trying to resume a session for its ``resume_timeout_s``. Waits (at most
        ``timeout_s``) for those frames to be sent: the server closes its sockets next."""
        connections = [s.conn for s in self.sessions.sessions.values() if s.conn is not None]
        for connection in connections:
            connection.kick(1001, _going_away())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(c.sent() for c in connections)), timeout_s)

    def running_episodes(self) -> int:
        """Sessions in the middle of an episode (what a drain waits for)."""
        return sum(s.running or bool(s.busy_seq) for s in self.sessions.sessions.values())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(
                min(1.0, self.config.idle_timeout_s / 4, max(self.config.grace_s / 4, 0.05))
            )
            with contextlib.suppress(Exception):  # the reaper must outlive any one bad session
                await self.sessions.reap()
                self.metrics.tick()

    def _on_session_closed(self, session: Session, reason: str) -> None:
        self.metrics.sessions_closed.labels(reason).inc()

    def max_turns(self, env_id: str) -> Any:
        """The turn limit ``env_id`` is served with (an int or None): its ``-k max_turns``, else
        its spec's; the wire types check it."""
        spec = self.specs[env_id]
        return {**spec.kwargs, **self.config.env_kwargs.get(env_id, {})}.get(
            "max_turns", spec.max_turns
        )

    # ------------------------------------------------------------------ health
    def problems(self) -> list[str]:
        """What a client would hit now (a full pool, no live worker), one line each with the fix;
        empty when healthy."""
        found = []
        if len(self.sessions.sessions) >= self.config.max_sessions:
            found.append(
                f"the hub holds its maximum of {self.config.max_sessions} sessions; new ones get "
                "too_many_sessions (raise --max-sessions)"
            )
        for env_id, pool in self.pools.items():
            stats = pool.stats()
            if stats.capacity is not None and stats.episodes >= stats.capacity:
                found.append(
                    f"{env_id}: all {stats.capacity} episode slots are in use; new resets wait "
                    f"{self.config.reset_wait_s:g} s, then get pool_busy (clients should close "
                    "finished sessions; or raise --max-sessions)"
                )
            if pool.given_up and not pool.closed:
                found.append(
                    f"{env_id}: no worker could be started (last error: {pool.last_worker_error});"
                    f" resets get env_unavailable until one retries, {pool.retry_after_s:g} s after"
                    " the pool gave up (fix the env)"
                )
            elif stats.workers_alive == 0 and not pool.closed:
                found.append(
                    f"{env_id}: no worker is running (last error: "
                    f"{pool.last_worker_error or 'none yet'}); replacements are being started"
                )
        return found

    # ------------------------------------------------------------------ auth
    def authorised(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the hub's token: ``Bearer TOKEN``, or
        HTTP Basic with the token as the password (what a client sends for a URL
        ``http://user:TOKEN@host``; OpenEnv's client can pass a token no other way)."""
        if self._token is None:
            return True
        credential = _credential(header)
        return credential is not None and hmac.compare_digest(credential, self._token)

    def client_key(self, header: str | None, host: str | None) -> str:
        """Who a connection belongs to, for per-client limits: a digest of the credential its
        header carries (not of the header: other spacing, or a Basic user name, is the same
        client) + its address."""
        digest = hashlib.sha256(_credential(header) or b"").hexdigest()[:12]
        return f"{digest}@{host or '?'}"

    # ------------------------------------------------------------------ drain
    async def drain(self) -> None:
        """Refuse new sessions and resets; let running episodes finish; then close all."""
        if self.draining:
            await self.drained.wait()
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        notice = _draining()
        for session in list(self.sessions.sessions.values()):
            if session.conn is not None:
                session.conn.notify(notice)
        while True:
            for session in list(self.sessions.sessions.values()):
                if not session.running and not session.busy_seq:
                    if session.conn is not None:
                        session.conn.kick(1001, notice)
                    self.sessions.discard(session, "drained")
            if not self.sessions.sessions or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        await self.stop()
        self.drained.set()


def _draining() -> str:
    return (
        '{"type":"draining","message":"the hub is shutting down: finish this episode; new '
        'sessions and resets are refused"}'
    )


def _going_away() -> str:
    return (
        '{"type":"error","code":"draining","message":"the hub shut down; reconnect to another '
        'hub","seq":null}'
    )


def _credential(header: str | None) -> bytes | None:
    """The token an ``Authorization`` header carries (``Bearer TOKEN``, or the password of
    ``Basic``); None when it carries none."""
    if not header:
        return None
    if header.startswith("Bearer "):
        return header[7:].strip().encode()
    if header.startswith("Basic "):
        try:
            decoded = base64.b64decode(header[6:].strip(), validate=True)
        except ValueError:
            return None
        return decoded.partition(b":")[2]
    return None
