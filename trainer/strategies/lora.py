"""Low-rank adapters (LoRA) through ``peft``: the trained policy's side and the engines' side.

With ``model.lora`` set, the actor wraps its policy with ``peft.get_peft_model`` before the
strategy lays it out (``hf``; ``fsdp2`` shards the wrapped model): only the adapters
(``lora_A``/``lora_B``) require gradients and live in the optimiser, the base weights are frozen.
What that changes, and where:

The reference policy
    is the base model with the adapters switched off (``reference_logprobs``): no second copy of
    the weights, no reference workers.
The warm start
    trains the adapters; :func:`fold_adapters` then adds them into the base and restarts them at
    zero, so RL begins from the warm-started policy (which the reference, adapters off, now is).
The weight sync (``trainer.weights.sync``)
    sends the engines the base once in HF naming (:func:`engine_weights`, adapters excluded),
    after which each sync moves only the adapters (:func:`adapter_state`: ``peft``'s own names
    and config, an :class:`AdapterWeights`), which the engine loads beside its base
    (``HFEngine.load_adapter`` wraps its model with the same config; ``VLLMEngine.load_adapter``
    registers a vLLM LoRA adapter per version). ``model.lora.sync: merged`` instead sends the
    full weights with the adapters merged in, for engines without LoRA support.
Checkpoints and export
    The strategy's state dict holds base and adapters (a resume is exact). ``final_policy/`` is
    the merged model (:func:`save_plain` of the merged weights) or, with ``model.lora.export:
    adapter``, a ``peft`` adapter folder (:func:`write_adapter`) with its base in ``base/``.

Megatron-Core layouts are not adapted here: ``model.lora`` with ``strategy: megatron`` is a config
error (``trainer._config_checks``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import ModelError

if TYPE_CHECKING:
    import torch

    from trainer.config import LoraConfig, TrainerConfig

__all__ = [
    "VLLM_RANKS",
    "AdapterWeights",
    "Merge",
    "adaptable_module_names",
    "adapter_state",
    "apply_lora",
    "dropout_warning",
    "engine_weights",
    "export_config",
    "fold_adapters",
    "freeze_adapters",
    "is_lora",
    "merge_of",
    "policy_dropout",
    "save_plain",
    "tied_head_refusal",
    "ties_embeddings",
    "train_base",
    "vllm_max_rank",
    "write_adapter",
]

ADAPTER = "default"
"""The one adapter every wrapped policy has (``peft``'s default name)."""

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (its ``MaxLoRARanks``)."""


@dataclass
class AdapterWeights:
    """One adapter as a sync hands it to the engines: ``peft``'s tensors and its config."""

    tensors: dict[str, torch.Tensor]
    """``get_peft_model_state_dict`` names (``base_model.model.<module>.lora_A.weight``), CPU."""
    config: dict[str, Any]
    """``peft.LoraConfig`` as a JSON-able dict (what ``adapter_config.json`` holds)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def adaptable_module_names(model: Any, *, linear_only: bool = False) -> list[str]:
    """The distinct last name parts of the model's linear and embedding layers (what
    ``target_modules`` may name), e.g. ``['down_proj', 'embed_tokens', 'gate_proj', ...]``.
    GPT-2's ``Conv1D`` layers are linear layers stored transposed: peft adapts them as such."""
    import torch
    from transformers.pytorch_utils import Conv1D

    linear = (torch.nn.Linear, Conv1D)
    kinds = linear if linear_only else (*linear, torch.nn.Embedding)
    modules = model.named_modules()
    return sorted({name.rsplit(".", 1)[-1] for name, m in modules if isinstance(m, kinds)})


def _embedding_name(model: Any, side: str) -> str | None:
    """The last name part of the model's ``input`` or ``output`` embedding (None: it has none)."""
    getter = getattr(model, f"get_{side}_embeddings", None)
    layer = getter() if getter is not None else None
    return next((n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is layer), None)


