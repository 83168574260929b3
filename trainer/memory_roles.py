"""What one role keeps on each of its devices: the per-role half of ``trainer.memory``.

Sizes come from the model's shape (``trainer.model_shape``) and the role's config; nothing is
loaded and torch is not imported. Each role is a list of :class:`Part` for its worst rank.

Training roles (``hf``, ``fsdp2``, ``megatron``)
    weights: fp32 master weights for a role that trains (``actor_train``, ``critic``: 4 bytes a
    parameter whatever ``model.dtype``; ``workers.strategy_worker.master_dtype``), ``model.dtype``
    for the frozen reference and a LoRA base that never trains (megatron builds fp32 either way);
    gradients and AdamW's two moments of the trainable parameters in their dtype, so fp32
    (``torch.optim.AdamW`` keeps moments like the parameter; LoRA adapters are fp32, peft's
    default); compute (activations) in ``model.dtype`` under fsdp2/megatron mixed precision or hf
    autocast on GPUs, else in the parameters' dtype; all sharded by the layout (fsdp2:
    everything over all ranks, block linears over tensor x data parallel; megatron: blocks
    over pipeline stages, linears over tensor parallel, the first stage holding every
    in-flight micro-batch); fsdp2's gathered blocks; and, while the role runs, one
    micro-batch's activations and logits (below).
Activations
    what one block saves for backward, tensor by tensor as HF runs it: RMSNorm's fp32 input,
    the normalised input when the norm weight trains, q / repeated k and v / output of SDPA,
    SwiGLU's three intermediates, each linear's input once per group of linears sharing it,
    LoRA's fp32 copy of an adapted linear's input and its rank-sized output, and the 4-D
    padding mask SDPA keeps per layer. With activation checkpointing: each block's input and
    one block's activations. The tests check this against the tensors torch saves.
Logits
    tokens x vocab x ``LOGITS_TRAIN_BYTES`` for a policy-loss step with an entropy bonus
    (logits, their fp32 copy, log-softmax, the entropy's softmax, and their gradients),
    ``LOGITS_TRAIN_METRIC_BYTES`` when the entropy is only a metric (no gradient through it),
    ``LOGITS_FORWARD_BYTES`` for a pass without gradients; all measured
    (``tests/trainer/test_memory.py``).
Engines
    ``vllm``: weights / tensor_parallel_size, the KV cache it is given (``kv_cache_gib``, 1 GiB
    unless set; with ``kv_cache_gib: null``, ``gpu_memory_utilization`` x capacity for the whole
    engine) and a runtime workspace (a step's activations, the sampler's logits, CUDA graphs);
    it sleeps (frees all of it) when offloaded. ``hf``: its weights (never released) and, while
    generating, the KV cache and prefill of every episode at once (an episode's KV is running
    or kept for its next turn, not both: the kept ones are part of that figure).

A micro-batch is ``train.micro_batch_size`` rows of the longest sequence a rollout can make
(``PROMPT_TOKENS`` + turns x (``rollout.max_new_tokens`` + ``ENV_TOKENS_PER_TURN``), at most the
model's context), or ``train.micro_batch_tokens`` tokens (a longer row is its own micro-batch).
The warm start's (``sft`` work) are rows of its longest demonstration: for ``sft.source: file``
the file's (``sft_sequence_tokens``), for expert demonstrations a rollout's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from trainer.errors import Problem
from trainer.model_shape import ModelShape, lora_matches
from trainer.strategies.vllm_platform import scheduler_limits

if TYPE_CHECKING:
    from trainer.config import RoleConfig, TrainerConfig

__all__ = [
    "DTYPE_BYTES",
    "ENV_TOKENS_PER_TURN",
    "GIB",
    "LOGITS_FORWARD_BYTES",
    "LOGITS_TRAIN_BYTES",
    "LOGITS_TRAIN_METRIC_BYTES",
    "LORA_ADAPTER_BYTES",
    "PROMPT_TOKENS",
    "Part",
    "RoleMemory",
    "StrategyArgError",
    "block_activation_bytes",
    "engine_role",
    "micro_batch",
    "sequence_tokens",
    "sft_sequence_tokens",
    "train_role",
]

GIB = 2**30
PROMPT_TOKENS = 512
"""Tokens assumed for an episode's opening messages (system prompt, task, tool schemas)."""
ENV_TOKENS_PER_TURN = 64
"""Tokens assumed for one env reply and its chat-template framing (a Sokoban board is ~50)."""
LOGITS_TRAIN_BYTES = 34
"""Peak bytes per token per vocabulary entry of a policy-loss step with an entropy bonus
(``algorithm.loss.entropy_coef > 0``): logits, their fp32 copy, log-softmax, the entropy's
softmax and their gradients (33.3 measured in bf16, 32.5 in fp32)."""
LOGITS_TRAIN_METRIC_BYTES = 22
"""The same when the entropy is computed as a metric only (``entropy_coef: 0``): no gradient
goes through it, but the forward pass holds the logits, their fp32 copy, log-softmax, softmax
and product at once (20.9 measured in bf16, 20.2 in fp32; 18.1 and 16.1 in a whole model's step)."""
LOGITS_FORWARD_BYTES = 14
"""The same for a pass without gradients (reference, old log-probs): 11.7-13.1 measured."""
LORA_ADAPTER_BYTES = 4
"""peft keeps adapters in fp32 over a bf16/fp16 base (``autocast_adapter_dtype=True``)."""
VLLM_KV_CACHE_GIB = 1.0
"""``VLLMEngine``'s KV cache when ``strategy_args`` do not set ``kv_cache_gib``."""
VLLM_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of the device when it sizes the KV cache itself."""
(VLLM_BATCHED_TOKENS, VLLM_MAX_SEQS), CUDA_GRAPHS_GIB = scheduler_limits(), 0.5
"""The scheduler limits ``VLLMEngine`` runs with (tokens per step, sequences per step:
``vllm_platform.scheduler_limits``) and vLLM's CUDA-graph pool."""
HF_ENGINE_MAX_BATCH = 512
"""``HFEngine``'s largest generation batch."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class StrategyArgError(ValueError):
    """A ``strategy_args`` value the estimate needs is not a number; ``path`` is its key."""

    def __init__(self, path: str, value: Any) -> None:
        self.path = path
        super().__init__(f"{value!r} is not a number; give a number or remove the key")


def _number(role: str, args: Mapping[str, Any], key: str, default: float | None) -> Any:
    """``args[key]`` (``default`` when absent) as a number, or None when it is None."""
    value = args.get(key, default)
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    raise StrategyArgError(f"roles.{role}.strategy_args.{key}", value)


Kind = Literal["params", "optimizer", "engine", "work", "fixed"]
Work = Literal["train", "sft", "forward", "generate", "sync"]


@dataclass(frozen=True)
class Part:
    """One component of a role's memory on one device."""

    name: str
    """``weights``, ``gradients``, ``optimizer``, ``activations``, ``logits``, ``kv cache``, ..."""
    nbytes: int
    kind: Kind
    """``params``/``optimizer``: leave with ``offload_params``/``offload_optimizer``; ``engine``:
    leaves when the engine sleeps; ``work``: exists only during ``work``; ``fixed``: always."""
    work: Work | None = None
    trained: bool = False
    """Exists only once the role has trained a step (gradients, optimizer moments)."""


