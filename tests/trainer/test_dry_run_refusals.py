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


FSDP2_TP = [
    "cluster.backend=ray",
    "roles.actor_train.strategy=fsdp2",
    "roles.actor_train.device_mapping=[0,1]",
    "roles.actor_train.strategy_args.tensor_parallel_size=2",
]
"""The quickstart's tiny llama (4 heads, MLP 128) trained by fsdp2 on two tensor-parallel ranks."""


@pytest.mark.parametrize(
    ("sizes", "what"),
    [
        (["model.tiny.num_heads=1"], "num_attention_heads=1 is not divisible"),
        (["model.tiny.num_kv_heads=1"], "num_key_value_heads=1 is not divisible"),
        (["model.tiny.intermediate_size=129"], "intermediate_size=129 is not divisible"),
    ],
)
def test_fsdp2_sizes_that_tensor_parallelism_cannot_split_are_refused(
    tmp_path: Path, sizes: list[str], what: str
) -> None:
    """fsdp2 refused them only when its workers set up the tensor-parallel mesh."""
    [problem] = refusals(tmp_path, *FSDP2_TP, *sizes)
    assert problem.startswith(
        "roles.actor_train.strategy_args.tensor_parallel_size: fsdp2 tensor parallelism "
        "impossible for this model"
    )
    assert f"{what} by tensor_parallel_size=2" in problem
    assert "choose a tensor_parallel_size that divides them and the role's 2 workers (1)" in problem
    cfg = load_config(QUICKSTART, FSDP2_TP)  # the quickstart's sizes split in two: it loads
    assert cfg.roles.actor_train.strategy_args == {"tensor_parallel_size": 2}


def test_fsdp2_tensor_parallelism_of_a_model_without_llama_blocks_is_refused(
    tmp_path: Path,
) -> None:
    [problem] = refusals(tmp_path, *FSDP2_TP, "model.tiny.architecture=gpt2")
    assert problem.startswith("roles.actor_train.strategy_args.tensor_parallel_size: ")
    assert "gpt2 has no Llama/Qwen2-style blocks" in problem


@pytest.mark.parametrize(
    "combination", ["model.lora.warm_start=adapters", "model.lora.sync=merged"]
)
def test_lora_on_an_input_embedding_tied_to_the_head_refuses_what_would_adapt_the_head(
    tmp_path: Path, combination: str
) -> None:
    """The quickstart adapts embed_tokens, which its tiny llama's head shares: folding a
    warm-started adapter into the base, or merging it for a sync, changes the head too. Building
    the adapters refused it (``apply_lora``), after ``--dry-run`` had said "fits"."""
    [problem] = refusals(tmp_path, "model.lora.rank=8", combination)
    setting = combination.removeprefix("model.lora.").replace("=", ": ")
    assert problem.startswith("model.lora.target_modules: ")
    assert "adapts embed_tokens" in problem and "tied embeddings" in problem
    assert f"{setting} would add the adapter into the head too" in problem
    assert "use model.lora.warm_start: full and sync: adapter" in problem
    assert "or drop embed_tokens from model.lora.target_modules" in problem
    cfg = load_config(QUICKSTART, ["model.lora.rank=8"])  # warm_start: full, sync: adapter
    assert cfg.model.lora is not None and "embed_tokens" in cfg.model.lora.target_modules
    untied = tmp_path / "untied"  # a head of its own: the adapter changes the input side only
    untied.mkdir()
    (untied / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "intermediate_size": 128, "tie_word_embeddings": false}'
    )
    model = [f"model.path={untied}", "model.tiny=null"]
    cfg = load_config(QUICKSTART, [*model, "model.lora.rank=8", combination])
    assert cfg.model.lora is not None and "embed_tokens" in cfg.model.lora.target_modules


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize(
    ("arg", "key"),
    [
        ("dtype=bfloat16", "model.dtype"),
        ("seed=3", "seed"),
        ("lora_rank=8", "model.lora.rank"),
        ("model_path=/tmp/policy", "model.path"),
        ("name=vllm", "rollout.engine"),
    ],
)
def test_engine_arguments_the_worker_passes_itself_are_refused(
    tmp_path: Path, engine: str, arg: str, key: str
) -> None:
    """``InferWorker`` passes these to the engine itself, so the start failed with "got multiple
    values for keyword argument" (or, for ``lora_rank`` without adapters, gave vLLM a LoRA
    setting no adapter would use)."""
    [problem] = refusals(
        tmp_path,
        f"rollout.engine={engine}",
        "model.tiny.num_heads=2",  # head size 32: one vLLM's CPU attention takes
        f"roles.actor_infer.strategy_args.{arg}",
    )
    name = arg.partition("=")[0]
    assert problem.startswith(f"roles.actor_infer.strategy_args.{name}: ")
    assert "the actor_infer worker passes it to the engine itself" in problem
    assert f"set {key}" in problem and "remove it from strategy_args" in problem


def test_vllm_on_cpu_with_a_head_size_its_kernels_lack_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quickstart's tiny llama has head_dim 16 (hidden 64 / 4 heads); vLLM's CPU attention
    takes 32, 64, ...: the dry run says what the engine would say 5 s into the run."""
    from trainer import devices
    from trainer.errors import ModelError
    from trainer.strategies.vllm_platform import check_cpu_head_size

    monkeypatch.setattr(devices, "local_gpu_count", lambda: 0)
    [problem] = refusals(tmp_path, "rollout.engine=vllm")
    with pytest.raises(ModelError) as engine:
        check_cpu_head_size({"hidden_size": 64, "num_attention_heads": 4})
    assert problem == f"rollout.engine: {engine.value} (at override 'rollout.engine=vllm')"
    assert "model.tiny.num_heads=2 for head_dim 32" in problem
    load_config(QUICKSTART, ["rollout.engine=vllm", "model.tiny.num_heads=2"])  # head_dim 32
