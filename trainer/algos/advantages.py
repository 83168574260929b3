"""Advantage estimators: GAE (with a critic), GRPO, GiGPO, Reinforce++ and RLOO.

Shapes and conventions (shared with ``losses.py``):

- ``response_mask``: ``(B, T)`` float, 1 where the *policy* wrote token ``t`` (the only
  tokens that are trained); env/tool/prompt tokens are 0. A multi-turn episode is one row.
- ``token_rewards``: ``(B, T)`` float, a turn's reward sits on the last policy token of that
  turn (``rollout.trajectory`` places them); 0 elsewhere.
- ``scores``: ``(B,)`` one scalar per episode (the episode return), used by the group
  estimators; ``group_ids``: ``(B,)`` long, episodes with the same id were sampled from the
  same task/seed and are compared with each other.

Every function returns ``advantages`` of shape ``(B, T)``, zero outside ``response_mask``.
Multi-turn GAE and Reinforce++ treat the policy tokens of a row as *the* time axis: env
tokens between turns are skipped (they are transitions of the environment, not actions).

Per-turn samples (``rollout.sample_unit: turn``): an episode is several rows, in the order of
its turns, with ``episode_ids`` (B,) naming the episode of each; ``token_rewards`` then hold
each row's own rewards (``collate`` puts the final reward on the episode's last row). Both
layouts credit a policy token alike: the group estimators count episodes, not rows, and a KL
penalty costs every row its episode's whole KL; for GAE and Reinforce++, ``later_returns``
puts on each row's last policy token the discounted return of the episode's later rows (``gamma``
per policy token, as across the turns of one row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    import torch

    from trainer.algos.losses import KLEstimator
    from trainer.config import AlgorithmConfig
    from trainer.controller.batch import Batch

__all__ = [
    "AdvantageEstimator",
    "KLPenalised",
    "batch_advantages",
    "compute_advantages",
    "gae",
    "gigpo",
    "grpo",
    "kl_penalised_rewards",
    "later_returns",
    "masked_whiten",
    "reinforce_plus_plus",
    "rloo",
]

AdvantageEstimator = Literal["gae", "gigpo", "grpo", "reinforce_plus_plus", "rloo"]

_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": "gae",
    "gigpo": "gigpo",
    "grpo": "grpo",
    "reinforce_pp": "reinforce_plus_plus",
    "rloo": "rloo",
}
"""``algorithm.advantage_estimator`` (the config's names) -> this module's."""


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / std`` over the masked entries (population std); 0 outside the mask."""
    import torch

    count = mask.sum().clamp(min=1.0)
    mean = (values * mask).sum() / count
    var = (((values - mean) ** 2) * mask).sum() / count
    return (values - mean) * torch.rsqrt(var + eps) * mask


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the policy tokens of each row.

    ``delta_t = r_t + gamma * V(next policy token) - V_t`` and
    ``A_t = delta_t + gamma * lam * A(next policy token)``; the value after the last policy
    token is 0 (the episode ended). Returns ``(advantages, returns)`` with
    ``returns = advantages + values``, both ``(B, T)`` and zero outside ``response_mask``.
    """
    import torch

    mask = response_mask.to(values.dtype)
    batch, length = values.shape
    advantages = torch.zeros_like(values)
    last_gae = values.new_zeros(batch)
    next_value = values.new_zeros(batch)
    for t in reversed(range(length)):
        on = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        current = delta + gamma * lam * last_gae
        advantages[:, t] = torch.where(on, current, torch.zeros_like(current))
        last_gae = torch.where(on, current, last_gae)
        next_value = torch.where(on, values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def _group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor, episode_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row (group mean, group population std, group size in episodes) of its group.

    With ``episode_ids`` (several rows per episode: per-turn samples) each row weighs
    ``1 / rows of its episode``, so every episode counts once."""
    import torch

    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    scores = scores.double()
    weight = torch.ones_like(scores)
    if episode_ids is not None and episode_ids.numel():
        _, episode = torch.unique(episode_ids, return_inverse=True)
        rows = torch.zeros(int(episode.max().item()) + 1, dtype=torch.float64)
        weight = 1.0 / rows.index_add_(0, episode, weight)[episode]
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, weight)
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, weight * scores)
    mean = total / count
    sq = torch.zeros(groups, dtype=torch.float64).index_add_(
        0, inverse, weight * (scores - mean[inverse]) ** 2
    )
    std = (sq / count).sqrt()
    return mean[inverse], std[inverse], count[inverse]


