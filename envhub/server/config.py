"""``HubConfig``: every setting of ``envhub serve``, validated once, in one place."""

from __future__ import annotations

import ipaddress
import json
import shlex
from typing import Any, Literal

from pydantic import Field, model_validator

from envhub.server.wire import Strict

__all__ = ["HubConfig", "is_loopback", "kwarg_flags", "serve_command"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_command(env_id: str, kwargs: dict[str, Any]) -> str:
    """The ``envhub serve`` command line that serves ``env_id`` built with ``kwargs`` (for error
    messages that tell a client how to get an env configured: a hub builds its envs itself)."""
    return " ".join(filter(None, ["envhub serve --env", shlex.quote(env_id), kwarg_flags(kwargs)]))


def kwarg_flags(kwargs: dict[str, Any]) -> str:
    """``kwargs`` as the ``-k KEY=VALUE`` flags of ``envhub serve``/``check``/``play``, each value
    written so ``-k`` reads it back as it is (JSON, or text that is not JSON), shell-quoted."""
    flags = []
    for key, value in kwargs.items():
        text = value if isinstance(value, str) and not _reads_as_json(value) else None
        if text is None:
            text = json.dumps(value, default=str)
        flags.append(f"-k {shlex.quote(f'{key}={text}')}")
    return " ".join(flags)


def _reads_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class HubConfig(Strict):
    """Settings of one hub (the CLI flags of ``envhub serve`` map onto these fields)."""

    envs: list[str] = Field(min_length=1, description="Env ids to serve (one pool each).")
    env_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Constructor kwargs per served env id (`envhub serve -k [ID:]KEY=VALUE`).",
    )
    workers: int = Field(default=2, ge=1, le=1024, description="Workers per env pool.")
    backend: Literal["local", "process", "inline", "ray"] = "local"
    ray_address: str | None = Field(
        default=None, description="`ray.init(address=...)`; 'auto' joins the local cluster."
    )
    host: str = "127.0.0.1"
    protocol: Literal["envhub", "openenv"] = Field(
        default="envhub",
        description=(
            "openenv: also answer OpenEnv's routes (/ws, /schema, /metadata) at the root for the "
            "one env served; every hub answers them under /openenv/<env id>."
        ),
    )
    token: str | None = Field(
        default=None, min_length=8, description="Bearer token every client must send."
    )
    allow_no_auth: bool = Field(
        default=False, description="Serve without a token; only allowed on a loopback host."
    )
    max_sessions: int = Field(
        default=4096, ge=1, description="Open sessions, all clients together."
    )
    max_sessions_per_client: int = Field(
        default=1024, ge=1, description="Open sessions per client (token + address)."
    )
    max_message_bytes: int = Field(
        default=1 << 20, ge=1024, description="Largest WebSocket message or HTTP body accepted."
    )
    idle_timeout_s: float = Field(
        default=600.0, gt=0, description="A connected session silent this long is closed."
    )
    grace_s: float = Field(
        default=120.0,
        ge=0,
        description="How long a dropped session waits for its client to resume.",
    )
    stall_timeout_s: float = Field(
        default=20.0,
        gt=0,
        description="A connection whose client leaves what it is sent unread this long is dropped.",
    )
    hello_timeout_s: float = Field(
        default=10.0, gt=0, description="Time a new connection has to send `hello`."
    )
    request_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Time a connection has to send a whole HTTP request (head and body) or WebSocket "
            "upgrade; then it is closed."
        ),
    )
    max_unauthenticated: int = Field(
        default=256,
        ge=1,
        description=(
            "Open connections that have not sent the token; past it the oldest is closed (capped "
            "at a quarter of the open-file limit)."
        ),
    )
    step_timeout_s: float = Field(
        default=60.0, gt=0, description="A worker call running longer is killed (episode fails)."
    )
    reset_wait_s: float = Field(
        default=30.0, gt=0, description="How long a reset waits for a free pool slot."
    )
    worker_restarts: int = Field(
        default=5,
        ge=1,
        le=100,
        description=(
            "Starts of a crashed worker's replacement tried in a row before its pool gives up "
            "(resets then get env_unavailable)."
        ),
    )
    worker_retry_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a pool that gave up answers env_unavailable before a reset retries.",
    )
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="On SIGTERM, how long running episodes may finish."
    )

    @model_validator(mode="after")
    def _auth(self) -> HubConfig:
        if self.token is None and not self.allow_no_auth:
            raise ValueError(
                "no token: pass --token (or set ENVHUB_TOKEN) so only your clients can connect; "
                "--no-auth is accepted on a loopback host only"
            )
        if self.token is None and not is_loopback(self.host):
            raise ValueError(
                f"--no-auth with --host {self.host!r} would let anyone on the network run envs; "
                "bind 127.0.0.1 or pass --token"
            )
        if self.protocol == "openenv" and len(self.envs) != 1:
            raise ValueError(
                f"--protocol openenv serves one env at the root, got {len(self.envs)} (--env "
                f"{' --env '.join(self.envs)}); serve one per hub, or reach each under "
                "/openenv/<env id> on a hub with the default protocol"
            )
        stray = sorted(set(self.env_kwargs) - set(self.envs))
        if stray:
            raise ValueError(
                f"env kwargs are given for {', '.join(stray)}, which is not served; add --env "
                f"{stray[0]} or drop its -k flags"
            )
        if self.ray_address is not None and self.backend != "ray":
            raise ValueError(
                f"--address {self.ray_address!r} is only used with --backend ray (got --backend "
                f"{self.backend})"
            )
        return self
