"""Will the run fit? Per-device memory from the config and the model's ``config.json`` alone.

``estimate(cfg)`` sizes what every active role keeps on each of its devices, phase by phase, and
``MemoryPlan.problems()`` names each device whose fullest phase exceeds its capacity, with the
knobs that would make it fit. The config check (``trainer._config_checks``) refuses such a run
before anything starts; ``envhub train CONFIG --dry-run`` prints the plan as a table. No
weights are read and torch is not imported: the shape comes from ``trainer.model_shape``, what
each role holds from ``trainer.memory_roles`` (its docstring lists every component).

Phases
    ``trainer.devices.PHASE_ROLES`` says which roles each pipeline phase uses; a colocated role
    outside it gives up what its ``offload_params`` / ``offload_optimizer`` flags say (the vLLM
    engine sleeps: weights, KV cache and workspace leave). ``start`` (every role built, nothing
    offloaded yet, no gradients or optimizer state) and ``sft`` (the warm start trains with every
    role resident) are phases too; ``rollout.mode: async`` keeps every role resident throughout.
    A device's figure is its fullest phase; each GPU process adds ``CUDA_CONTEXT_GIB``.
Capacity
    ``cluster.device_memory_gib``, else ``DEFAULT_GPU_MEMORY_GIB`` when the run declares GPUs
    (``cluster.device_resource: GPU``). Otherwise the devices stand for host memory: the plan is
    reported against this machine's RAM and nothing is refused. ``cluster.check_memory: false``
    turns the refusal off.
Besides
    a vLLM KV cache smaller than one request of ``max_model_len`` is refused (vLLM would not
    start), and the weight sync's buckets are planned with ``trainer.weights.buckets``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainer.devices import PHASE_ROLES, id_ranges
from trainer.errors import Problem
from trainer.memory_roles import (
    DTYPE_BYTES,
    GIB,
    LORA_ADAPTER_BYTES,
    Part,
    RoleMemory,
    StrategyArgError,
    Work,
    engine_role,
    micro_batch,
    sequence_tokens,
    sft_sequence_tokens,
    train_role,
)
from trainer.model_shape import ModelShape, UnknownModelShape

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = [
    "CUDA_CONTEXT_GIB",
    "DEFAULT_GPU_MEMORY_GIB",
    "DeviceLoad",
    "MemoryPlan",
    "demonstration_problems",
    "estimate",
    "host_memory_bytes",
    "model_shape",
    "sync_buckets",
]

DEFAULT_GPU_MEMORY_GIB = 80.0
"""Device capacity when the run declares GPUs and ``cluster.device_memory_gib`` is unset (an
A100/H100 80 GB; set the knob for 24/40 GB cards or a 141 GB H200)."""
CUDA_CONTEXT_GIB = 0.5
"""What a process's CUDA context, cuBLAS and NCCL workspaces take on each GPU it uses."""


@dataclass(frozen=True)
class DeviceLoad:
    """One device at its fullest phase."""

    device: int
    phase: str
    parts: tuple[tuple[str, Part], ...]
    """``(role, part)`` on the device in that phase (role ``cuda``: the processes' contexts)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Total bytes of every phase."""

    @property
    def total(self) -> int:
        return sum(part.nbytes for _, part in self.parts)


@dataclass(frozen=True)
class MemoryPlan:
    """The estimate of one run (see the module docstring)."""

    shape: ModelShape
    shape_source: str
    sequence_tokens: int
    sequence_note: str
    micro_tokens: int
    roles: dict[str, RoleMemory]
    devices: tuple[DeviceLoad, ...]
    capacity: int | None
    """Bytes of one device; None when the devices stand for host memory (nothing refused)."""
    capacity_note: str
    host_memory: int | None = None
    found: tuple[Problem, ...] = ()
    sft_tokens: int | None = None
    """The warm start's longest row where it is not a rollout's (``sft.source: file``)."""
    sft_note: str = ""

    def problems(self) -> list[Problem]:
        """Devices over capacity (with the knobs to turn) and an engine that cannot start."""
        return list(self.found)


