"""Fixtures shared by the run-store, viewer and replay tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 4-step ``envhub train`` of the quickstart (tiny model), evaluated every 2 steps:
    its metrics, trajectory store, checkpoint config and tokenizer, as a user's run has them."""
    pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
    from click.testing import CliRunner

    from envhub.cli import main
    from tests.trainer.test_cli import QUICKSTART, TINY

    out = tmp_path_factory.mktemp("runs") / "quickstart"
    args = [*TINY, "train.steps=4", "eval.every=2", "checkpoint.every=0", f"output_dir={out}"]
    result = CliRunner().invoke(main, ["train", str(QUICKSTART), *args])
    assert result.exit_code == 0, result.output
    return out
