"""``envhub train CONFIG --dry-run``: the plan of a GPU recipe printed on a machine without GPUs
and without the checkpoint (its config.json alone), refused with the knob named when it does
not fit, and nothing started either way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from envhub.cli import main
from tests.gpu.recipe_models import QWEN2_5_0_5B, QWEN2_5_7B, config_json

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def dry_run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["train", *args, "--dry-run"], env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


def test_the_8gpu_recipe_prints_a_plan_that_fits(tmp_path: Path) -> None:
    folder = config_json(tmp_path / "qwen", QWEN2_5_0_5B)
    out = tmp_path / "run"
    code, stdout, stderr = dry_run(
        str(EXAMPLES / "qwen2.5-0.5b-sokoban-8gpu.yaml"),
        f"model.path={folder}",
        f"output_dir={out}",
    )
    assert code == 0, stderr
    assert "qwen2, 494.0M parameters (24 layers, hidden 896, vocabulary 151,936)" in stdout
    assert "rows up to 6,272" in stdout
    for role, layout in [
        ("actor_train", "fsdp2 dp=8"),
        ("actor_infer", "vllm tp=1"),
        ("reference", "fsdp2 dp=8"),
    ]:
        assert role in stdout and layout in stdout
    # fp32 master weights (model.dtype bfloat16 computes): 0.5 GiB more than bf16 ones
    assert "device 0-7: 62.4 GiB of 80 GiB in its fullest phase, train fits" in stdout
    for component in ("logits", "activations", "weights", "optimizer", "context"):
        assert component in stdout
    assert "full weights (bfloat16): 942.3 MiB in 4 bucket(s) of 259.7 MiB" in stdout
    assert "fits: nothing started (--dry-run)" in stdout
    assert not out.exists()  # no run folder, no checkpoint, no workers


def test_the_7b_recipe_without_lora_is_refused_with_the_knob_named(tmp_path: Path) -> None:
    folder = config_json(tmp_path / "qwen", QWEN2_5_7B)
    recipe = str(EXAMPLES / "qwen2.5-7b-lora-sokoban-1gpu.yaml")
    code, stdout, _ = dry_run(recipe, f"model.path={folder}")
    assert code == 0 and "LoRA rank 16: 40,370,176 trained" in stdout
    assert "LoRA adapters (rank 16, fp32): 154.0 MiB in 1 bucket(s)" in stdout
    code, stdout, stderr = dry_run(recipe, f"model.path={folder}", "model.lora=null")
    assert code == 1
    assert "OVER" in stdout  # the plan is still printed, with the device that does not fit
    assert "does not fit" in stderr
    assert "roles.actor_train.device_mapping:" in stderr and "set model.lora" in stderr


def test_without_a_config_json_the_dry_run_says_what_it_needs(tmp_path: Path) -> None:
    code, _, stderr = dry_run(
        str(EXAMPLES / "qwen2.5-0.5b-sokoban-8gpu.yaml"), f"model.path={tmp_path}"
    )
    assert code == 2
    assert "has no config.json" in stderr and "no weights needed" in stderr


def test_a_missing_model_path_is_told_a_config_json_is_enough_for_the_dry_run(
    tmp_path: Path,
) -> None:
    recipe = str(EXAMPLES / "qwen2.5-0.5b-sokoban-8gpu.yaml")
    code, _, stderr = dry_run(recipe, f"model.path={tmp_path / 'missing'}")
    text = " ".join(stderr.split())
    assert code == 2 and "model.path: " in text and "does not exist" in text
    assert "for --dry-run, a folder holding only the checkpoint's config.json is enough" in text
    help_text = CliRunner().invoke(main, ["train", "--help"]).output
    assert "qwen2.5-0.5b-sokoban-8gpu.yaml model.path=DIR --dry-run" in help_text


def test_an_invalid_config_is_reported_as_it_is_without_dry_run(tmp_path: Path) -> None:
    code, _, stderr = dry_run(str(EXAMPLES / "quickstart.yaml"), "train.lr=-1")
    assert code == 2 and "train.lr" in stderr


@pytest.mark.parametrize("recipe", ["quickstart.yaml", "scratch.yaml"])
def test_cpu_examples_report_host_memory(recipe: str, tmp_path: Path) -> None:
    code, stdout, stderr = dry_run(str(EXAMPLES / recipe), f"output_dir={tmp_path / 'run'}")
    assert code == 0, stderr
    assert "host memory" in stdout
    # model.tiny's BPE tokenizer is learnt at start: the vocabulary, so the size, is a bound
    line = " ".join(stdout.split())
    assert re.search(
        r"model llama, at most [0-9.]+M parameters \(2 layers, hidden \d+, vocabulary up to "
        r"[0-9,]+: model\.tiny's tokenizer is learnt at start\)",
        line,
    ), stdout


def test_on_a_gpu_host_with_fewer_gpus_the_dry_run_refuses_the_mapping(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A machine with 4 GPUs cannot run the 8-GPU recipe locally: the plan is printed, then
    refused naming the role, the highest GPU id and the count."""
    from trainer import devices

    monkeypatch.setattr(devices, "local_gpu_count", lambda: 4, raising=False)
    folder = config_json(tmp_path / "qwen", QWEN2_5_0_5B)
    code, stdout, stderr = dry_run(
        str(EXAMPLES / "qwen2.5-0.5b-sokoban-8gpu.yaml"), f"model.path={folder}"
    )
    assert code == 1
    assert "device 0-7" in stdout  # the plan is still shown
    assert "roles.actor_train.device_mapping: names GPU 7 but this machine has 4 GPUs" in stderr