def model_shape(cfg: TrainerConfig) -> tuple[ModelShape, str]:
    """The policy's shape and where it came from: ``model.path``'s config.json, the tiny policy
    already built in ``output_dir``, or ``model.tiny`` with its vocabulary at the bound. Raises
    OSError (no config.json) or ``UnknownModelShape``."""
    if cfg.model.path is not None:
        return ModelShape.from_path(cfg.model.path), f"{cfg.model.path}/config.json"
    built = f"{cfg.output_dir}/initial_policy"
    try:
        return ModelShape.from_path(built), f"{built}/config.json"
    except OSError:
        tiny = cfg.model.tiny
        if tiny is None:  # ModelConfig's validator allows a path or a tiny model, never neither
            raise UnknownModelShape("set model.path or model.tiny")
        return ModelShape.from_tiny(tiny, tiny.vocab_size), "model.tiny (vocabulary at its bound)"


# --------------------------------------------------------------------------- phases and devices


def _phases(cfg: TrainerConfig) -> dict[str, tuple[dict[str, Work], bool]]:
    """phase -> ({role: its work}, whether colocated roles swap around it)."""
    swaps = cfg.rollout.mode != "async"  # async rollouts run during training: nothing swaps
    phases: dict[str, tuple[dict[str, Work], bool]] = {"start": ({}, False)}
    if cfg.sft.epochs > 0:
        phases["sft"] = ({"actor_train": "sft"}, False)
    works: dict[str, Work] = {
        "actor_infer": "generate",
        "reference": "forward",
        "critic": "forward",
        "actor_train": "train",
    }
    for phase, roles in PHASE_ROLES.items():
        if phase == "eval":
            continue  # sized with the rollout (the engine's batch is the larger of the two)
        work = {r: works[r] for r in roles}
        if phase == "train":
            work["critic"] = "train"
            if not swaps:
                work["actor_infer"] = "generate"
        if phase == "sync":
            work = {"actor_train": "sync", "actor_infer": "sync"}
        if phase == "reference" and cfg.rollout.top_p != 1.0:
            work["actor_train"] = "forward"  # old log-probs recomputed: its parameters reload
        phases[phase] = (work, swaps)
    return phases


def _away_after(
    cfg: TrainerConfig, phase: str, work: Mapping[str, Work], away: dict[str, set[str]]
) -> None:
    """Update ``away`` (role -> the states it has off its devices: ``params``, ``optimizer``,
    ``engine``) as the pipeline's colocation switch does when ``phase`` begins
    (``trainer.devices.Colocation.activate``), then as the phase's calls reload what they use."""
    plan, active = cfg.device_plan, PHASE_ROLES.get(phase, ())
    for role, states in away.items():
        config = getattr(cfg.roles, role)
        if role in active:
            states.clear()
        elif any(plan.colocated(role, other) for other in active) and (
            config.offload_params or config.offload_optimizer
        ):
            flags = {"params": config.offload_params, "optimizer": config.offload_optimizer}
            states |= {state for state, on in flags.items() if on} | {"engine"}
        if role in work:  # a call that needs the parameters reloads them (Residency.require)
            states.discard("params")


def _resident(memory: RoleMemory, phase: str, work: Work | None, away: set[str]) -> list[Part]:
    """The parts of ``memory`` on its device during ``phase``."""
    kept = []
    for part in memory.parts:
        if part.kind == "work" and part.work != work:
            continue
        if part.trained and phase == "start":
            continue  # no gradients or optimizer state before the first step
        if part.kind in away:
            continue
        kept.append(part)
    return kept