@dataclass(frozen=True)
class RoleMemory:
    """What one role keeps on each of its devices (its worst rank)."""

    role: str
    strategy: str
    layout: str
    """How the role is laid out, e.g. ``fsdp2 dp=8``, ``megatron tp=2 pp=2 dp=2``, ``vllm tp=1``."""
    devices: tuple[int, ...]
    parts: tuple[Part, ...]
    config: RoleConfig
    notes: tuple[str, ...] = ()

    def with_part(self, part: Part) -> RoleMemory:
        """This role with one more part."""
        return RoleMemory(
            self.role,
            self.strategy,
            self.layout,
            self.devices,
            (*self.parts, part),
            self.config,
            self.notes,
        )


# --------------------------------------------------------------------------- tokens


def sequence_tokens(cfg: TrainerConfig, shape: ModelShape) -> tuple[int, str]:
    """The longest training row a rollout can make, and how it was found."""
    rollout = cfg.rollout
    turns = rollout.max_turns
    if rollout.context == "last_k_turns":
        turns = min(turns, rollout.context_turns + 1)
    tokens = PROMPT_TOKENS + turns * (rollout.max_new_tokens + ENV_TOKENS_PER_TURN)
    note = (
        f"{PROMPT_TOKENS} prompt + {turns} turns x ({rollout.max_new_tokens} generated + "
        f"{ENV_TOKENS_PER_TURN} env) = {tokens}"
    )
    limit, what = _context(cfg, shape)
    if tokens > limit:
        return limit, f"{note}, capped at {what} {limit}"
    return tokens, note


