"""What ``model.lora`` and ``train.packing`` need of the policy model, refused where the config
loads (and so by ``--dry-run``), not after the cluster, the engines and the env pool started.

Each test reads a model the way the check does: ``model.tiny`` as it would be built, or a
``model.path`` folder holding only a ``config.json`` (no weights, no tokenizer: what a dry run on
a laptop plans from).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from envhub.cli import main
from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.errors import ConfigError

LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
}
PHI = {**LLAMA, "model_type": "phi"}
"""A family ``trainer.model_shape`` does not know: read off the model built on the meta device."""
BLOOM = {"model_type": "bloom", "vocab_size": 64, "hidden_size": 32, "n_layer": 2, "n_head": 4}
FALCON = {
    "model_type": "falcon",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "new_decoder_architecture": False,
}
FOLDERS = {"llama": LLAMA, "phi": PHI}


def checkpoint(tmp_path: Path, config: dict[str, Any], name: str = "model") -> Path:
    """A ``model.path`` folder holding ``config.json`` alone."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def model_overrides(model: str, tmp_path: Path) -> list[str]:
    """Overrides that make the quickstart's policy ``model``: its tiny Llama, a tiny GPT-2, or a
    ``model.path`` folder of the family in ``FOLDERS``."""
    if model == "tiny":
        return []
    if model == "tiny-gpt2":
        return ["model.tiny.architecture=gpt2"]
    return ["model.tiny=null", f"model.path={checkpoint(tmp_path, FOLDERS[model])}"]


def refusals(overrides: list[str]) -> list[Any]:
    """The problems ``load_config`` reports for the quickstart with ``overrides`` ([] if none)."""
    try:
        load_config(QUICKSTART, overrides)
    except ConfigError as error:
        return list(error.problems)
    return []


def at(problems: list[Any], path: str) -> list[str]:
    return [p.message for p in problems if p.path == path]


# --------------------------------------------------------------------------- LoRA targets


@pytest.mark.parametrize(
    ("model", "targets", "typo", "meant"),
    [
        ("tiny", "[q_proj, v_porj]", "v_porj", "v_proj"),
        ("tiny-gpt2", "[c_atn]", "c_atn", "c_attn"),
        ("llama", "[q_proj, gate_prj]", "gate_prj", "gate_proj"),
        ("phi", "[dense, fc_1]", "fc_1", "fc1"),
    ],
)
def test_a_target_module_that_matches_no_layer_is_refused_at_load_with_the_close_names(
    tmp_path: Path, model: str, targets: str, typo: str, meant: str
) -> None:
    """A typo in ``model.lora.target_modules`` is named where the config loads, with the model's
    layer names that are close to it, for ``model.tiny`` and for ``model.path`` (a family the
    memory model knows, and one it does not)."""
    where = model_overrides(model, tmp_path)
    problems = refusals([*where, "model.lora.rank=4", f"model.lora.target_modules={targets}"])
    [message] = at(problems, "model.lora.target_modules")
    assert f"{typo!r} matches no linear or embedding layer of this model" in message
    assert f"did you mean {meant!r}" in message  # the closest first
    assert "(or use 'all-linear')" in message


@pytest.mark.parametrize(
    ("model", "targets"),
    [
        ("tiny", "[q_proj, v_proj]"),
        ("tiny", "[all-linear, embed_tokens]"),
        ("tiny", "[self_attn.o_proj, mlp.down_proj]"),
        ("tiny-gpt2", "[c_attn, c_proj, c_fc, wte]"),
        ("phi", "[q_proj, dense, fc1, fc2]"),
    ],
)
def test_target_modules_the_model_has_load(tmp_path: Path, model: str, targets: str) -> None:
    where = model_overrides(model, tmp_path)
    # a full warm start: an adapted (tied) input embedding needs it
    overrides = [*where, "model.lora.rank=4", f"model.lora.target_modules={targets}"]
    assert refusals([*overrides, "model.lora.warm_start=full"]) == []