def _device_loads(
    cfg: TrainerConfig, roles: Mapping[str, RoleMemory], on_gpu: bool
) -> tuple[DeviceLoad, ...]:
    """Each device's parts phase by phase, over two turns of the step loop (states carry over
    from one phase to the next), and its fullest phase."""
    phases = _phases(cfg)
    loop = [p for p in phases if p not in ("start", "sft")]
    away: dict[str, set[str]] = {role: set() for role in roles}
    devices = sorted({d for m in roles.values() for d in m.devices})
    totals: dict[int, dict[str, list[tuple[str, Part]]]] = {d: {} for d in devices}
    for phase in [p for p in phases if p in ("start", "sft")] + loop + loop:
        work, swaps = phases[phase]
        if swaps:
            _away_after(cfg, phase, work, away)
        for device in devices:
            here = [m for m in roles.values() if device in m.devices]
            parts = [
                (m.role, p)
                for m in here
                for p in _resident(m, phase, work.get(m.role), away[m.role])
            ]
            if on_gpu:
                processes = 1 if cfg.cluster.backend == "local" else len(here)
                context = Part("context", int(processes * CUDA_CONTEXT_GIB * GIB), "fixed")
                parts.append(("cuda", context))
            known = totals[device].get(phase)
            if known is None or _bytes(parts) > _bytes(known):
                totals[device][phase] = parts
    loads = []
    for device, by_phase in totals.items():
        peak = max(by_phase, key=lambda p: _bytes(by_phase[p]))
        sizes = {p: _bytes(v) for p, v in by_phase.items()}
        loads.append(DeviceLoad(device, peak, tuple(by_phase[peak]), sizes))
    return tuple(loads)


def _bytes(parts: list[tuple[str, Part]]) -> int:
    return sum(part.nbytes for _, part in parts)


# --------------------------------------------------------------------------- the estimate


def _capacity(cfg: TrainerConfig) -> tuple[int | None, bool, str]:
    """(bytes of one device or None, whether the devices are GPUs, how that was decided)."""
    cluster = cfg.cluster
    if cluster.device_memory_gib is not None:
        gib = cluster.device_memory_gib
        return int(gib * GIB), True, f"{gib:g} GiB per device (cluster.device_memory_gib)"
    if cluster.device_resource == "GPU":
        return (
            int(DEFAULT_GPU_MEMORY_GIB * GIB),
            True,
            f"{DEFAULT_GPU_MEMORY_GIB:g} GiB per GPU (the default: set cluster.device_memory_gib)",
        )
    return (
        None,
        False,
        "host memory (no GPUs declared: cluster.device_memory_gib unset), not checked",
    )