def ties_embeddings(model: Any) -> bool:
    """Whether the model's output head shares its weight with the input embedding."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return head is not None and embed is not None and head.weight is embed.weight


def tied_head_refusal(head: str) -> str:
    """Why an adapter on the output head ``head`` is refused where the head shares its weight with
    the input embedding (tied embeddings), and the fix: said at config load
    (``trainer._config_checks``) and, for a model whose config.json does not tell, by
    :func:`apply_lora`."""
    return (
        f"model.lora.target_modules adapts {head}, the output head, whose weight this model "
        "shares with its input embedding (tie_word_embeddings): the exported final_policy "
        "re-ties the head and loses its adapter, and a merged weight sync would write the "
        f"adapted head into the engine's embedding; drop {head} from target_modules "
        "(all-linear leaves the head alone), or use a model with untied embeddings"
    )


def _targets(model: Any, cfg: LoraConfig) -> str | list[str]:
    """``cfg.target_modules`` with an ``all-linear`` entry of a list expanded (every linear layer
    but the output head), checked against the model's layers."""
    targets = cfg.target_modules
    if targets == "all-linear":
        return targets
    if "all-linear" in targets:
        head = _embedding_name(model, "output")
        linear = [n for n in adaptable_module_names(model, linear_only=True) if n != head]
        targets = [*linear, *(t for t in targets if t != "all-linear" and t not in linear)]
    present = set(adaptable_module_names(model))
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in present]
    if missing:
        raise ModelError(
            f"model.lora.target_modules {missing} match no linear or embedding layer of this "
            f"model; its layers are {adaptable_module_names(model)} (or use 'all-linear')"
        )
    return list(targets)


