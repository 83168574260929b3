"""``envhub view``: a web page over run folders (curves, episodes, transcripts, tokens).

``create_app`` (``envhub.view.app``) builds the ASGI app; ``envhub.view.cli`` is the command.
"""

from __future__ import annotations

from envhub.view.app import Viewer, create_app

__all__ = ["Viewer", "create_app"]
