"""What a strategy, the adapters or the generation worker refuse of this model when the workers
build it, asked at config load (``trainer._config_checks.cross_section_problems``, so by
``envhub train --dry-run`` too): fsdp2 tensor parallelism the model's sizes or blocks cannot take,
LoRA on an input embedding that the output head shares where the adapters would be added into
the weights, engine arguments the ``actor_infer`` worker passes itself, a vLLM engine spanning
another number of devices than each ``actor_infer`` worker holds, and a metric sink whose
package is missing (found before any worker starts, not minutes later). Each is reported at the
key to change, with the fix.

``local_device_problems`` asks the machine, not the config: GPUs a local run maps but this
machine lacks (or ids beyond ``cluster.num_devices``). It runs where a run starts its local Ray
(``resources_for``) and in ``--dry-run``, not at config load: GPU recipes are loaded and planned
on machines without GPUs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from trainer.errors import Problem

if TYPE_CHECKING:
    from types import SimpleNamespace

    from trainer.config import TrainerConfig

__all__ = [
    "engine_argument_problems",
    "fsdp2_tensor_parallel_problems",
    "local_device_problems",
    "local_gpu_problems",
    "sink_problems",
    "tied_embedding_problems",
    "vllm_devices_problems",
    "vllm_option_problems",
]

TENSOR_PARALLEL_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
"""The sizes fsdp2's tensor parallelism splits (``fsdp2._tensor_parallel``): each must be a
multiple of ``tensor_parallel_size``."""

LLAMA_BLOCKS = ("llama", "mistral", "qwen2", "qwen3")
"""Families (``model_type``) whose blocks have the layers fsdp2's ``TP_PLAN`` splits
(``self_attn.q_proj`` ... ``mlp.down_proj``); of the others the trainer loads, gpt2 has not."""

INPUT_EMBEDDING = {"gpt2": "wte"}
"""The input embedding's module name where it is not ``embed_tokens`` (``model_shape.FAMILIES``)."""

WORKER_ENGINE_ARGS = {
    "name": "rollout.engine",
    "model_path": "model.path (or the model built from model.tiny)",
    "dtype": "model.dtype",
    "seed": "seed (rank r's engine gets seed + 7 x r)",
    "lora_rank": "model.lora.rank (with model.lora.sync: adapter)",
}
"""Where the ``actor_infer`` worker takes each engine argument it passes itself (``InferWorker``,
``roles.start_roles``); its keys are ``_config_checks.ENGINE_ARGS_OF_THE_WORKER``."""


def fsdp2_tensor_parallel_problems(
    cfg: TrainerConfig, config: SimpleNamespace | None, refused: set[str]
) -> list[Problem]:
    """A ``tensor_parallel_size`` of an fsdp2 role that the policy's attention heads, KV heads or
    MLP width do not divide, or a policy without Llama/Qwen2-style blocks: what
    ``fsdp2._tensor_parallel`` refuses when the workers set up the mesh. ``config``: the policy's
    (``_config_checks._policy_config``); roles with a path in ``refused`` are already refused."""
    from trainer.model_shape import FAMILIES

    problems: list[Problem] = []
    for name in ("actor_train", "reference", "critic"):
        role = getattr(cfg.roles, name)
        tp = role.strategy_args.get("tensor_parallel_size", 1)
        if (
            config is None
            or name not in cfg.active_roles
            or role.strategy != "fsdp2"
            or tp == 1
            or any(path.startswith(f"roles.{name}.") for path in refused)
        ):
            continue
        model_type = getattr(config, "model_type", None)
        if model_type in FAMILIES and model_type not in LLAMA_BLOCKS:
            why = (
                f"{model_type} has no Llama/Qwen2-style blocks (self_attn.q_proj ... mlp.down_proj)"
            )
            fix = "drop tensor_parallel_size (one rank per model copy), or use a llama/qwen model"
        else:
            sizes = {what: getattr(config, what, None) for what in TENSOR_PARALLEL_SIZES}
            known = {what: size for what, size in sizes.items() if isinstance(size, int)}
            why = "; ".join(
                f"{what}={size} is not divisible by tensor_parallel_size={tp}"
                for what, size in known.items()
                if size % tp
            )
            common = math.gcd(*known.values(), role.world_size)
            able = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
            fix = (
                "choose a tensor_parallel_size that divides them and the role's "
                f"{role.world_size} workers ({able}), or drop it"
            )
        if not why:
            continue
        problems.append(
            Problem(
                f"roles.{name}.strategy_args.tensor_parallel_size",
                f"fsdp2 tensor parallelism impossible for this model: {why}; {fix}",
            )
        )
    return problems