def apply_lora(model: Any, cfg: LoraConfig) -> Any:
    """``model`` wrapped with fresh adapters (``peft.get_peft_model``); only they train.

    Target modules that match no layer raise ``ModelError`` listing the layers there are. An
    adapted input embedding changes the input side only, also where the output head shares its
    weight (tied embeddings): there, adding it into the shared weight would change the head too,
    so what needs that (``warm_start: adapters``, ``sync: merged``) is refused, and a merged
    export unties the head (``export_config``). An adapted output head that shares the
    embedding's weight is refused (:func:`tied_head_refusal`; the config check refuses it at
    load where config.json says the embeddings are tied).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = _targets(model, cfg)
    head_name = _embedding_name(model, "output")
    if head_name and targets != "all-linear" and head_name in targets and ties_embeddings(model):
        raise ModelError(tied_head_refusal(head_name))
    embed_name = _embedding_name(model, "input")
    if targets != "all-linear" and embed_name in targets and ties_embeddings(model):
        refused = [
            what
            for what, used in (
                ("warm_start: adapters", cfg.warm_start == "adapters"),
                ("sync: merged", cfg.sync == "merged"),
            )
            if used
        ]
        if refused:
            raise ModelError(
                f"model.lora.target_modules adapts {embed_name}, whose weight this model's output "
                f"head shares (tied embeddings): {' and '.join(refused)} would add the adapter "
                "into the head too; use model.lora.warm_start: full and sync: adapter, or drop "
                f"{embed_name} from target_modules"
            )
    config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha if cfg.alpha is not None else 2 * cfg.rank,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # tied embeddings: handled above and in export_config
            warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*")
            # Conv1D (GPT-2): peft adapts it transposed, and so does the merge (merge_of)
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            return get_peft_model(model, config)
    except ValueError as error:  # peft's own "Target modules ... not found"
        raise ModelError(
            f"model.lora.target_modules={targets!r}: {error}; the model's layers are "
            f"{adaptable_module_names(model)}"
        ) from error


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model with adapters."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def _config_dict(model: Any) -> dict[str, Any]:
    config = model.peft_config[ADAPTER].to_dict()
    for key, value in config.items():
        if isinstance(value, set):
            config[key] = sorted(value)
    return json.loads(json.dumps(config, default=str))


def adapter_state(model: Any) -> AdapterWeights:
    """The adapters' current full tensors (CPU copies) and config; what an adapter sync sends.

    A collective on a sharded model: every rank calls it, the first rank of the mesh gets the
    full tensors (the others get empty ones)."""
    # peft's own names (get_peft_model_state_dict's), read off the parameters: a full state_dict
    # of a sharded model costs more than the adapters it holds
    state = {
        _peft_name(name): param for name, param in model.named_parameters() if ".lora_" in name
    }
    tensors = _gather_row_shards(state)
    for name, tensor in state.items():
        if name not in tensors:
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            tensors[name] = full.detach().to("cpu", copy=True)
    return AdapterWeights({name: tensors[name] for name in state}, _config_dict(model))


def _peft_name(name: str) -> str:
    """A parameter's name as ``get_peft_model_state_dict`` writes it (the adapter's name
    dropped: ``...q_proj.lora_A.default.weight``, ``...embed_tokens.lora_embedding_A.default``)."""
    return name.replace(f".{ADAPTER}.", ".").removesuffix(f".{ADAPTER}")


def _gather_row_shards(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Full CPU copies of the tensors sharded by rows over one 1-D mesh (FSDP2's layout), gathered
    to the mesh's first rank in ONE collective (an adapter has hundreds of small tensors: a
    gather each costs more than their bytes); other tensors are left to the caller."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    rows = {
        name: t
        for name, t in state.items()
        if isinstance(t, DTensor) and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),)
    }
    if not rows:
        return {}
    dist = torch.distributed
    group = next(iter(rows.values())).device_mesh.get_group()
    local = {name: t.to_local().detach().cpu() for name, t in rows.items()}
    first = dist.get_global_rank(group, 0)
    gathered: list[Any] | None = [None] * dist.get_world_size(group)
    if dist.get_rank() != first:
        gathered = None  # only the mesh's first rank receives (the sync's rank 0)
    dist.gather_object(local, gathered, dst=first, group=group)
    if gathered is None:
        return {name: torch.empty(0) for name in rows}
    return {name: torch.cat([part[name] for part in gathered]) for name in rows}


def write_adapter(folder: str | Path, adapter: AdapterWeights, base_path: str) -> Path:
    """``adapter`` as a ``peft`` adapter folder (``adapter_model.safetensors`` and
    ``adapter_config.json`` naming ``base_path``): what ``PeftModel.from_pretrained`` and vLLM's
    ``LoRARequest`` load. ``AutoPeftModelForCausalLM`` loads the base ``base_path`` names as it
    is: give a folder's absolute path (peft takes a relative one for a Hub repo id)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter.tensors.items()}, folder / "adapter.tmp")
    (folder / "adapter.tmp").replace(folder / "adapter_model.safetensors")
    config = {**adapter.config, "base_model_name_or_path": base_path}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def save_plain(config: Any, tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """An HF model of ``config`` holding ``tensors`` (HF names), saved with ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(str(path))


def _hf_name(name: str) -> str | None:
    """A wrapped model's state-dict name in the base model's naming; None for adapter tensors."""
    if ".lora_" in name or "lora_magnitude" in name:
        return None
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def engine_weights(
    named: Iterable[tuple[str, torch.Tensor]], *, merge: Merge | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A wrapped model's full tensors (``strategy.full_weights()``) as the base model's HF-named
    tensors: the base alone, or with ``merge`` (:func:`merge_of`) the adapters merged in
    (``W + scaling * B @ A`` per adapted layer), as peft's own merge computes them, in fp32 and
    rounded to the base's dtype once (a bf16 base is not rounded again through bf16 adapters).

    An adapted layer's merged weight is yielded once its base weight, ``lora_A`` and ``lora_B``
    have all passed (the state dict lists them together). An embedding's adapter
    (``lora_embedding_A``: rank x vocab, ``lora_embedding_B``: dim x rank) merges transposed, and
    so does that of a layer storing its weight (in, out) (GPT-2's ``Conv1D``, peft's
    ``fan_in_fan_out``; ``Merge.transposed``). A delta that does not fit its weight is refused.
    """
    scaling, transposed = (merge.scaling, merge.transposed) if merge else (0.0, frozenset())
    pending: dict[str, dict[str, torch.Tensor]] = {}  # adapted module -> W, A, B seen so far
    for name, tensor in named:
        if ".lora_" in name:
            if merge is None:
                continue
            module, _, rest = name.partition(".lora_")
            part = rest.split(".", 1)[0]
            if part not in ("A", "B", "embedding_A", "embedding_B"):
                raise ModelError(
                    f"{name}: only linear and embedding LoRA layers can be merged for the engines"
                )
        elif merge is not None and name.endswith(".base_layer.weight"):
            module, part = name.removesuffix(".base_layer.weight"), "W"
        else:
            hf = _hf_name(name)
            if hf is not None:
                yield hf, tensor
            continue
        slot = pending.setdefault(module, {})
        slot[part] = tensor
        if len(slot) == 3:
            del pending[module]
            weight = slot["W"]
            parts = {k.removeprefix("embedding_"): v.float() for k, v in slot.items()}
            delta = parts["B"] @ parts["A"]  # fp32, whatever the base's dtype: rounded once
            hf = module.removeprefix("base_model.model.")
            if "embedding_A" in slot or hf in transposed:
                delta = delta.T
            if delta.shape != weight.shape:
                raise ModelError(
                    f"{hf}: the adapter's delta {tuple(delta.shape)} does not fit the weight "
                    f"{tuple(weight.shape)}; merge with merge_of(model), which names the layers "
                    "stored (in, out) (Conv1D)"
                )
            yield f"{hf}.weight", (parts["W"] + scaling * delta).to(weight.dtype)
    if pending:
        raise ModelError(f"incomplete adapted layers in the merged weights: {sorted(pending)[:3]}")


@dataclass(frozen=True)
class Merge:
    """How :func:`engine_weights` merges a wrapped model's adapters (:func:`merge_of`)."""

    scaling: float
    """``alpha / rank``: what ``B @ A`` is multiplied by."""
    transposed: frozenset[str] = frozenset()
    """HF names of the adapted layers that store their weight (in, out) (GPT-2's ``Conv1D``,
    which peft adapts with ``fan_in_fan_out``): their delta merges transposed."""


def merge_of(model: Any) -> Merge:
    """The wrapped model's :class:`Merge`: its adapter's ``alpha / rank`` and the layers stored
    (in, out), read per layer as peft decides it per layer."""
    config = model.peft_config[ADAPTER]
    transposed = frozenset(
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if ".lora_" not in name and getattr(module, "fan_in_fan_out", False)
    )
    return Merge(float(config.lora_alpha) / float(config.r), transposed)


def export_config(model: Any) -> Any:
    """The HF config a merged export is saved with: the model's own, or a copy with untied
    embeddings when an adapted input embedding shares its weight with the output head (merged,
    the embedding has changed and the head has not)."""
    import copy

    from peft.tuners.lora import Embedding

    config = model.config
    if ties_embeddings(model) and any(isinstance(m, Embedding) for m in model.modules()):
        config = copy.deepcopy(config)
        config.tie_word_embeddings = False
    return config


def train_base(model: Any, train: bool) -> None:
    """Let the base weights train too (a full warm start) or freeze them again; the adapters
    train either way (``freeze_adapters`` holds them still during a full warm start)."""
    for name, param in model.named_parameters():
        param.requires_grad_(train if ".lora_" not in name else True)


def freeze_adapters(model: Any) -> None:
    """Hold the adapters at their initial (zero) delta while the base trains alone (a full warm
    start): they would only duplicate it, and folding them afterwards is then a no-op, also for
    an embedding whose weight the output head shares. ``fold_adapters`` lets them train again."""
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.requires_grad_(False)


def fold_adapters(model: Any, optimizer: Any = None) -> None:
    """Add every adapter into its base weight and restart the adapters at zero (``lora_B = 0``,
    ``lora_A`` re-initialised), dropping their optimiser moments; a base that trained too (a
    full warm start) is frozen again and its moments dropped. The policy is unchanged (up to one
    rounding of each sum to the base's dtype), the base now is the policy, and training
    continues from fresh adapters."""
    import torch
    from peft.tuners.lora import LoraLayer

    if optimizer is not None:
        for name, param in model.named_parameters():
            if ".lora_" not in name and param.requires_grad:
                optimizer.state.pop(param, None)
    train_base(model, False)
    tied = ties_embeddings(model)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, LoraLayer):
                continue
            if ADAPTER in module.lora_A:
                params = [module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight]
            elif ADAPTER in module.lora_embedding_A:
                params = [module.lora_embedding_A[ADAPTER], module.lora_embedding_B[ADAPTER]]
            else:
                continue
            layer: Any = module  # a concrete LoRA layer (Linear, Embedding) has get_delta_weight
            base = layer.get_base_layer()
            delta = layer.get_delta_weight(ADAPTER).float()
            if tied and model.get_input_embeddings() in (module, base) and delta.any():
                raise ModelError(
                    "cannot fold an input-embedding adapter into a weight the output head shares "
                    "(tied embeddings): it would change the head too (apply_lora refuses the "
                    "settings that need this)"
                )
            # summed in fp32 and rounded to the base's dtype once, as engine_weights merges
            base.weight.copy_((base.weight.float() + delta).to(base.weight.dtype))
            module.reset_lora_parameters(ADAPTER, True)
            if optimizer is not None:
                for param in params:
                    optimizer.state.pop(param, None)


