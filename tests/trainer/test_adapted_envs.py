"""The trainer and `envhub eval` on adapted envs (envhub.adapters): a reasoning-gym dataset
and a two-player TextArena game train like built-in envs, with no change to the trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip(
    "reasoning_gym", reason="needs the reasoning-gym extra: pip install 'envhub[reasoning-gym]'"
)
pytest.importorskip(
    "textarena", reason="needs the textarena extra: pip install 'envhub[textarena]'"
)

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from tests.trainer.test_pipeline import VARIED
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline

ADAPTED = ["reasoning-gym/basic_arithmetic-v0", "textarena/TicTacToe-v0"]
ROOT = Path(__file__).resolve().parents[2]


def test_a_reasoning_gym_dataset_and_a_textarena_game_train_two_steps(tmp_path: Path) -> None:
    base = yaml.safe_load(QUICKSTART.read_text())
    base["env"]["id"], base["env"]["kwargs"] = ADAPTED, {}
    path = tmp_path / "adapted.yaml"
    path.write_text(yaml.safe_dump(base))
    config = load_config(
        path,
        [
            *TINY,
            "env.num_groups=2",
            "env.group_size=4",
            "train.steps=2",
            "sft.epochs=0",
            "eval.episodes=2",
            "rollout.max_new_tokens=8",
            "rollout.max_turns=2",
            "checkpoint.every=0",
            f"output_dir={tmp_path / 'run'}",
            VARIED,
        ],
    )
    rows = AgenticPipeline(config).fit()
    trained = [row for row in rows if "actor/grad_norm" in row]
    assert len(trained) == 2 and all(row["actor/grad_norm"] > 0 for row in trained)
    for env_id in ADAPTED:  # each env played its group and its eval episodes
        assert {f"train/{env_id}/reward", f"eval/{env_id}/success"} <= set(rows[-1])
    assert all(row["rollout/failed_attempts"] == 0 for row in trained)


def test_envhub_eval_plays_adapted_envs_with_the_built_in_agents() -> None:
    def evaluate(env_id: str, agent: str) -> dict:
        command = ["eval", env_id, "--episodes", "6", "--agent", agent, "--json"]
        result = subprocess.run(
            [sys.executable, "-m", "envhub.cli", *command],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        (row,) = json.loads(result.stdout)
        return row

    expert = evaluate("reasoning-gym/basic_arithmetic-v0", "expert")
    assert (expert["episodes"], expert["success_rate"], expert["failures"]) == (6, 1.0, {})
    random = evaluate("textarena/TicTacToe-v0", "random")
    assert random["episodes"] == 6 and random["failures"] == {}
    assert random["success_rate"] < 1.0 and random["mean_turns"] >= 1
