"""How ``VLLMEngine`` turns a ``GenerationRequest`` into vLLM ``SamplingParams``, and which
requests it refuses first.

A request the engine cannot serve fails alone, at once, with the message ``HFEngine`` gives
(``decode_batch.request_error``: no prompt, ``max_new_tokens < 1``, ``top_p`` outside (0, 1],
a negative or NaN ``temperature``, a token id outside the vocabulary, a prompt that fills the
context): vLLM's own ``SamplingParams`` check would raise on the engine thread, where no
caller waits, and a negative temperature would be served greedily.

Log-probs with ``top_p < 1``: vLLM 0.32's ``logprobs_mode`` offers the raw log-probs
(``log_softmax(logits)``, before temperature) or the processed ones (after temperature *and*
top-k/top-p, renormalised over the nucleus); none is ``log_softmax(logits / T)`` over the
whole vocabulary, which ``HFEngine`` reports. The engine uses ``processed_logprobs``, exact at
``top_p=1``; with ``top_p < 1`` a token's reported log-prob is higher by ``-log(nucleus
mass)``. The PPO ratio is not affected: whenever ``rollout.top_p`` is not 1 the pipeline
recomputes ``old_logprobs`` with the actor (full-vocabulary log-probs at ``rollout.temperature``:
``AgenticPipeline.reference_logprobs``) and the async importance weights are skipped, so the
ratio compares the trainer's own log-probs. What differs is what callers read from
``GenerationResult.logprobs`` (the rollout proxy's ``logprobs`` too): :func:`warn_top_p` says so
once per engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from trainer.strategies.base import GenerationRequest
from trainer.strategies.decode_batch import request_error

__all__ = ["request_error", "sampling_params", "warn_top_p"]

_log = logging.getLogger(__name__)


def sampling_params(
    make: Any, request: GenerationRequest, *, seed: int, eos: Iterable[int], delta: Any
) -> Any:
    """vLLM ``SamplingParams`` (``make``) for a checked ``request``: one sample, the sampled
    token's log-prob, ids only (no detokenising), delivered as deltas; it stops on ``eos``
    (the tokenizer's and the model's generation-config EOS ids: ``model_eos``) and on the
    request's ``stop_token_ids``."""
    greedy = request.temperature == 0
    return make(
        n=1,
        max_tokens=request.max_new_tokens,
        temperature=0.0 if greedy else request.temperature,
        top_p=request.top_p,
        seed=None if greedy else seed,
        logprobs=0,
        stop_token_ids=sorted({*eos, *request.stop_token_ids}),
        detokenize=False,
        skip_special_tokens=False,
        output_kind=delta,
    )


def warn_top_p(request: GenerationRequest, warned: bool) -> bool:
    """Warn (once: ``warned`` says whether it was) when ``request`` samples with ``top_p < 1``;
    returns whether the warning has been given now."""
    if warned or request.top_p >= 1 or request.temperature == 0:
        return warned
    _log.warning(
        "vLLM reports log-probs renormalised over the top_p=%g nucleus (HFEngine reports "
        "log_softmax(logits / temperature) over the whole vocabulary), higher by -log(nucleus "
        "mass). PPO is not affected (the trainer recomputes old log-probs when top_p != 1); "
        "GenerationResult.logprobs and the rollout proxy's logprobs are. Use top_p=1 for "
        "log-probs that match across engines",
        request.top_p,
    )
    return True