def sft_sequence_tokens(
    cfg: TrainerConfig, shape: ModelShape, demo_tokens: int | None = None
) -> tuple[int, str]:
    """The longest row the warm start trains, and how it was found: expert demonstrations are
    played as rollouts are (``sequence_tokens``); a file's (``sft.source: file``) is its longest
    demonstration as the tokenizer counts it, ``demo_tokens`` (the run, before any worker
    starts: ``trainer.sft.load_demo_file``), at most the model's context. Before it is counted
    (config load, ``--dry-run``) the rollouts' bound stands: a line's bytes are no token count
    (keys the loader ignores, JSON escapes and turns ``rollout.context`` leaves out are never
    trained), and refusing on them refused files that fit."""
    rollouts = sequence_tokens(cfg, shape)
    if cfg.sft.epochs == 0 or cfg.sft.source != "file" or cfg.sft.path is None:
        return rollouts
    if demo_tokens is None:
        return rollouts[0], f"{rollouts[1]}; sft.path's rows are counted as the run starts"
    tokens, note = demo_tokens, f"sft.path's longest demonstration: {demo_tokens} tokens"
    limit, what = _context(cfg, shape)
    if tokens > limit:
        return limit, f"{note}, capped at {what} {limit}"
    return tokens, note


def _context(cfg: TrainerConfig, shape: ModelShape) -> tuple[int, str]:
    """The longest sequence the run takes: the vLLM engine's ``max_model_len`` where set, else
    the model's context."""
    infer = cfg.roles.actor_infer
    engine_limit = (
        _number("actor_infer", infer.strategy_args, "max_model_len", None)
        if infer.strategy == "vllm"
        else None
    )
    if engine_limit and int(engine_limit) < shape.max_positions:
        return int(engine_limit), "the engine's max_model_len"
    return shape.max_positions, "the model's"


def micro_batch(cfg: TrainerConfig, seq: int) -> tuple[int, int]:
    """(tokens, row width) of the largest micro-batch when sequences are ``seq`` tokens at most.
    Rows are ``seq`` wide packed or not: a packed row is as wide as the longest sequence packed
    into it (``packing._pack``), not the token budget, so packing fills the same budget with
    fewer padding tokens at the same cost."""
    train = cfg.train
    if train.micro_batch_tokens is not None:
        return max(train.micro_batch_tokens, seq), seq
    return train.micro_batch_size * seq, seq


def block_activation_bytes(
    shape: ModelShape, compute_bytes: int, *, row_width: int, lora: Any = None, tp: int = 1
) -> float:
    """Bytes one block saves for backward per token (see the module docstring) on one of ``tp``
    tensor-parallel ranks, for rows ``row_width`` tokens wide; ``lora`` (a ``LoraConfig``)
    freezes the base."""
    a, h = compute_bytes, shape.hidden_size
    q, i = shape.q_dim / tp, shape.intermediate_size / tp
    if shape.model_type == "gpt2":
        norms = 2 * (a * h + 4)  # LayerNorm: input, mean and rstd
        attention = 6 * a * q  # fused qkv, q and v copies, output
        mlp = 4 * a * i  # c_fc output and GELU's intermediates
        norm_weights = 0.0
    else:
        norms = 2 * (4 * h + 4)  # RMSNorm: fp32 input and rsqrt
        attention = 4 * a * q  # q, repeated k and v, output
        mlp = 3 * a * i  # gate output, SiLU output, up output
        norm_weights = 2 * a * h  # the normalised inputs, saved when the norm weights train
    total = norms + attention + mlp + 4 * shape.num_heads / tp + a * row_width
    if lora is None:
        total += norm_weights
    group_size = {"attn_in": h, "attn_out": q, "mlp_in": h, "mlp_mid": i}
    for group, size in group_size.items():
        saved = group == "attn_out"  # the attention's output, saved by SDPA already
        if lora is None:
            total += 0 if saved else a * size
            continue
        members = [lin for lin in shape.linears if lin.input_group == group]
        adapted = [lin for lin in members if lora_matches(lin.name, lora.target_modules)]
        total += len(adapted) * lora.rank * LORA_ADAPTER_BYTES  # lora_A's output
        if adapted and LORA_ADAPTER_BYTES == a:
            total += 0 if saved else a * size
        else:  # each adapter casts its input to fp32
            total += len(adapted) * LORA_ADAPTER_BYTES * size
    return total