def test_a_dry_run_refuses_a_target_module_typo() -> None:
    result = CliRunner().invoke(
        main,
        [
            "train",
            str(QUICKSTART),
            "model.lora.rank=4",
            "model.lora.target_modules=[q_proj, v_porj]",
            "--dry-run",
        ],
    )
    assert result.exit_code != 0, result.output
    assert "model.lora.target_modules" in result.output
    assert "'v_porj' matches no linear or embedding layer" in result.output
    assert "did you mean 'v_proj'" in result.output
    assert "fits" not in result.output


# --------------------------------------------------------------------------- vLLM's rank


def test_a_lora_rank_above_vllms_largest_is_refused_at_load() -> None:
    problems = refusals(["model.lora.rank=1024", "rollout.engine=vllm"])
    [message] = at(problems, "model.lora.rank")
    assert "1024 is above vLLM's largest LoRA rank 512" in message
    assert "model.lora.rank: 512" in message and "model.lora.sync: merged" in message
    # merged syncs send vLLM full weights: no LoRA rank to hold; rank 512 is vLLM's own
    merged = ["model.lora.rank=1024", "rollout.engine=vllm", "model.lora.sync=merged"]
    assert at(refusals(merged), "model.lora.rank") == []
    assert at(refusals(["model.lora.rank=512", "rollout.engine=vllm"]), "model.lora.rank") == []


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize(
    "config", [BLOOM, {**FALCON, "alibi": True}], ids=["bloom", "falcon-alibi"]
)
def test_packing_an_alibi_model_is_refused_at_load(tmp_path: Path, config: dict[str, Any]) -> None:
    folder = checkpoint(tmp_path, config)
    problems = refusals(["model.tiny=null", f"model.path={folder}", "train.packing=true"])
    [message] = at(problems, "train.packing")
    assert "ALiBi" in message and "set train.packing: false" in message
    unpacked = refusals(["model.tiny=null", f"model.path={folder}", "train.packing=false"])
    assert at(unpacked, "train.packing") == []


def test_packing_a_falcon_without_alibi_loads(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, FALCON)
    problems = refusals(["model.tiny=null", f"model.path={folder}", "train.packing=true"])
    assert at(problems, "train.packing") == []


# --------------------------------------------------------------------------- base dropout


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({**LLAMA, "attention_dropout": 0.1}, ["attention_dropout=0.1"]),
        # GPT-2's defaults (0.1 each) are not written to config.json: read as transformers does
        (
            {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4},
            ["attn_pdrop=0.1", "embd_pdrop=0.1", "resid_pdrop=0.1"],
        ),
        (LLAMA, []),
    ],
    ids=["llama-attention-dropout", "gpt2-defaults", "no-dropout"],
)
def test_dropout_in_the_policys_own_config_is_warned_once_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: dict[str, Any], named: list[str]
) -> None:
    """The training forward runs the model in train mode: dropout the checkpoint's config sets
    makes the PPO ratio noisy on-policy, as adapter dropout does; the run says so as it starts,
    naming the settings."""
    from tests.trainer.test_train_cli_refusals import record_runs

    runs = record_runs(monkeypatch)
    folder = checkpoint(tmp_path, config)
    result = train_from(folder, tmp_path)
    assert result.exit_code == 0, result.output
    assert len(runs) == 1
    assert result.output.count("PPO ratio") == int(bool(named)), result.output
    for setting in named:
        assert setting in result.output
    if named:
        assert "warning:" in result.output and "config.json" in result.output


def test_an_sft_only_run_keeps_the_policys_dropout_unwarned(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.trainer.test_train_cli_refusals import record_runs

    record_runs(monkeypatch)
    folder = checkpoint(tmp_path, {**LLAMA, "attention_dropout": 0.1})
    result = train_from(folder, tmp_path, "train.steps=0")
    assert result.exit_code == 0, result.output
    assert "PPO ratio" not in result.output


def train_from(folder: Path, tmp_path: Path, *overrides: str) -> Any:
    """``envhub train`` of the quickstart on the policy in ``folder`` (its workers recorded,
    not started: ``record_runs``)."""
    return CliRunner().invoke(
        main,
        [
            "train",
            str(QUICKSTART),
            *TINY,
            "model.tiny=null",
            f"model.path={folder}",
            *overrides,
            "logging.progress=false",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