def grpo(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    eps: float = 1e-6,
    normalize_std: bool = True,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO: ``A_i = (s_i - mean_group) / (std_group + eps)`` on every policy token of row i.

    ``std`` is the population std of the group; with ``normalize_std=False`` only the mean
    is subtracted (Dr. GRPO). A group whose scores are all equal gets advantage 0. With
    ``episode_ids`` the group statistics are over episodes, not rows (per-turn samples).
    """
    mean, std, _ = _group_stats(scores, group_ids, episode_ids)
    centred = scores.double() - mean
    adv = centred / (std + eps) if normalize_std else centred
    return adv.to(response_mask.dtype)[:, None] * response_mask


def gigpo(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    state_ids: torch.Tensor,
    step_returns: torch.Tensor,
    episode_ids: torch.Tensor | None = None,
    step_weight: float = 1.0,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> torch.Tensor:
    """GiGPO (group-in-group; Feng et al., 2025): the episode's GRPO advantage plus
    ``step_weight`` times a step advantage, for per-turn samples (one row per turn).

    The step advantage compares turns that answered the same state: rows of one group whose
    ``state_ids`` are equal form an *anchor group*, and a row's ``step_returns`` (its turn's
    discounted return to the episode's end) is normalised within it,
    ``(R_t - mean) / (std + eps)``. A state only one turn saw gets 0 (no comparison), so where
    no state repeats GiGPO is GRPO. It credits the turn that made the difference: of episodes
    that reached the same state, the ones that went on well from there."""
    import torch

    episode = grpo(scores, group_ids, response_mask, eps, normalize_std, episode_ids)
    _, anchors = torch.unique(
        torch.stack([group_ids, state_ids], dim=1), dim=0, return_inverse=True
    )
    mean, std, count = _group_stats(step_returns, anchors)
    centred = step_returns.double() - mean
    step = centred / (std + eps) if normalize_std else centred
    step = torch.where(count > 1, step, torch.zeros_like(step))
    return episode + step_weight * step.to(response_mask.dtype)[:, None] * response_mask


def rloo(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """RLOO: ``A_i = s_i - mean_{j != i in group} s_j = n/(n-1) * (s_i - mean_group)``.

    A group of one episode has no baseline: its advantage is 0 (``n`` counts episodes).
    """
    import torch

    mean, _, count = _group_stats(scores, group_ids, episode_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1.0), torch.zeros_like(count))
    adv = scale * (scores.double() - mean)
    return adv.to(response_mask.dtype)[:, None] * response_mask


def reinforce_plus_plus(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    whiten: bool = True,
) -> torch.Tensor:
    """Reinforce++: discounted return-to-go over policy tokens, whitened over the whole batch.

    ``G_t = r_t + gamma * G(next policy token)``; with ``whiten`` the returns are normalised
    by the mean and std of all policy tokens in the batch (no critic, no groups).
    """
    import torch

    mask = response_mask.to(token_rewards.dtype)
    batch, length = token_rewards.shape
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(batch)
    for t in reversed(range(length)):
        on = mask[:, t] > 0
        current = token_rewards[:, t] + gamma * running
        running = torch.where(on, current, running)
        returns[:, t] = torch.where(on, current, torch.zeros_like(current))
    return masked_whiten(returns, mask) if whiten else returns


def later_returns(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    episode_ids: torch.Tensor,
    gamma: float = 1.0,
) -> torch.Tensor:
    """``token_rewards`` plus, on each row's last policy token, the return of the later rows of
    its episode: per-turn samples, credited as one row per episode would credit them.

    Rows of an episode (equal ``episode_ids``) must come in the order of its turns (``collate``
    keeps it). One row per episode would discount a later reward by ``gamma`` per policy token
    between them; so a row receives ``gamma * C``, where ``C`` is the discounted return from the
    first policy token of the next row on: ``C_k = sum_t gamma^t r_(k+1, t) + gamma^n C_(k+1)``
    over that row's ``n`` policy tokens. A row without policy tokens passes the return on.
    Reinforce++ (and GAE with ``lam = 1``) then give every policy token the advantage one row
    would; GAE with ``lam < 1`` credits a row's end with this return where one row would also
    bootstrap from the critic's values of the later tokens.
    Returns a new ``(B, T)`` tensor; with one row per episode, ``token_rewards`` unchanged.
    """
    import torch

    mask = response_mask > 0
    if not mask.any():
        return token_rewards.clone()
    rewards = token_rewards.double()
    position = mask.cumsum(-1) - 1  # per policy token: the policy tokens before it in the row
    discount = torch.where(mask, gamma ** position.clamp(min=0).double(), torch.zeros_like(rewards))
    own = (rewards * discount).sum(-1).tolist()  # each row's return from its first policy token
    lengths = mask.sum(-1).tolist()
    columns = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, columns, -1).max(-1).values.tolist()
    episodes = episode_ids.tolist()
    after: dict[int, float] = {}  # per episode: the return from the row after the current one
    credit = [0.0] * len(own)
    for r in reversed(range(len(own))):
        carried = after.get(episodes[r], 0.0)
        credit[r] = gamma * carried
        after[episodes[r]] = own[r] + gamma ** lengths[r] * carried
    out = token_rewards.clone()
    rows = [r for r in range(len(own)) if lengths[r] and credit[r]]
    if rows:
        received = torch.tensor([credit[r] for r in rows], dtype=out.dtype, device=out.device)
        out[rows, [last[r] for r in rows]] += received
    return out


class KLPenalised(NamedTuple):
    """What ``kl_penalised_rewards`` returns: new tensors, the KL taken off."""

    token_rewards: torch.Tensor
    scores: torch.Tensor
    step_returns: torch.Tensor | None
    """GiGPO's per-turn returns less ``kl_coef`` times the KL to go (``None`` if none given)."""


def kl_penalised_rewards(
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: KLEstimator = "k3",
    episode_ids: torch.Tensor | None = None,
    step_returns: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> KLPenalised:
    """``algorithm.loss.kl_mode: penalty``: the KL to the reference folded into the rewards.

    Per policy token ``r_t - kl_coef * KL_t`` (``losses.kl_estimate`` of the sampling log-probs
    against the reference's); each episode's score loses ``kl_coef * sum_t KL_t`` over all its
    policy tokens, so score-based estimators (GRPO, RLOO, GiGPO) see the same penalty as
    token-reward ones (GAE, Reinforce++). With ``episode_ids`` (per-turn samples) the sum runs
    over every row of the episode, and each of its rows' scores loses it whole; the KL of later
    rows reaches a row's tokens through ``later_returns``, as their rewards do, and GiGPO's
    ``step_returns`` (a turn's return to the episode's end, discounted by ``gamma`` per turn)
    lose the KL of their row and the later ones, discounted alike.
    """
    import torch

    from trainer.algos.losses import kl_estimate

    on = response_mask > 0  # (what masked positions hold may be far apart: exp() overflows)
    kl = kl_estimate(old_logprobs, torch.where(on, ref_logprobs, old_logprobs), estimator)
    kl = kl * response_mask
    rows = kl.sum(-1)
    total = rows
    if episode_ids is not None and episode_ids.numel():
        _, episode = torch.unique(episode_ids, return_inverse=True)
        per_episode = torch.zeros(int(episode.max()) + 1, dtype=rows.dtype, device=rows.device)
        total = per_episode.index_add_(0, episode, rows)[episode]
    if step_returns is not None:
        to_go = _to_go(rows, episode_ids, gamma) if episode_ids is not None else rows
        step_returns = step_returns - kl_coef * to_go.to(step_returns.dtype)
    return KLPenalised(
        token_rewards - kl_coef * kl, scores - kl_coef * total.to(scores.dtype), step_returns
    )


def _to_go(values: torch.Tensor, episode_ids: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per row, ``values`` of it and its episode's later rows, discounted by ``gamma`` per row
    (rows of an episode in the order of its turns)."""
    import torch

    out: list[float] = values.tolist()
    running: dict[int, float] = {}
    for row, episode in reversed(list(enumerate(episode_ids.tolist()))):
        out[row] += gamma * running.get(episode, 0.0)
        running[episode] = out[row]
    return torch.tensor(out, dtype=values.dtype, device=values.device)


def compute_advantages(
    estimator: AdvantageEstimator,
    *,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    normalize_std: bool = True,
    episode_ids: torch.Tensor | None = None,
    state_ids: torch.Tensor | None = None,
    step_returns: torch.Tensor | None = None,
    step_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch on ``estimator``; returns ``(advantages, returns)`` (returns only for GAE).

    ``episode_ids`` (rows of one episode: per-turn samples, in turn order) make the group
    estimators count episodes, not rows, and give GAE and Reinforce++ the later rows' returns
    (``later_returns``); ``state_ids`` and ``step_returns`` (``collate`` makes them for
    per-turn samples) are GiGPO's anchor states and turn returns. ``normalize_std=False`` is
    Dr. GRPO (grpo and gigpo)."""
    if estimator in ("gae", "reinforce_plus_plus") and episode_ids is not None:
        token_rewards = later_returns(token_rewards, response_mask, episode_ids, gamma)
    if estimator == "gae":
        if values is None:
            raise ValueError(
                "advantage estimator 'gae' needs critic values; enable the critic or pick grpo/rloo"
            )
        return gae(token_rewards, values, response_mask, gamma, lam)
    if estimator == "grpo":
        grouped = grpo(
            scores, group_ids, response_mask, normalize_std=normalize_std, episode_ids=episode_ids
        )
        return grouped, None
    if estimator == "gigpo":
        if state_ids is None or step_returns is None:
            raise ValueError(
                "advantage estimator 'gigpo' needs per-turn samples (state_ids, step_returns); "
                "set rollout.sample_unit: turn"
            )
        return gigpo(
            scores,
            group_ids,
            response_mask,
            state_ids,
            step_returns,
            episode_ids,
            step_weight,
            normalize_std=normalize_std,
        ), None
    if estimator == "rloo":
        return rloo(scores, group_ids, response_mask, episode_ids), None
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus(token_rewards, response_mask, gamma), None
    raise ValueError(
        f"unknown advantage estimator {estimator!r}; use one of 'gae', 'gigpo', 'grpo', "
        "'reinforce_plus_plus', 'rloo'"
    )


def batch_advantages(
    batch: Batch, algorithm: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(advantages, returns)`` of a collated batch as ``algorithm`` (the config's section)
    asks: the KL penalty folded in first (``kl_mode: penalty``), then ``compute_advantages``."""
    loss = algorithm.loss
    token_rewards, scores = batch["token_rewards"], batch["scores"]
    step_returns = batch.get("step_returns")
    if loss.kl_coef > 0 and loss.kl_mode == "penalty":
        token_rewards, scores, step_returns = kl_penalised_rewards(
            token_rewards,
            scores,
            batch["old_logprobs"],
            batch["ref_logprobs"],
            batch["response_mask"],
            loss.kl_coef,
            loss.kl_estimator,
            batch.get("episode_ids"),
            step_returns,
            algorithm.gamma,
        )
    return compute_advantages(
        _ESTIMATORS[algorithm.advantage_estimator],
        response_mask=batch["response_mask"],
        token_rewards=token_rewards,
        scores=scores,
        group_ids=batch["group_ids"],
        episode_ids=batch.get("episode_ids"),
        values=batch.get("values"),
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        normalize_std=algorithm.normalize_std,
        state_ids=batch.get("state_ids"),
        step_returns=step_returns,
        step_weight=algorithm.gigpo_step_weight,
    )
