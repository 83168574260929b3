"""The hub server: ``envhub serve`` (FastAPI + uvicorn) and its wire protocol.

``create_app(HubConfig(...))`` builds the ASGI app; ``envhub.server.cli.serve`` runs it.
Modules: ``wire`` (strict message types), ``sessions`` (resumable sessions, limits,
reaping), ``ws`` (the WebSocket handler), ``hub`` (pools, metrics, drain), ``app`` (HTTP
routes), ``config``. Nothing here is imported by ``import envhub``.
"""

from __future__ import annotations

__all__ = ["HubConfig", "create_app"]


def __getattr__(name: str) -> object:
    if name == "create_app":
        from envhub.server.app import create_app

        return create_app
    if name == "HubConfig":
        from envhub.server.config import HubConfig

        return HubConfig
    raise AttributeError(f"module 'envhub.server' has no attribute {name!r}")
