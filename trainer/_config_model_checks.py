"""What the adapters (``model.lora``) and sequence packing (``train.packing``) need of the
training strategies, the engine and the policy model, asked where the config loads
(``trainer._config_checks.cross_section_problems``, so by ``envhub train --dry-run`` too), not
when the workers build the model after the cluster, the engines and the env pool started:

- a training strategy that can hold adapters (fsdp2 without tensor parallelism), and one that
  runs packed rows for every active training role;
- each ``model.lora.target_modules`` entry names a linear or embedding layer of the model (what
  ``lora.apply_lora`` refuses otherwise), and a typo is answered with the model's close names;
- no adapter on an output head that shares the input embedding's weight
  (``lora.tied_head_refusal``);
- an engine that loads adapters (``sync: adapter``), with a rank vLLM can hold
  (``lora.vllm_max_rank``);
- no packed rows for a model whose attention adds ALiBi position biases (Bloom, MPT, Falcon with
  ``alibi``): they are built from a 2-D padding mask, one sequence per row
  (``packing.uses_alibi``).

The model's layer names come from ``config.json`` alone where ``trainer.model_shape`` knows the
family (and from ``model.tiny`` as it would be built), else from the model transformers builds
from the config on the meta device (no weights read, no memory). A model neither can read (no
config.json, a family transformers lacks) is not checked here: loading it says what is wrong.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import ModelError, Problem
from trainer.strategies.registry import TRAIN_STRATEGIES, engine_spec

if TYPE_CHECKING:
    from types import SimpleNamespace

    from trainer.config import TrainerConfig

__all__ = ["lora_problems", "packing_problems"]

OUTPUT_HEAD = "lm_head"
"""The output head's module name in every family the trainer loads (``*ForCausalLM.lm_head``)."""

PACKED_ROLES = ("actor_train", "reference", "critic")
"""The roles whose strategy runs packed rows under ``train.packing``."""


def lora_problems(cfg: TrainerConfig, policy: SimpleNamespace | None) -> list[Problem]:
    """``model.lora``: a training strategy that can hold adapters, targets the model has, an
    engine that can load them. ``policy`` is the policy's config as far as it is known before any
    model is built (``_config_checks._policy_config``; None: unknown)."""
    lora = cfg.model.lora
    if lora is None:
        return []
    problems = []
    strategy = cfg.roles.actor_train.strategy or "hf"
    spec = TRAIN_STRATEGIES.get(strategy)
    if spec is not None and not spec.lora:
        able = [name for name, s in TRAIN_STRATEGIES.items() if s.lora]
        problems.append(
            Problem(
                "model.lora",
                f"roles.actor_train.strategy={strategy!r} cannot train adapters (it trains every "
                f"weight); use one of {able} or drop model.lora",
            )
        )
    train = cfg.roles.actor_train
    if strategy == "fsdp2" and int(train.strategy_args.get("tensor_parallel_size", 1)) > 1:
        problems.append(
            Problem(
                "model.lora",
                "fsdp2 cannot split adapter-wrapped layers over tensor-parallel ranks; drop "
                "model.lora or roles.actor_train.strategy_args.tensor_parallel_size",
            )
        )
    problems.extend(_target_problems(cfg))
    head = lora.target_modules != "all-linear" and OUTPUT_HEAD in lora.target_modules
    if head and getattr(policy, "tie_word_embeddings", False):
        from trainer.strategies.lora import tied_head_refusal

        why = tied_head_refusal(OUTPUT_HEAD).removeprefix("model.lora.target_modules ")
        problems.append(Problem("model.lora.target_modules", why))
    if lora.sync == "adapter" and not engine_spec(cfg.rollout.engine).adapters:
        problems.append(
            Problem(
                "model.lora.sync",
                f"the {cfg.rollout.engine!r} engine cannot load adapters; set "
                "model.lora.sync: merged",
            )
        )
    elif lora.sync == "adapter" and cfg.rollout.engine == "vllm":
        problems.extend(_vllm_rank_problems(lora.rank))
    return problems


