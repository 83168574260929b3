"""``envhub train --dry-run`` refuses what the start refuses: layouts a strategy or engine used to
refuse only while its workers built it (after ``--dry-run`` had said "fits") are refused when the
config loads, which both the dry run and the start do first, with the key path and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from envhub.cli import main
from trainer.config import load_config
from trainer.errors import ConfigError

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
MEGATRON = ["cluster.backend=ray", "roles.actor_train.strategy=megatron"]
"""The quickstart's tiny llama (2 layers, 4 heads, MLP 128) trained by megatron."""


def refusals(tmp_path: Path, *overrides: str) -> list[str]:
    """What ``envhub train QUICKSTART OVERRIDES --dry-run`` prints as refused (exit code 2: the
    config is invalid), checked to be what the start's ``load_config`` refuses; nothing written."""
    out = tmp_path / "run"
    args = [*overrides, f"output_dir={out}"]
    result = CliRunner().invoke(main, ["train", str(QUICKSTART), *args, "--dry-run"])
    assert result.exit_code == 2, result.output
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, args)
    problems = [str(p) for p in info.value.problems]
    assert all(p.split(" (at ")[0] in " ".join(result.stderr.split()) for p in problems)
    assert not out.exists()
    return problems


@pytest.mark.parametrize(
    ("heads", "what"),
    [
        (["model.tiny.num_heads=1"], "num_attention_heads=1 is not divisible"),
        (["model.tiny.num_kv_heads=1"], "num_key_value_heads=1 is not divisible"),
    ],
)
def test_megatron_heads_that_tensor_parallelism_cannot_split_are_refused(
    tmp_path: Path, heads: list[str], what: str
) -> None:
    [problem] = refusals(
        tmp_path,
        *MEGATRON,
        *heads,
        "roles.actor_train.device_mapping=[0,1]",
        "roles.actor_train.strategy_args.tensor_parallel_size=2",
    )
    assert problem.startswith(
        "roles.actor_train.strategy_args.tensor_parallel_size: megatron layout impossible"
    )
    assert f"{what} by tensor_parallel_size=2" in problem
    assert "Choose a tensor/pipeline parallel size that divides them" in problem


def test_more_megatron_pipeline_stages_than_layers_are_refused(tmp_path: Path) -> None:
    [problem] = refusals(
        tmp_path,
        *MEGATRON,
        "roles.actor_train.device_mapping=[0,1,2,3]",
        "roles.actor_train.strategy_args.pipeline_parallel_size=4",
    )
    assert problem.startswith("roles.actor_train.strategy_args.pipeline_parallel_size: ")
    assert "num_hidden_layers=2 is not divisible by pipeline_parallel_size=4" in problem
    cfg = load_config(QUICKSTART, [  # a layout the model splits into loads
        *MEGATRON, "roles.actor_train.device_mapping=[0,1,2,3]",
        "roles.actor_train.strategy_args={tensor_parallel_size: 2, pipeline_parallel_size: 2}",
    ])  # fmt: skip
    assert cfg.roles.actor_train.world_size == 4


def test_a_megatron_critic_is_refused(tmp_path: Path) -> None:
    [problem] = refusals(
        tmp_path, "algorithm.advantage_estimator=gae", "roles.critic.strategy=megatron"
    )
    assert problem.startswith(
        "roles.critic.strategy: the megatron strategy trains causal LMs only; use 'fsdp2' or "
        "'hf' for a critic"
    )


def test_an_option_the_hf_engine_does_not_take_is_refused(tmp_path: Path) -> None:
    [problem] = refusals(tmp_path, "roles.actor_infer.strategy_args.gpu_memory_utilization=0.5")
    assert problem.startswith(
        "roles.actor_infer.strategy_args.gpu_memory_utilization: not an option of the 'hf' "
        "inference engine (its options: prefix_cache_gib); remove it, or set rollout.engine: "
        "vllm"
    )
    [problem] = refusals(tmp_path, "roles.actor_infer.strategy_args.prefix_cache=2")
    assert "did you mean prefix_cache_gib?" in problem
    cfg = load_config(QUICKSTART, ["roles.actor_infer.strategy_args.prefix_cache_gib=0.5"])
    assert cfg.roles.actor_infer.strategy_args == {"prefix_cache_gib": 0.5}


def test_a_refusal_that_quotes_brackets_prints_them(tmp_path: Path) -> None:
    """Rich read ``[all-linear, lm_head]`` in the quoted override as markup and dropped it."""
    target = "model.lora.target_modules=[all-linear, lm_head]"
    out = tmp_path / "run"
    args = ["train", str(QUICKSTART), "model.lora.rank=4", target, f"output_dir={out}"]
    result = CliRunner().invoke(main, [*args, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert target in " ".join(result.stderr.split()), result.stderr