def tied_embedding_problems(cfg: TrainerConfig, config: SimpleNamespace | None) -> list[Problem]:
    """LoRA on the input embedding of a policy whose output head shares its weight, with
    ``warm_start: adapters`` or ``sync: merged``: adding that adapter into the weights changes the
    head too, so ``lora.apply_lora`` refuses the pair when the workers build the model."""
    lora = cfg.model.lora
    model_type = getattr(config, "model_type", None)
    if lora is None or lora.target_modules == "all-linear" or config is None:
        return []
    from trainer.model_shape import FAMILIES

    embed = INPUT_EMBEDDING.get(str(model_type), "embed_tokens")
    if model_type not in FAMILIES or not getattr(config, "tie_word_embeddings", False):
        return []  # the embedding's name is not known here: apply_lora refuses it if need be
    adding = [
        what
        for what, used in (
            ("warm_start: adapters", lora.warm_start == "adapters"),
            ("sync: merged", lora.sync == "merged"),
        )
        if used
    ]
    if embed not in lora.target_modules or not adding:
        return []
    return [
        Problem(
            "model.lora.target_modules",
            f"adapts {embed}, the input embedding, whose weight this model's output head shares "
            f"(tied embeddings): {' and '.join(adding)} would add the adapter into the head too "
            "(a warm start folds the adapters into the weights, a merged sync merges them in); "
            f"use model.lora.warm_start: full and sync: adapter, or drop {embed} from "
            "model.lora.target_modules",
        )
    ]


def engine_argument_problems(cfg: TrainerConfig) -> list[Problem]:
    """``roles.actor_infer.strategy_args`` keys the ``actor_infer`` worker passes the engine
    itself (``WORKER_ENGINE_ARGS``): given twice, the start fails with "got multiple values for
    keyword argument". Every engine; and a vLLM engine's layout (``vllm_devices_problems``)."""
    passed_twice = [
        Problem(
            f"roles.actor_infer.strategy_args.{key}",
            f"the actor_infer worker passes it to the engine itself, from {source}; set "
            f"{source.split(' ')[0]} instead and remove it from strategy_args",
        )
        for key, source in WORKER_ENGINE_ARGS.items()
        if key in cfg.roles.actor_infer.strategy_args
    ]
    return passed_twice + vllm_devices_problems(cfg)


def vllm_devices_problems(cfg: TrainerConfig) -> list[Problem]:
    """A vLLM engine spans ``tensor_parallel_size`` x ``pipeline_parallel_size`` devices, and each
    ``actor_infer`` worker runs one engine on the ``num_devices_per_worker`` devices it holds:
    when the two differ, each worker would try to start an engine wider than its devices (or
    leave some idle). Refused naming both keys; device-less (CPU) workers are not checked."""
    infer = cfg.roles.actor_infer
    args = infer.strategy_args
    if cfg.rollout.engine != "vllm" or not infer.device_mapping:
        return []
    tp, pp = args.get("tensor_parallel_size", 1), args.get("pipeline_parallel_size", 1)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (tp, pp)):
        return []  # not a layout at all: vLLM refuses its own argument
    span = tp * pp
    held = infer.num_devices_per_worker
    if span == held:
        return []
    key = "roles.actor_infer.strategy_args"
    if pp > 1:
        layout = f"{key}.tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
        other = f"tensor_parallel_size x pipeline_parallel_size = {held}"
    else:
        layout, other = f"{key}.tensor_parallel_size={tp}", f"{key}.tensor_parallel_size: {held}"
    return [
        Problem(
            "roles.actor_infer.num_devices_per_worker",
            f"is {held}, but each actor_infer worker's vLLM engine spans {span} device(s) "
            f"({layout}): set roles.actor_infer.num_devices_per_worker: {span} (with a "
            f"device_mapping of a multiple of {span} devices), or {other}",
        )
    ]


