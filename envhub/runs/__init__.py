"""Run folders: the trajectory store (``store``) and reading runs back (``reader``).

    import envhub.runs

    run = envhub.runs.open("runs/quickstart")
    page = run.episodes(kind="train", success=False, sort="return", limit=20)
    episode = run.episode(page.rows[0]["key"])       # messages, token ids, masks, log-probs

``envhub view RUN_DIR`` (``envhub.view``) serves the same as a web page.
"""

from __future__ import annotations

from envhub.runs.reader import EpisodePage, NotARunError, Run, episode_key, find_runs, open_run
from envhub.runs.store import COLUMNS, LIGHT_COLUMNS, TrajectoryWriter, write_part

__all__ = [
    "COLUMNS",
    "LIGHT_COLUMNS",
    "EpisodePage",
    "NotARunError",
    "Run",
    "TrajectoryWriter",
    "episode_key",
    "find_runs",
    "open",
    "open_run",
    "write_part",
]

open = open_run  # envhub.runs.open(path): as the builtin opens a file, this opens a run
