"""With ``env.hub``, what the run plays on a local copy of an env (the warm start's expert
demonstrations: a hub sends no expert moves; ``model.tiny``'s tokenizer corpus) must be the env
the hub serves. A hub builds its envs with the kwargs it was started with, which cannot travel
(``env.kwargs`` must be empty with a hub), so the local copy ran with its registered defaults and
the warm start taught another task (a 4x4 map with ``<answer>`` tags for a hub serving 3x3 maps
answered with the bare word), silently. The start now compares the two and refuses a difference
before anything is built, naming the fixes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
pytest.importorskip("uvicorn", reason="needs the server extra: pip install -e '.[server]'")
from click.testing import CliRunner

from envhub.cli import main
from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config

LAKE = "games/frozen-lake-v0"
SERVED = {"action_format": "raw", "size": 3, "hole_fraction": 0.4, "max_turns": 6}
"""What the quickstart's env.kwargs say, served by the hub (``envhub serve -k ...``)."""


def test_a_hub_serving_other_settings_than_the_local_copy_is_refused_before_building(
    tmp_path: Path,
) -> None:
    from tests.envhub.server.hubtools import TOKEN, running_hub

    out = tmp_path / "run"
    with running_hub(envs=[LAKE], env_kwargs={LAKE: SERVED}) as hub:
        result = CliRunner().invoke(
            main,
            [
                "train", str(QUICKSTART), *TINY, "sft.epochs=1", "train.steps=1",
                f"env.hub={hub.url}", f"env.token={TOKEN}", "env.kwargs={}", f"output_dir={out}",
            ],
        )  # fmt: skip
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert f"env.hub: {LAKE} as the hub {hub.url} serves it differs from this run's local copy" in (
        message
    )
    assert "the warm start's expert demonstrations" in message
    assert "model.tiny's tokenizer" in message
    assert "4x4" in message and "3x3" in message  # where the first observations differ
    assert "sft.epochs=0" in message and "model.path" in message
    assert "variant" in message
    assert not (out / "initial_policy").exists()  # refused before the tokenizer was built


def test_a_hub_serving_the_defaults_passes(tmp_path: Path) -> None:
    from tests.envhub.server.hubtools import TOKEN, running_hub
    from trainer.local_copies import check_local_copies

    with running_hub(envs=[LAKE]) as hub:
        cfg = load_config(
            QUICKSTART,
            [f"env.hub={hub.url}", f"env.token={TOKEN}", "env.kwargs={}",
             f"output_dir={tmp_path / 'run'}"],
        )  # fmt: skip
        check_local_copies(cfg, warm_start=True)


def test_a_run_that_plays_no_local_copy_does_not_ask_the_hub(
    tmp_path: Path, policy_dir: Path
) -> None:
    from trainer.local_copies import check_local_copies

    cfg = load_config(
        QUICKSTART,
        [
            "env.hub=ws://127.0.0.1:9", "env.kwargs={}", "sft.epochs=0", "model.tiny=null",
            f"model.path={policy_dir}", f"output_dir={tmp_path / 'run'}",
        ],
    )  # fmt: skip
    check_local_copies(cfg, warm_start=True)  # (nothing listens on port 9)