def dropout_warning(cfg: TrainerConfig) -> str | None:
    """What dropout in the training forward does to an RL run: adapter dropout
    (``model.lora.dropout``) and dropout the policy's own config sets (:func:`policy_dropout`).
    ``trainer.cli`` warns with it as the run starts, and so does ``--dry-run``. None without
    dropout or RL steps (an SFT-only run keeps it as a regulariser).

    The run keeps the dropout it is configured with, as verl's and OpenRLHF's actors load the
    checkpoint's config as it is (verl zeroes dropout for its critic only; TRL's PPO trainer
    zeroes every dropout layer): the user is told what it costs and which setting to change."""
    if cfg.train.steps == 0:
        return None
    loss = cfg.algorithm.loss
    cost = (
        "(computed in eval mode), so the PPO ratio is noisy even on-policy and the clip "
        f"(algorithm.loss.clip_low/clip_high = {loss.clip_low}/{loss.clip_high}) cuts gradient "
        "from tokens of an on-policy step"
    )
    said = []
    lora = cfg.model.lora
    if lora is not None and lora.dropout > 0:
        said.append(
            f"model.lora.dropout={lora.dropout} drops adapter inputs in the training forward but "
            f"not in the old log-probs it is compared with {cost}; set model.lora.dropout: 0 for "
            "RL"
        )
    base = policy_dropout(cfg)
    if base:
        settings = ", ".join(f"{key}={value:g}" for key, value in base.items())
        said.append(
            f"the policy's config.json (model.path {cfg.model.path}) sets {settings} "
            "(transformers' defaults where the file is silent): the training forward runs with "
            f"that dropout, the old log-probs it is compared with do not {cost}; set them to 0 in "
            "that config.json for RL"
        )
    return "; also, ".join(said) or None


