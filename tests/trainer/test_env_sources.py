"""Where a run's envs come from, end to end: a remote ``envhub serve`` hub, and an EnvPool.

Each test trains a real (tiny) policy for one RL step with envs from that source and checks
what a user would look at: the run finishes and ``metrics.jsonl`` has rollout statistics
(``train/success`` over every planned episode, none failed) and the evaluations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline


def train_one_step(out: Path, *overrides: str, config: Path = QUICKSTART) -> list[dict]:
    cfg = load_config(config, [*TINY, "train.steps=1", "train.ppo_epochs=1", "sft.epochs=0", "eval.episodes=4",
                                   "checkpoint.every=0", f"output_dir={out}", *overrides])
    return AgenticPipeline(cfg).fit()


def assert_trained(rows: list[dict], episodes: int) -> None:
    assert [row["step"] for row in rows] == [0, 1]
    step = rows[-1]
    assert 0.0 <= step["train/success"] <= 1.0
    assert step["train/episodes"] == episodes and step["train/failed_episodes"] == 0
    assert step["train/turns"] >= 1 and step["actor/optimizer_steps"] >= 1
    assert rows[0]["eval/episodes"] == 4 and step["eval/episodes"] == 4


def test_envs_from_a_remote_hub(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn", reason="needs the server extra: pip install -e '.[server]'")
    from tests.envhub.server.hubtools import TOKEN, running_hub

    # The hub serves the env with its registered defaults (kwargs cannot travel with env.hub).
    config = yaml.safe_load(QUICKSTART.read_text())
    del config["env"]["kwargs"]
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump(config))
    with running_hub(envs=["games/frozen-lake-v0"], workers=2) as hub:
        rows = train_one_step(tmp_path / "run", f"env.hub={hub.url}", f"env.token={TOKEN}", "rollout.max_turns=3",
                              config=tmp_path / "hub.yaml")
        assert_trained(rows, episodes=8)
        opened = hub.hub.metrics.registry.get_sample_value("envhub_sessions_opened_total")
    assert opened >= 8 + 2 * 4  # every training and evaluation episode was played on the hub


def test_envs_in_an_env_pool_of_worker_processes(tmp_path: Path) -> None:
    rows = train_one_step(tmp_path / "run", "env.pool_workers=2")
    assert_trained(rows, episodes=8)


def test_env_kwargs_with_a_hub_is_a_config_error_before_anything_starts(tmp_path: Path) -> None:
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"env\.kwargs: env kwargs cannot be sent to the remote hub"):
        load_config(QUICKSTART, ["env.hub=ws://127.0.0.1:9", f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
