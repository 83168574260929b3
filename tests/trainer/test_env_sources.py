"""Where a run's envs come from, end to end: a remote ``envhub serve`` hub, and an EnvPool.

Each test trains a real (tiny) policy for one RL step with envs from that source and checks
what a user would look at: the run finishes, every planned episode was played (none failed),
and every episode it trained on is the game the same env plays in this process: replaying the
policy's actions on a local env with the episode's seed gives the same replies, rewards and
outcome, turn by turn. The source changes where an env runs, never what it does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

import envhub
from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline
from trainer.rollout.trajectory import Trajectory


def train_one_step(
    out: Path, *overrides: str, config: Path = QUICKSTART, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[dict], list[Trajectory]]:
    """One RL step; returns the metrics rows and the episodes the step trained on."""
    trained: list[Trajectory] = []
    to_batch = AgenticPipeline.to_batch

    def recording(self, episodes):
        trained.extend(episodes)
        return to_batch(self, episodes)

    monkeypatch.setattr(AgenticPipeline, "to_batch", recording)
    cfg = load_config(
        config,
        [
            *TINY,
            "train.steps=1",
            "train.ppo_epochs=1",
            "sft.epochs=0",
            "eval.episodes=4",
            "checkpoint.every=0",
            f"output_dir={out}",
            *overrides,
        ],
    )
    return AgenticPipeline(cfg).fit(), trained


def assert_trained(rows: list[dict], episodes: int) -> None:
    assert [row["step"] for row in rows] == [0, 1]
    step = rows[-1]
    assert step["train/episodes"] == episodes and step["rollout/failed_attempts"] == 0
    assert step["train/turns"] >= 1 and step["actor/optimizer_steps"] >= 1
    assert rows[0]["eval/episodes"] == 4 and step["eval/episodes"] == 4


def assert_same_games_in_process(trained: list[Trajectory], kwargs: dict[str, Any]) -> None:
    """Replay each episode's actions on a local env: the same replies, rewards and success."""
    openings: dict[int, str] = {}
    assert len({t.seed for t in trained}) > 1  # several games (maps), not one
    for t in trained:
        env = envhub.make(t.env_id, **kwargs)
        try:
            messages, _ = env.reset(seed=t.seed)
            replayed, rewards, info = list(messages), [], {"success": False}
            for message in t.messages[len(messages) :]:
                if message["role"] == "assistant":
                    replayed.append(message)
                    reply, reward, _, _, info = env.step(message["content"])
                    replayed.extend(reply)
                    rewards.append(reward)
            assert replayed == t.messages, (
                f"seed {t.seed}: the source played another game than the local env"
            )
            assert rewards == pytest.approx(t.turn_rewards) and info["success"] == t.success, t.seed
            openings[t.seed] = messages[-1]["content"]
        finally:
            env.close()
    # the seeds drew different maps, and each map was compared
    assert len(set(openings.values())) > 1


def test_envs_from_a_remote_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvicorn", reason="needs the server extra: pip install -e '.[server]'")
    from tests.envhub.server.hubtools import TOKEN, running_hub

    # The hub serves the env with its registered defaults (kwargs cannot travel with env.hub).
    config = yaml.safe_load(QUICKSTART.read_text())
    del config["env"]["kwargs"]
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump(config))
    with running_hub(envs=["games/frozen-lake-v0"], workers=2) as hub:
        rows, trained = train_one_step(
            tmp_path / "run",
            f"env.hub={hub.url}",
            f"env.token={TOKEN}",
            "rollout.max_turns=3",
            config=tmp_path / "hub.yaml",
            monkeypatch=monkeypatch,
        )
        assert_trained(rows, episodes=8)
        opened = hub.hub.metrics.registry.get_sample_value("envhub_sessions_opened_total")
    assert opened >= 8 + 2 * 4  # every training and evaluation episode was played on the hub
    assert_same_games_in_process(trained, {})


def test_envs_in_an_env_pool_of_worker_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, trained = train_one_step(tmp_path / "run", "env.pool_workers=2", monkeypatch=monkeypatch)
    assert_trained(rows, episodes=8)
    assert_same_games_in_process(trained, yaml.safe_load(QUICKSTART.read_text())["env"]["kwargs"])


def test_env_kwargs_with_a_hub_is_a_config_error_before_anything_starts(tmp_path: Path) -> None:
    from trainer.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"env\.kwargs: env kwargs cannot be sent to the remote hub"
    ):
        load_config(QUICKSTART, ["env.hub=ws://127.0.0.1:9", f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