def host_memory_bytes() -> int | None:
    """This machine's RAM (``MemTotal``), or None where ``/proc/meminfo`` does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimate(
    cfg: TrainerConfig, shape: ModelShape | None = None, *, sft_tokens: int | None = None
) -> MemoryPlan:
    """The memory plan of ``cfg`` (its model's shape is read from ``model.path``'s config.json,
    or ``model.tiny``); raises OSError/``UnknownModelShape`` when there is no shape to read.
    ``sft_tokens``: the longest demonstration of ``sft.path`` as the tokenizer counted it (else
    estimated from the file: ``memory_roles.sft_sequence_tokens``)."""
    source = "given"
    if shape is None:
        shape, source = model_shape(cfg)
    capacity, on_gpu, capacity_note = _capacity(cfg)
    seq, seq_note = sequence_tokens(cfg, shape)
    sft_seq, sft_note = sft_sequence_tokens(cfg, shape, sft_tokens)
    from_file = (sft_seq, sft_note) != (seq, seq_note)  # sft.path's rows, not the rollouts'
    roles: dict[str, RoleMemory] = {}
    problems: list[Problem] = []
    for name in cfg.active_roles:
        role = getattr(cfg.roles, name)
        if name == "actor_infer":
            roles[name], engine_problems = engine_role(
                role, cfg, shape, on_gpu=on_gpu, capacity=capacity
            )
            problems += engine_problems
        else:
            sft = sft_seq if from_file and name == "actor_train" else None
            roles[name] = train_role(name, role, cfg, shape, on_gpu=on_gpu, sft_seq=sft)
    _add_sync_bucket(cfg, shape, roles)
    loads = _device_loads(cfg, roles, on_gpu)
    if capacity is not None:
        problems += _over_capacity(cfg, loads, capacity, sft_note if from_file else None)
    return MemoryPlan(
        shape=shape,
        shape_source=source,
        sequence_tokens=seq,
        sequence_note=seq_note,
        micro_tokens=micro_batch(cfg, seq)[0],
        roles=roles,
        devices=loads,
        capacity=capacity,
        capacity_note=capacity_note,
        host_memory=None if on_gpu else host_memory_bytes(),
        found=tuple(problems),
        sft_tokens=sft_seq if from_file else None,
        sft_note=sft_note if from_file else "",
    )


def demonstration_problems(cfg: TrainerConfig, demo_tokens: int) -> list[Problem]:
    """The memory check again, now that the tokenizer has counted ``sft.path``'s longest
    demonstration (``demo_tokens``), which the config check could only estimate from the file's
    bytes: a device the warm start's rows do not fit (``trainer.sft.load_demo_file`` refuses the
    run with it before any worker starts). Empty with ``cluster.check_memory: false``."""
    if not cfg.cluster.check_memory:
        return []
    try:
        return estimate(cfg, sft_tokens=demo_tokens).problems()
    except (OSError, UnknownModelShape, StrategyArgError):  # refused (or not) at config load
        return []


def sync_tensors(cfg: TrainerConfig, shape: ModelShape) -> tuple[list[tuple[str, int]], str]:
    """``(name, bytes)`` of what each weight sync sends, and what that is."""
    lora = cfg.model.lora
    if lora is not None and lora.sync == "adapter":
        sizes = [
            (n, k * LORA_ADAPTER_BYTES)
            for n, k in shape.lora_tensors(lora.rank, lora.target_modules)
        ]
        return sizes, f"LoRA adapters (rank {lora.rank}, fp32)"
    # every strategy casts its fp32 master weights to the engines' dtype as it sends them
    e = DTYPE_BYTES[cfg.model.dtype]
    return [(n, k * e) for n, k in shape.tensors()], f"full weights ({cfg.model.dtype})"


def sync_buckets(cfg: TrainerConfig, shape: ModelShape) -> tuple[int, int, int, str]:
    """(bucket bytes, buckets per sync, bytes per sync, what is sent) of the weight sync."""
    from trainer.weights.buckets import plan_buckets
    from trainer.weights.errors import BucketTooSmallError
    from trainer.weights.sync import auto_bucket_bytes

    sizes, what = sync_tensors(cfg, shape)
    mb = cfg.weight_sync.bucket_mb
    bucket = int(mb * 2**20) if mb is not None else auto_bucket_bytes(sizes)
    try:
        count = len(plan_buckets(sizes, bucket))
    except BucketTooSmallError:
        count = 0  # reported by the bucket check (weight_sync.bucket_mb)
    return bucket, count, sum(n for _, n in sizes), what


def _add_sync_bucket(cfg: TrainerConfig, shape: ModelShape, roles: dict[str, RoleMemory]) -> None:
    """The trainer's rank 0 gathers each bucket on its device while the engines load it."""
    actor = roles.get("actor_train")
    if actor is None or not actor.devices:
        return
    bucket = sync_buckets(cfg, shape)[0]
    roles["actor_train"] = actor.with_part(Part("sync bucket", bucket, "work", "sync"))


# --------------------------------------------------------------------------- refusing


