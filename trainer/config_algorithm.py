"""The ``algorithm`` section: advantage estimation and the policy loss (``algorithm.loss``).

Split from ``trainer.config`` (which re-exports both classes); the maths these fields select
is in ``trainer.algos``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, model_validator

from trainer.config_section import Section
from trainer.errors import ConfigError, Problem

_log = logging.getLogger(__name__)

__all__ = ["AlgorithmConfig", "LossConfig"]


class LossConfig(Section):
    """The policy loss: PPO clipping, GSPO, KL to the reference, entropy, aggregation.

    ``clip_low``, ``clip_high`` and ``agg_mode`` left unset (or null) take the algorithm's
    defaults: PPO's (0.2, 0.2, ``token-mean``: the declared defaults), or with ``gspo`` GSPO's
    (3e-4, 4e-4, ``seq-mean-token-mean``), resolved as the section is built, so every reader
    (the actor's loss, the strategies' aggregation) sees the values that run."""

    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """Lower clip: ratios below ``1 - clip_low`` stop contributing gradient. Unset: 0.2, or 3e-4
    with ``gspo`` (its sequence ratio stays within about 1e-3 of 1, so a PPO-sized clip would
    never fire: a value >= 0.01 with ``gspo`` loads with a warning)."""
    clip_high: float = Field(default=0.2, ge=0)
    """Upper clip: ratios above ``1 + clip_high`` (asymmetric, e.g. 0.28, is allowed). Unset:
    0.2, or 4e-4 with ``gspo`` (>= 0.01 with ``gspo`` warns, as for ``clip_low``)."""
    dual_clip: float | None = Field(default=None, gt=1)
    """Dual-clip constant c > 1 bounding the loss for negative advantages (PPO and GSPO alike);
    None disables."""
    gspo: bool = False
    """Use a sequence-level importance ratio (GSPO, Zheng et al., 2025) instead of per-token
    ratios; the unset clip and aggregation become GSPO's (see the section)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL to the reference policy; 0 disables the reference role."""
    kl_mode: Literal["penalty", "loss"] = "loss"
    """``penalty``: KL off the rewards (grpo's std then cancels kl_coef); ``loss``: a loss term."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator per token (Schulman's k1, k2, k3; ``trainer.algos.losses.kl_estimate``). As a
    reward penalty each estimates KL(policy || reference) (k1, k3 unbiased). As a loss term its
    gradient is what counts: k2's follows KL(policy || reference), k3's the forward
    KL(reference || policy), and k1's is zero in expectation, so ``k1`` with ``kl_mode: loss``
    and ``kl_coef > 0`` is refused."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus."""
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses are reduced over the batch (``trainer.algos.losses``): per row with
    per-turn samples. Unset: ``token-mean``, or ``seq-mean-token-mean`` with ``gspo`` (GSPO's
    objective is a mean over sequences; another mode with ``gspo`` warns)."""

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """Unset (or null) clip and aggregation take the algorithm's defaults; set ones that GSPO
        does not expect are warned about (``losses.gspo_departures``), and kept."""
        from pydantic import TypeAdapter, ValidationError

        from trainer.algos.losses import POLICY_LOSS_DEFAULTS, gspo_departures

        if not isinstance(data, dict):
            return data
        try:
            gspo = TypeAdapter(bool).validate_python(data.get("gspo", False))
        except ValidationError:  # the field's own validation reports it
            return data
        for key, why in gspo_departures(data) if gspo else ():
            _log.warning("algorithm.loss.%s=%s with algorithm.loss.gspo: %s", key, data[key], why)
        defaults = POLICY_LOSS_DEFAULTS["gspo" if gspo else "ppo"]
        return {**data, **{k: v for k, v in defaults.items() if data.get(k) is None}}

    @model_validator(mode="after")
    def _kl_loss_has_a_gradient(self) -> LossConfig:
        if self.kl_coef > 0 and self.kl_mode == "loss" and self.kl_estimator == "k1":
            raise ConfigError(
                [
                    Problem(
                        "algorithm.loss.kl_estimator",
                        "k1 as a loss term (kl_mode: loss) pulls nothing towards the reference: "
                        "k1 = log pi - log ref, and under tokens sampled from pi its gradient is "
                        "zero in expectation; set kl_estimator: k2 (the gradient of "
                        "KL(pi || ref)) or k3, or kl_mode: penalty (k1 in the rewards)",
                    )
                ]
            )
        return self


class AlgorithmConfig(Section):
    """Advantage estimation and the policy loss."""

    advantage_estimator: Literal["gae", "gigpo", "grpo", "reinforce_pp", "rloo"] = "grpo"
    """``gae`` needs the critic role; the others use group/batch baselines. ``gigpo`` adds to
    GRPO a step advantage among turns of a group that answered the same state (per-turn
    samples: ``rollout.sample_unit: turn``)."""
    gigpo_step_weight: float = Field(default=1.0, ge=0)
    """GiGPO: weight of the step advantage beside the episode's (the paper's omega)."""
    normalize_std: bool = True
    """grpo and gigpo divide an advantage by its group's std; false only subtracts the group
    mean (Dr. GRPO, Liu et al., 2025: no weight on groups whose scores barely differ)."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount factor. GAE and Reinforce++ discount per policy token (env tokens between turns
    are skipped), the same with per-turn samples: a later turn's reward reaches a token
    discounted by the policy tokens between them. GiGPO's step returns discount per turn (the
    paper's). grpo and rloo score an episode by its undiscounted return."""
    lam: float = Field(default=1.0, ge=0, le=1)
    """GAE lambda."""
    mask_truncated: bool = False
    """An episode cut short (``rollout.max_turns``, the context, or the env's ``truncated``)
    gives no loss tokens: its return is not the outcome of its actions, so it neither rewards
    nor punishes them (DAPO's overlong filtering; TRL's ``mask_truncated_completions``). Its
    return still counts in its group's baseline, and ``train/truncated`` shows the share
    masked; a batch masked whole takes no optimiser step. False trains it as one that ended,
    with the rewards it earned."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy loss."""

    @model_validator(mode="after")
    def _normalize_std_changes_the_estimator(self) -> AlgorithmConfig:
        if not self.normalize_std and self.advantage_estimator not in ("grpo", "gigpo"):
            raise ConfigError(
                [
                    Problem(
                        "algorithm.normalize_std",
                        "false (Dr. GRPO) changes grpo and gigpo only, and "
                        f"algorithm.advantage_estimator={self.advantage_estimator} has no group "
                        "std to leave out; remove algorithm.normalize_std, or use grpo or gigpo",
                    )
                ]
            )
        return self

    @property
    def needs_critic(self) -> bool:
        """Whether the critic role is trained and queried (GAE only)."""
        return self.advantage_estimator == "gae"

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs are computed (a KL term is on)."""
        return self.loss.kl_coef > 0