def _vllm_rank_problems(rank: int) -> list[Problem]:
    """A rank above the largest ``max_lora_rank`` vLLM accepts: its engine refuses to build."""
    from trainer.strategies.lora import VLLM_RANKS, vllm_max_rank

    try:
        vllm_max_rank(rank)
    except ModelError:
        largest = VLLM_RANKS[-1]
        return [
            Problem(
                "model.lora.rank",
                f"{rank} is above vLLM's largest LoRA rank {largest} (its max_lora_rank, which "
                f"rollout.engine: vllm needs to load adapters); set model.lora.rank: {largest} or "
                "lower, or model.lora.sync: merged (the engine then gets full weights, no "
                "adapters)",
            )
        ]
    return []


def _target_problems(cfg: TrainerConfig) -> list[Problem]:
    """Each ``model.lora.target_modules`` entry that names no linear or embedding layer of the
    model (compared by its last name part, as ``lora.apply_lora`` does), with the close names."""
    lora = cfg.model.lora
    if lora is None or lora.target_modules == "all-linear":
        return []
    named = [entry for entry in lora.target_modules if entry != "all-linear"]
    names = _adaptable_module_names(cfg) if named else None
    if names is None:
        return []
    problems = []
    for entry in named:
        leaf = entry.rsplit(".", 1)[-1]
        if leaf in names:
            continue
        close = [repr(name) for name in difflib.get_close_matches(leaf, names, n=3)]
        said = " or ".join(close) if len(close) < 3 else f"{', '.join(close[:-1])} or {close[-1]}"
        hint = f"did you mean {said}? " if close else ""
        problems.append(
            Problem(
                "model.lora.target_modules",
                f"{entry!r} matches no linear or embedding layer of this model; {hint}its "
                f"layers are {names} (or use 'all-linear')",
            )
        )
    return problems


def _adaptable_module_names(cfg: TrainerConfig) -> list[str] | None:
    """The last name parts of the policy's linear and embedding layers (what ``target_modules``
    may name), read without loading weights; None when the model cannot be read here."""
    from trainer.model_shape import ModelShape, UnknownModelShape

    if cfg.model.tiny is not None:
        return ModelShape.from_tiny(cfg.model.tiny).adaptable_module_names()
    if cfg.model.path is None:
        return None
    folder = Path(cfg.model.path).expanduser()
    try:
        return ModelShape.from_path(folder).adaptable_module_names()
    except OSError:  # no config.json: loading the model says so
        return None
    except (UnknownModelShape, ValueError):  # another family: transformers knows its layers
        return _meta_module_names(folder)


def _meta_module_names(folder: Path) -> list[str] | None:
    """:func:`lora.adaptable_module_names` of the causal LM ``folder``'s config.json describes,
    built on the meta device (no weights, no memory); None when transformers cannot build it."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from trainer.strategies.lora import adaptable_module_names

        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - any reason it cannot be built: loading it says which
        return None
    return adaptable_module_names(model)


def packing_problems(cfg: TrainerConfig, policy: SimpleNamespace | None) -> list[Problem]:
    """``train.packing``: every active training role's strategy runs packed rows, and the model's
    attention takes them (not ALiBi; ``policy`` as in :func:`lora_problems`)."""
    if not cfg.train.packing:
        return []
    from trainer.strategies.packing import alibi_refusal, uses_alibi

    problems = []
    for name in PACKED_ROLES:
        spec = TRAIN_STRATEGIES.get(getattr(cfg.roles, name).strategy or "hf")
        if name in cfg.active_roles and spec is not None and not spec.packing:
            able = [n for n, s in TRAIN_STRATEGIES.items() if s.packing]
            problems.append(
                Problem(
                    "train.packing",
                    f"roles.{name}.strategy={spec.name!r} does not run packed rows; use one "
                    f"of {able} or set train.packing: false",
                )
            )
    if policy is not None and uses_alibi(policy):
        why = alibi_refusal(str(getattr(policy, "model_type", "this model")))
        problems.append(Problem("train.packing", why.removeprefix("train.packing ")))
    return problems
