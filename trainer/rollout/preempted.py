"""A generation preempted by a weight update, in parts (``EngineRouter.update_weights_live``).

The router aborts every generation in flight before it loads new weights, and, once they are
loaded, sends each on as a new *part*: the same request with the tokens it has so far appended
to its prompt and the rest of its budget (``resumed_part``). When the generation ends, its
parts are one result again (``joined_result``), each token with the policy version of the part
that generated it.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.strategies.base import FinishReason, GenerationRequest, GenerationResult

__all__ = ["joined_result", "resumed_part"]


def joined_result(
    request_id: str,
    parts: Sequence[tuple[GenerationResult, int]],
    reason: FinishReason,
    version: int,
) -> GenerationResult:
    """One result of a generation over its ``parts`` (each an engine's result and the version
    it was issued under), with per-token versions in ``extra["token_versions"]``; ``version``
    when it never reached an engine (aborted first)."""
    versions = [v for r, v in parts for _ in r.token_ids]
    return GenerationResult(
        request_id,
        [t for r, _ in parts for t in r.token_ids],
        [p for r, _ in parts for p in r.logprobs],
        reason,
        versions[-1] if versions else version,
        {"token_versions": versions},
    )


def resumed_part(request: GenerationRequest, part: int, ids: list[int]) -> GenerationRequest:
    """Part ``part`` of a preempted ``request``: its prompt plus the ``ids`` generated so far,
    with the rest of its token budget."""
    return GenerationRequest(
        f"{request.request_id}.{part}",
        request.prompt_ids + ids,
        request.max_new_tokens - len(ids),
        request.temperature,
        request.top_p,
        request.stop_token_ids,
    )