UNUSED_DROPOUT = ("classifier_", "summary_")
"""Prefixes of HF config dropout fields a causal LM's forward does not use (classification
heads, GPT-2's double-heads summary)."""


def policy_dropout(cfg: TrainerConfig) -> dict[str, float]:
    """The dropout probabilities above 0 in the policy's own HF config (``*dropout*``,
    ``*pdrop*``): ``model.path``'s config.json as transformers reads it, with the class's
    defaults for the fields the file leaves out (GPT-2's 0.1s are not written). Empty for
    ``model.tiny`` (built without dropout) and for a config transformers cannot read (loading
    the model says why)."""
    if cfg.model.path is None:
        return {}
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(Path(cfg.model.path).expanduser()).to_dict()
    except Exception:  # noqa: BLE001 - any reason it cannot be read: the model load says which
        return {}
    found = {}
    for key, value in sorted(config.items()):
        named = "dropout" in key or "pdrop" in key
        if not named or key.startswith(UNUSED_DROPOUT) or isinstance(value, bool):
            continue
        try:
            probability = float(value)
        except (TypeError, ValueError):
            continue
        if probability > 0:
            found[key] = probability
    return found


def vllm_max_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for allowed in VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise ModelError(f"model.lora.rank={rank} is above vLLM's largest LoRA rank {VLLM_RANKS[-1]}")
