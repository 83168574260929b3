"""Policy, value, KL and entropy losses, and how per-token losses become one number.

All per-token tensors are ``(B, T)`` and aligned with ``input_ids`` (see ``advantages.py``);
``response_mask`` selects the policy tokens. Each function returns the *per-token* loss so
that ``aggregate`` alone decides how tokens and sequences are weighted:

``token-mean``           sum(loss * mask) / sum(mask)          every token counts the same
``seq-mean-token-mean``  mean_i [ sum_t loss * mask / sum_t mask ]   every row the same
``seq-mean-token-sum``   mean_i [ sum_t loss * mask ]          long rows count more

A row is an episode, or with per-turn samples (``rollout.sample_unit: turn``) one turn of it:
then the ``seq-mean-*`` modes weigh every *turn* the same, so an episode of many turns weighs
more than one of a single turn (as it does under ``token-mean``).

The mean is over the whole *step* (every micro-batch, accumulation step and data-parallel
rank), not over one micro-batch: a strategy weighs each micro-batch's ``aggregate`` by its
share of the step's ``aggregation_units`` (tokens for ``token-mean``, sequences with at least
one response token for ``seq-mean-*``; ``trainer.strategies.distributed.micro_batch_scales``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_LOG_RATIO",
    "POLICY_LOSS_DEFAULTS",
    "AggregationMode",
    "KLEstimator",
    "PolicyLossKind",
    "aggregate",
    "aggregation_units",
    "entropy_from_logits",
    "gspo_departures",
    "gspo_loss",
    "kl_estimate",
    "policy_loss",
    "ppo_clip_loss",
    "value_loss",
]

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]
PolicyLossKind = Literal["ppo", "gspo"]

POLICY_LOSS_DEFAULTS: dict[PolicyLossKind, dict[str, Any]] = {
    "ppo": {"clip_low": 0.2, "clip_high": 0.2, "agg_mode": "token-mean"},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "agg_mode": "seq-mean-token-mean"},
}
"""Each policy loss's clip and aggregation where a config leaves them unset
(``algorithm.loss``): GSPO's are the paper's (Zheng et al., 2025), whose sequence ratio is the
geometric mean of the token ratios and stays within about 1e-3 of 1, and whose objective is a
mean over sequences."""


def gspo_departures(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, why)`` for each clip or aggregation in ``settings`` (what a user set) that GSPO
    does not expect: a clip >= 0.01 (it almost never fires on a sequence ratio, so the update
    is in effect unclipped), an aggregation other than ``seq-mean-token-mean``."""
    gspo = POLICY_LOSS_DEFAULTS["gspo"]
    departures = []
    for key in ("clip_low", "clip_high"):
        value = settings.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0.01:
            why = (
                "GSPO's sequence ratio stays within about 1e-3 of 1, so a clip this wide almost "
                f"never fires and the update is in effect unclipped (GSPO uses {gspo[key]:g}); "
                f"leave it unset, or override it with algorithm.loss.{key}=null"
            )
            departures.append((key, why))
    mode = settings.get("agg_mode")
    if mode is not None and mode != gspo["agg_mode"]:
        why = (
            "GSPO's objective is a mean over sequences (seq-mean-token-mean); another mode weighs "
            "sequences by their length, which GSPO's length-normalised ratio is there to undo; "
            "leave it unset, or override it with algorithm.loss.agg_mode=null"
        )
        departures.append(("agg_mode", why))
    return departures


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: AggregationMode = "token-mean"
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar (see the module docstring for modes)."""
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    per_seq_sum = (loss * mask).sum(dim=-1)
    has_tokens = (mask.sum(dim=-1) > 0).to(loss.dtype)
    seqs = has_tokens.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        return (per_seq_sum / mask.sum(dim=-1).clamp(min=1.0) * has_tokens).sum() / seqs
    if mode == "seq-mean-token-sum":
        return (per_seq_sum * has_tokens).sum() / seqs
    raise ValueError(
        f"unknown loss aggregation {mode!r}; use 'token-mean', 'seq-mean-token-mean' or "
        "'seq-mean-token-sum'"
    )


def aggregation_units(mask: torch.Tensor, mode: AggregationMode = "token-mean") -> torch.Tensor:
    """What ``aggregate`` averages over in ``mask`` (a 0-d float): response tokens for
    ``token-mean``, sequences with at least one response token for ``seq-mean-*``.

    A micro-batch's ``aggregate`` times its units, summed over the step and divided by the
    step's units, is the ``aggregate`` of the whole step: how strategies make the mean global.
    """
    mask = mask.float()
    if mode == "token-mean":
        return mask.sum()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return (mask.sum(dim=-1) > 0).float().sum()
    raise ValueError(
        f"unknown loss aggregation {mode!r}; use 'token-mean', 'seq-mean-token-mean' or "
        "'seq-mean-token-sum'"
    )


MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (as verl does): ``exp`` overflows
float32 above about 88.7 nats, and a token with advantage 0 (every token of a GRPO group whose
scores are all equal) would give ``0 * inf = NaN`` in the loss or its gradient, which stops
the run. Past the clamp a token has no gradient: for a positive advantage the clip had taken
it away long before; a negative-advantage token so far above its old probability (e^20 times)
is not pushed down by this step (without ``dual_clip``, PPO would push it, without bound)."""


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``, then, with
    ``dual_clip = c``, capped at ``-A * c`` where ``A < 0``; returns ``(loss, clipped)``."""
    import torch

    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or None, got {dual_clip!r}")
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).to(loss.dtype)
    if dual_clip is not None:
        capped = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, was_clipped


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, with asymmetric bounds and optional dual clip.

    ``ratio = exp(logprobs - old_logprobs)`` (the log-ratio clamped to ``MAX_LOG_RATIO``);
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``; with
    ``dual_clip = c > 1`` a negative-advantage token's loss is also capped at ``-A * c``
    (so a huge ratio on a bad action cannot blow up the update). Returns
    ``(per_token_loss, clipped)`` where ``clipped`` is 1.0 where the clip was active.
    """
    import torch

    log_ratio = torch.clamp(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return _clipped_surrogate(torch.exp(log_ratio), advantages, clip_low, clip_high, dual_clip)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: one importance ratio per sequence, the length-normalised likelihood ratio.

    ``s_i = exp(mean_{t in response} (logprobs - old_logprobs))`` (the mean clamped to
    ``MAX_LOG_RATIO``); per token the ratio is ``sg(s_i) * exp(logprobs_t - sg(logprobs_t))``
    (value ``s_i``, gradient per token), then clipped like PPO (dual clip included) with GSPO's
    much tighter default bounds. Returns ``(per_token_loss, clipped)``; aggregate it with
    ``seq-mean-token-mean`` (the GSPO objective: a mean over sequences).
    """
    import torch

    mask = response_mask.to(logprobs.dtype)
    log_ratio = ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    log_ratio = torch.clamp(log_ratio.detach(), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)[:, None] * torch.exp(logprobs - logprobs.detach())
    return _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)


def policy_loss(
    kind: PolicyLossKind,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ppo_clip_loss`` or ``gspo_loss`` by name; returns ``(per_token_loss, clipped)``."""
    if kind == "ppo":
        return ppo_clip_loss(logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip)
    if kind == "gspo":
        return gspo_loss(
            logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip
        )
    raise ValueError(f"unknown policy loss {kind!r}; use 'ppo' or 'gspo'")


K3_GAP, K3_MAX = 20.0, 10.0
"""k3's bounds: the log-ratio is clamped to +-``K3_GAP`` nats and the estimate to ``K3_MAX``
(verl's), so a token far from the reference (a policy that drifted, a reference in another
dtype) neither overflows nor dominates the loss; beyond them its gradient is 0."""


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3).

    ``k1 = logp - ref`` (unbiased); ``k2 = (logp - ref)^2 / 2`` (biased, low variance);
    ``k3 = exp(ref - logp) - (ref - logp) - 1`` (unbiased and always >= 0; bounded by
    ``K3_GAP``/``K3_MAX``). As a reward penalty each is an estimate of the KL. As a loss term
    (differentiated through ``logp``, tokens sampled from the policy) what matters is the
    expected gradient: k1's is 0 (``E[grad logp] = 0``: the term does nothing), k2's is the
    gradient of KL(policy || reference), k3's that of the forward KL(reference || policy).
    """
    import torch

    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff**2
    if kind == "k3":  # bounded as verl bounds it: exp() of a gap of ~89 nats is inf in fp32
        diff = diff.clamp(-K3_GAP, K3_GAP)
        return (torch.exp(-diff) + diff - 1.0).clamp(max=K3_MAX)
    raise ValueError(f"unknown KL estimator {kind!r}; use 'k1', 'k2' or 'k3'")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``."""
    import torch

    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None = 0.2
) -> torch.Tensor:
    """Clipped value loss per token: ``0.5 * max((V - R)^2, (V_clip - R)^2)``.

    ``V_clip = old_V + clip(V - old_V, -clip, clip)``; with ``clip=None`` just ``0.5 (V - R)^2``.
    """
    import torch

    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum(unclipped, (clipped_values - returns) ** 2)