# --------------------------------------------------------------------------- training roles


@dataclass(frozen=True)
class _Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @classmethod
    def of(cls, role: RoleConfig) -> _Layout:
        args, strategy = role.strategy_args, role.strategy
        # (checked to be positive integers by ``registry.layout_problem`` before this runs)
        tp = int(args.get("tensor_parallel_size", 1)) if strategy in ("fsdp2", "megatron") else 1
        pp = int(args.get("pipeline_parallel_size", 1)) if strategy == "megatron" else 1
        return cls(tp, pp, max(1, role.world_size // max(1, tp * pp)))

    def describe(self, strategy: str) -> str:
        if strategy == "megatron":
            return f"megatron tp={self.tp} pp={self.pp} dp={self.dp}"
        if strategy == "fsdp2":
            return f"fsdp2 dp={self.dp}" + (f" tp={self.tp}" if self.tp > 1 else "")
        return strategy if self.dp == 1 else f"{strategy} x{self.dp}"

    def params_per_rank(self, shape: ModelShape, strategy: str) -> float:
        """Parameters the worst rank stores."""
        linear = shape.block_linear_params
        block = shape.block_params - linear + linear / self.tp
        if strategy == "fsdp2":
            return (shape.num_params - shape.num_layers * linear * (1 - 1 / self.tp)) / self.dp
        if strategy == "megatron":
            stage = math.ceil(shape.num_layers / self.pp) * block
            embedding = shape.embedding_params / self.tp
            if self.pp == 1:
                return stage + embedding + shape.head_params / self.tp
            head = (shape.head_params or shape.embedding_params) / self.tp  # tied: a copy
            return stage + max(embedding, head)  # the first stage or the last one
        return float(shape.num_params)

    def gathered(self, shape: ModelShape, a: int, store: int, args: Mapping[str, Any]) -> float:
        """Unsharded parameters fsdp2 holds while it runs: the root (embeddings, head) and two
        blocks (running and prefetched; every block with ``reshard_after_forward: false``), and
        one block's unsharded gradients."""
        block = shape.block_params / self.tp
        blocks = shape.num_layers if args.get("reshard_after_forward") is False else 2
        root = shape.num_params - shape.num_layers * shape.block_params
        return (root + blocks * block) * a + block * store


def train_role(
    name: str,
    role: RoleConfig,
    cfg: TrainerConfig,
    shape: ModelShape,
    *,
    on_gpu: bool,
    sft_seq: int | None = None,
) -> RoleMemory:
    """What ``actor_train``, ``critic`` or ``reference`` (frozen) keeps on one device;
    ``sft_seq``: the warm start's longest row (``sft_sequence_tokens``; None: the rollouts')."""
    strategy, args, layout = role.strategy or "hf", role.strategy_args, _Layout.of(role)
    lora = cfg.model.lora if name == "actor_train" else None
    trainable = name != "reference"
    full_warm_start = lora is not None and lora.warm_start == "full" and cfg.sft.epochs > 0
    frozen = not trainable or (lora is not None and not full_warm_start)  # (the LoRA base)
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    store = 4 if strategy == "megatron" or not frozen else dtype_bytes  # fp32 master weights
    mixed = strategy in ("fsdp2", "megatron") and bool(args.get("mixed_precision", on_gpu))
    autocast = strategy == "hf" and on_gpu and trainable  # (the hf strategy on CUDA)
    a = 2 if mixed else dtype_bytes if autocast else store
    on_device = 0.0 if strategy == "fsdp2" and args.get("cpu_offload") else 1.0
    params = layout.params_per_rank(shape, strategy)
    notes: list[str] = []
    if trainable and store == 4 and dtype_bytes < 4:
        notes.append(f"fp32 master weights, {cfg.model.dtype} compute")
    parts = [Part("weights", int(params * store * on_device), "params")]
    if trainable:
        trained, trained_bytes = params, store
        if lora is not None:
            adapters = shape.lora_params(lora.rank, lora.target_modules) / (layout.tp * layout.dp)
            parts.append(Part("adapters", int(adapters * LORA_ADAPTER_BYTES * on_device), "params"))
            notes.append(f"LoRA rank {lora.rank}: {adapters * layout.tp * layout.dp:,.0f} trained")
            if full_warm_start:  # every weight trains until the warm start is folded
                notes.append("full warm start: gradients and moments of every weight in sft")
            else:
                trained, trained_bytes = adapters, LORA_ADAPTER_BYTES
        each = trained * trained_bytes * on_device
        parts.append(Part("gradients", int(each), "params", trained=True))
        parts.append(Part("optimizer", int(2 * each), "optimizer", trained=True))
    elif cfg.model.lora is not None:
        notes.append("counted as a full copy (with LoRA it may be the base, adapters off)")
    tokens, width = micro_batch(cfg, sequence_tokens(cfg, shape)[0])
    # 1F1B: the first pipeline stage holds as many micro-batches as there are stages
    layers = math.ceil(shape.num_layers / layout.pp) * layout.pp
    checkpointing = bool(args.get("activation_checkpointing"))
    if checkpointing:
        notes.append("activation checkpointing")

    def saved_for(tokens: int, width: int) -> float:
        """Activations saved for backward by a micro-batch of ``tokens`` in rows ``width`` wide."""
        per_block = block_activation_bytes(shape, a, row_width=width, lora=lora, tp=layout.tp)
        if checkpointing:
            saved = (layers * a * shape.hidden_size + per_block) * tokens
        else:
            saved = layers * per_block * tokens
        return saved + (4 + 2 * a) * shape.hidden_size * tokens  # the final norm

    saved = saved_for(tokens, width)
    works: list[Work] = ["forward"]
    if trainable:
        works += ["train", "sft"] if name == "actor_train" else ["train"]
        parts.append(Part("activations", int(saved), "work", "train"))
        if name == "critic":  # the LM's logits and hidden states, until the value head has run
            lm = a * shape.vocab_size + (shape.num_layers + 1) * a * shape.hidden_size
            parts.append(Part("logits", int(tokens * lm), "work", "train"))
        else:
            bonus = cfg.algorithm.loss.entropy_coef > 0
            per_entry = LOGITS_TRAIN_BYTES if bonus else LOGITS_TRAIN_METRIC_BYTES
            logits = tokens * shape.vocab_size * per_entry
            parts.append(Part("logits", int(logits), "work", "train"))
            # the warm start's rows: its demonstrations' (sft_sequence_tokens), not the rollouts'
            sft_tokens, sft_width = micro_batch(cfg, sft_seq) if sft_seq else (tokens, width)
            parts.append(Part("activations", int(saved_for(sft_tokens, sft_width)), "work", "sft"))
            sft = sft_tokens * shape.vocab_size * LOGITS_FORWARD_BYTES  # no entropy in SFT
            parts.append(Part("logits", int(sft), "work", "sft"))
    one_layer = 2 * shape.hidden_size + (4 * shape.q_dim + 3 * shape.intermediate_size) / layout.tp
    forward = tokens * (LOGITS_FORWARD_BYTES * shape.vocab_size + a * (one_layer + width))
    parts.append(Part("forward pass", int(forward), "work", "forward"))
    if strategy == "fsdp2":
        gathered = int(layout.gathered(shape, a, store, args))
        parts += [Part("gathered blocks", gathered, "work", work) for work in works]
    return RoleMemory(
        name,
        strategy,
        layout.describe(strategy),
        tuple(role.device_mapping),
        tuple(parts),
        role,
        tuple(notes),
    )


# --------------------------------------------------------------------------- engines


def engine_role(
    role: RoleConfig, cfg: TrainerConfig, shape: ModelShape, *, on_gpu: bool, capacity: int | None
) -> tuple[RoleMemory, list[Problem]]:
    """What ``actor_infer`` keeps on one device, and a vLLM KV cache too small to start."""
    strategy = role.strategy or "hf"
    seq = sequence_tokens(cfg, shape)[0]
    if strategy == "vllm":
        parts, notes, problems, layout = _vllm(role, cfg, shape, seq, on_gpu, capacity)
    else:
        e = DTYPE_BYTES[cfg.model.dtype]
        episodes = max(cfg.batch_size, cfg.eval.episodes) * cfg.rollout.redundancy
        rows = min(HF_ENGINE_MAX_BATCH, math.ceil(episodes / max(1, role.world_size)))
        one_layer = 2 * shape.hidden_size + 2 * shape.q_dim + 3 * shape.intermediate_size
        prefill = rows * seq * e * (one_layer + seq) + rows * shape.vocab_size * 12
        parts = [
            Part("weights", shape.num_params * e, "fixed"),  # HFEngine.sleep() keeps them
            Part("kv cache", rows * seq * shape.kv_bytes_per_token(e), "work", "generate"),
            Part("prefill", int(prefill), "work", "generate"),
        ]
        notes, problems = [f"{rows} episodes generate at once"], []
        layout = "hf" if role.world_size == 1 else f"hf x{role.world_size}"
    memory = RoleMemory(
        "actor_infer",
        strategy,
        layout,
        tuple(role.device_mapping),
        tuple(parts),
        role,
        tuple(notes),
    )
    return memory, problems


def _vllm(
    role: RoleConfig,
    cfg: TrainerConfig,
    shape: ModelShape,
    seq: int,
    on_gpu: bool,
    capacity: int | None,
) -> tuple[list[Part], list[str], list[Problem], str]:
    args, e = role.strategy_args, DTYPE_BYTES[cfg.model.dtype]
    tp = int(_number("actor_infer", args, "tensor_parallel_size", 1) or 1)
    weights = shape.num_params * e / tp
    kv_heads = max(1, shape.num_kv_heads // tp)  # fewer KV heads than ranks: replicated
    kv_per_token = shape.kv_bytes_per_token(e) * kv_heads / shape.num_kv_heads
    one_layer = 2 * shape.hidden_size + (4 * shape.q_dim + 3 * shape.intermediate_size) / tp
    step_tokens = _number("actor_infer", args, "max_num_batched_tokens", VLLM_BATCHED_TOKENS)
    runtime = int(step_tokens or VLLM_BATCHED_TOKENS) * e * one_layer
    sequences = _number("actor_infer", args, "max_num_seqs", VLLM_MAX_SEQS)
    runtime += int(sequences or VLLM_MAX_SEQS) * shape.vocab_size * 12
    if on_gpu and not args.get("enforce_eager", False):
        runtime += CUDA_GRAPHS_GIB * GIB
    notes = []
    kv_gib = _number("actor_infer", args, "kv_cache_gib", VLLM_KV_CACHE_GIB)
    if kv_gib is None:
        share = _number("actor_infer", args, "gpu_memory_utilization", None)
        share = VLLM_GPU_MEMORY_UTILIZATION if share is None else float(share)
        kv = max(0.0, share * (capacity or 0) - weights - runtime)
        notes.append(f"gpu_memory_utilization {share:g} of the device")
    else:
        kv = float(kv_gib) * GIB
    tokens = int(kv // kv_per_token)
    notes.append(f"KV cache {tokens:,} tokens: {tokens // max(seq, 1):,} longest episodes at once")
    problems = []
    max_model_len = int(_number("actor_infer", args, "max_model_len", None) or shape.max_positions)
    if tokens < max_model_len:
        needed = math.ceil(max_model_len * kv_per_token / GIB * 100) / 100
        key = "kv_cache_gib" if kv_gib is not None else "gpu_memory_utilization"
        problems.append(
            Problem(
                f"roles.actor_infer.strategy_args.{key}",
                f"the KV cache holds {tokens:,} tokens, fewer than one request of max_model_len "
                f"{max_model_len:,} (vLLM refuses to start); set kv_cache_gib >= {needed:g} or "
                f"strategy_args.max_model_len <= {tokens:,}",
            )
        )
    parts = [
        Part("weights", int(weights), "engine"),
        Part("kv cache", int(kv), "engine"),
        Part("runtime", int(runtime), "engine"),
    ]
    return parts, notes, problems, f"vllm tp={tp}"