def test_the_dry_run_refuses_devices_beyond_cluster_num_devices_as_the_run_does(
    tmp_path: Path,
) -> None:
    code, _, stderr = dry_run(
        str(EXAMPLES / "quickstart.yaml"),
        "cluster.backend=ray",
        "cluster.num_devices=1",
        "roles.actor_train.device_mapping=[0,1]",
        "roles.actor_train.strategy=fsdp2",
        f"output_dir={tmp_path / 'run'}",
    )
    assert code == 1
    assert "roles.actor_train.device_mapping: device 1 does not exist" in stderr


def test_the_plan_shows_the_loss_and_sampling_the_run_will_use(tmp_path: Path) -> None:
    """Settings resolved at load (GSPO's own clip and aggregation when unset, the temperature
    log-probs are taken at) are printed, so a user sees what turning GSPO on changed."""
    args = [str(EXAMPLES / "quickstart.yaml"), f"output_dir={tmp_path / 'run'}"]
    code, stdout, stderr = dry_run(*args, "rollout.temperature=0.7")
    assert code == 0, stderr
    assert "PPO clip 0.2/0.28, token-mean" in stdout and "temperature 0.7" in stdout
    gspo = [
        "algorithm.loss.gspo=true",
        "algorithm.loss.clip_low=null",
        "algorithm.loss.clip_high=null",
        "algorithm.loss.agg_mode=null",
    ]
    code, stdout, stderr = dry_run(*args, *gspo)
    assert code == 0, stderr
    assert "GSPO clip 0.0003/0.0004, seq-mean-token-mean" in stdout


@pytest.mark.parametrize(
    ("estimator", "warned"), [("grpo", True), ("gigpo", True), ("rloo", False)]
)
def test_a_kl_penalty_that_group_std_normalising_cancels_is_warned(
    tmp_path: Path, estimator: str, warned: bool
) -> None:
    """With ``kl_mode: penalty`` the KL is taken from the scores before GRPO/GiGPO divide by
    the group's std (as verl does): ``kl_coef`` then scales nothing, and a group whose episodes
    all scored alike gets full-size advantages from KL noise alone. Said before a run starts."""
    args = [
        str(EXAMPLES / "quickstart.yaml"),
        f"output_dir={tmp_path / 'run'}",
        f"algorithm.advantage_estimator={estimator}",
        "algorithm.loss.kl_mode=penalty",
        "algorithm.loss.kl_coef=0.01",
    ]
    if estimator == "gigpo":
        args.append("rollout.sample_unit=turn")
    code, _, stderr = dry_run(*args)
    assert code == 0, stderr
    assert ("warning: algorithm.loss.kl_mode=penalty" in stderr) == warned, stderr
    if warned:
        assert "kl_mode: loss" in stderr and "normalize_std: false" in stderr


@pytest.mark.parametrize(("dtype", "warned"), [("float16", True), ("bfloat16", False)])
def test_float16_training_without_loss_scaling_is_warned(
    tmp_path: Path, dtype: str, warned: bool
) -> None:
    """fp16 compute over fp32 masters without a GradScaler underflows small gradients to 0;
    bf16 has fp32's range. Said before a run starts, with the fix."""
    args = [str(EXAMPLES / "quickstart.yaml"), f"output_dir={tmp_path / 'run'}"]
    code, _, stderr = dry_run(*args, f"model.dtype={dtype}")
    assert code == 0, stderr
    assert ("warning: model.dtype=float16" in stderr) == warned, stderr
    if warned:
        assert "bfloat16" in stderr