def vllm_option_problems(cfg: TrainerConfig) -> list[Problem]:
    """``roles.actor_infer.strategy_args`` keys neither ``VLLMEngine`` nor ``vllm.EngineArgs``
    takes (the engine start would fail with a TypeError once the cluster is up), with the
    closest valid key, and a step token budget below ``max_model_len`` where prefill is not
    chunked (vLLM refuses it as the engine starts). Checked only where vLLM is installed (its
    arguments change with it)."""
    import difflib

    from trainer.strategies.vllm_platform import engine_options

    options = engine_options()
    if cfg.rollout.engine != "vllm" or options is None:
        return []
    valid = sorted(options - set(WORKER_ENGINE_ARGS))
    problems: list[Problem] = []
    args = cfg.roles.actor_infer.strategy_args
    if "gpu_memory_utilization" in args and args.get("kv_cache_gib", 1.0) is not None:
        problems.append(
            Problem(
                "roles.actor_infer.strategy_args.gpu_memory_utilization",
                f"is ignored while kv_cache_gib sizes the KV cache ({args.get('kv_cache_gib', 1.0)}"
                " GiB; 1 unless set): set kv_cache_gib: null to size it by "
                "gpu_memory_utilization, or drop gpu_memory_utilization",
            )
        )
    budget, context = args.get("max_num_batched_tokens"), args.get("max_model_len")
    chunked = args.get("enable_chunked_prefill", cfg.cluster.device_resource == "GPU")
    if isinstance(budget, int) and isinstance(context, int) and not chunked and budget < context:
        problems.append(
            Problem(
                "roles.actor_infer.strategy_args.max_num_batched_tokens",
                f"{budget} is below max_model_len {context}, and without chunked prefill (the "
                "engine turns it off unless cluster.device_resource is GPU) one step must hold a "
                f"whole prompt: raise it to {context} or more, or lower max_model_len",
            )
        )
    given = set(args) - set(WORKER_ENGINE_ARGS)  # said apart
    for key in sorted(given - options):
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        problems.append(
            Problem(
                f"roles.actor_infer.strategy_args.{key}",
                "not an argument of the 'vllm' inference engine (a keyword of VLLMEngine or a "
                f"field of vllm.EngineArgs); {hint}otherwise remove it",
            )
        )
    return problems


def local_device_problems(cfg: TrainerConfig, *, planning: bool = False) -> list[Problem]:
    """Mapped devices a run that starts its own Ray (ray backend, no ``cluster.address``) lacks:
    GPUs this machine does not have (``local_gpu_problems``), or ids beyond
    ``cluster.num_devices``. ``planning``: as ``local_gpu_problems``."""
    if cfg.cluster.backend != "ray" or cfg.cluster.address is not None:
        return []
    if cfg.cluster.device_resource == "GPU":
        return local_gpu_problems(cfg, planning=planning)
    return cfg.device_mapping().problems([cfg.local_num_devices])


def local_gpu_problems(cfg: TrainerConfig, *, planning: bool = False) -> list[Problem]:
    """Each active role whose ``device_mapping`` names a GPU this machine lacks, when the run
    starts its own Ray on GPUs (``cluster.device_resource: GPU``, no ``cluster.address``): Ray
    would otherwise declare the GPUs the mapping names, and the ranks without one would fall
    back to the CPU beside CUDA ranks. ``planning`` (``--dry-run``): a machine with no GPU is
    taken for a planning host, where nothing is refused."""
    import os

    from trainer import devices

    if cfg.cluster.device_resource != "GPU" or cfg.cluster.address is not None:
        return []  # a custom resource stands for host memory; a joined cluster counts its own
    gpus = devices.local_gpu_count()
    if planning and gpus == 0:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    have = f"this machine has {gpus} GPU{'' if gpus == 1 else 's'}{shown}"
    fix = (
        f"map GPUs 0-{gpus - 1}, or set cluster.address to join a Ray cluster that has them"
        if gpus
        else "run it on a GPU machine, or set cluster.address to join a Ray cluster with GPUs"
    )
    problems = []
    for role in cfg.active_roles:
        mapped = getattr(cfg.roles, role).device_mapping
        if mapped and max(mapped) >= gpus:
            problems.append(
                Problem(
                    f"roles.{role}.device_mapping", f"names GPU {max(mapped)} but {have}; {fix}"
                )
            )
    return problems


def sink_problems(cfg: TrainerConfig) -> list[Problem]:
    """``logging.wandb`` without the ``wandb`` package (``MetricsLog`` imports it once the workers
    are built; the check looks the package up without importing it)."""
    import importlib.util

    if not cfg.logging.wandb:
        return []
    try:
        installed = importlib.util.find_spec("wandb") is not None
    except ValueError:  # in sys.modules as None: imports of it are blocked
        installed = False
    if installed:
        return []
    return [
        Problem(
            "logging.wandb",
            "needs the wandb package, which is not installed; pip install wandb, or set "
            "logging.wandb=false",
        )
    ]