def _over_capacity(
    cfg: TrainerConfig, loads: tuple[DeviceLoad, ...], capacity: int, demos: str | None = None
) -> list[Problem]:
    """One problem per kind of device over capacity (devices alike are named together), naming
    the largest role there and the knobs to turn; ``demos``: how long the warm start's file
    demonstrations are (``sft_sequence_tokens``' note), where they size the ``sft`` phase."""
    found: dict[tuple[str, str], list[DeviceLoad]] = {}
    for load in loads:
        if load.total <= capacity:
            continue
        by_role: dict[str, int] = {}
        for role, part in load.parts:
            if role != "cuda":
                by_role[role] = by_role.get(role, 0) + part.nbytes
        culprit = max(by_role, key=by_role.__getitem__)
        parts = sorted(
            ((role, p) for role, p in load.parts if role != "cuda"), key=lambda rp: -rp[1].nbytes
        )
        biggest = ", ".join(f"{role} {p.name} {p.nbytes / GIB:.1f}" for role, p in parts[:3])
        cap = f"{capacity / GIB:g} GiB (cluster.device_memory_gib)"
        knobs = _knobs(cfg, culprit, [p for role, p in parts if role == culprit], load.phase)
        if demos is not None and load.phase == "sft":
            knobs.append(f"shorten or split the longest demonstrations ({demos})")
        message = (
            f"{load.total / GIB:.1f} GiB on {{devices}} in the {load.phase} phase > {cap} "
            f"({biggest} GiB); {'; '.join(knobs)}"
        )
        key = (f"roles.{culprit}.device_mapping", message)
        found.setdefault(key, []).append(load)
    problems = []
    for (path, message), alike in found.items():
        ids = [load.device for load in alike]
        devices = f"device {ids[0]}" if len(ids) == 1 else f"devices {id_ranges(ids)}"
        problems.append(Problem(path, message.format(devices=devices)))
    return problems


def _smaller_micro_batch(cfg: TrainerConfig, *, sft: bool = False) -> str | None:
    """The knob that makes a micro-batch hold fewer tokens (``sft``: the warm start's; None when
    one demonstration of ``sft.path`` is a micro-batch: only shorter ones help, which
    ``_over_capacity`` says with their length)."""
    train, rollout = cfg.train, cfg.rollout
    if train.micro_batch_tokens is not None:
        return f"lower train.micro_batch_tokens ({train.micro_batch_tokens})"
    if train.micro_batch_size > 1:
        size = train.micro_batch_size
        return f"lower train.micro_batch_size ({size}) or set train.micro_batch_tokens"
    if sft and cfg.sft.source == "file":
        return None
    return (
        f"shorter episodes (one is a micro-batch): rollout.max_turns ({rollout.max_turns}), "
        f"rollout.max_new_tokens ({rollout.max_new_tokens}) or rollout.context: last_k_turns"
    )


def _knobs(cfg: TrainerConfig, role: str, parts: list[Part], phase: str) -> list[str]:
    """What would shrink ``role``'s largest parts, most effective first."""
    config = getattr(cfg.roles, role)
    path = f"roles.{role}"
    knobs: list[str] = []
    for part in sorted(parts, key=lambda p: -p.nbytes)[:2]:
        if part.name in ("activations", "logits", "forward pass", "gathered blocks"):
            smaller = _smaller_micro_batch(cfg, sft=phase == "sft")
            knobs += [smaller] if smaller else []
            if (
                part.name == "activations"
                and config.strategy in ("fsdp2", "megatron")
                and not config.strategy_args.get("activation_checkpointing")
            ):
                knobs.append(f"set {path}.strategy_args.activation_checkpointing: true")
        elif (
            part.name in ("weights", "gradients", "optimizer", "adapters") and part.kind != "engine"
        ):
            if phase not in PHASE_ROLES or role in PHASE_ROLES[phase]:
                if role == "actor_train" and cfg.model.lora is None:
                    knobs.append("set model.lora (train adapters only)")
                knobs.append(f"use fsdp2 over more devices ({path}.device_mapping)")
                if config.strategy == "fsdp2":
                    knobs.append(f"set {path}.strategy_args.cpu_offload: true")
            else:
                flag = "offload_optimizer" if part.kind == "optimizer" else "offload_params"
                knobs.append(f"turn on {path}.{flag} (it stays resident in the {phase} phase)")
        elif part.name in ("kv cache", "prefill") and config.strategy == "hf":
            knobs.append("fewer episodes at once (env.num_groups) or rollout.engine: vllm")
        elif part.name == "kv cache":
            knobs.append(f"lower {path}.strategy_args.kv_cache_gib")
        elif part.kind == "engine":
            knobs.append(f"raise {path}.strategy_args.tensor_parallel_size")
            if not config.offload_params:
                knobs.append(f"turn on {path}.offload_params (the engine then sleeps)")
    return list(dict.fromkeys(knobs)) or [f"give {role} more devices"]
