"""``envhub eval`` driven as a user types it, for the eval tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from envhub.cli import main


def eval_cli(*args: str) -> Result:
    """``envhub eval ARGS`` on a 200-column terminal (no table is cut)."""
    return CliRunner().invoke(main, ["eval", *args], env={"COLUMNS": "200"})


def summary_rows(out: Path) -> dict[str, dict[str, Any]]:
    """``--out``'s ``summary.json`` rows by env id."""
    return {row["env_id"]: row for row in json.loads((out / "summary.json").read_text())}
