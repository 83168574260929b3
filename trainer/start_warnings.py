"""What a run warns about as it starts (``envhub train``) and ``--dry-run`` prints alike:
settings that are valid, and that some runs want, but that quietly cost learning signal.
Refusals are ``TrainerConfig.problems()``'s; these only inform."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = ["start_warnings"]


def start_warnings(cfg: TrainerConfig) -> list[str]:
    """One line per warning (empty when there is nothing to say)."""
    from trainer.strategies.lora import dropout_warning

    warnings = (dropout_warning(cfg), _kl_penalty_warning(cfg), _float16_warning(cfg))
    return [line for line in warnings if line]


def _float16_warning(cfg: TrainerConfig) -> str | None:
    """``model.dtype: float16`` computes the training forward and backward in fp16 (over fp32
    master weights) with no loss scaling: gradients below fp16's ~6e-8 become 0 and large
    activations overflow. bf16 has fp32's range and needs neither."""
    if cfg.train.steps == 0 or cfg.model.dtype != "float16":
        return None
    return (
        "model.dtype=float16: training computes in fp16 without loss scaling (no GradScaler), "
        "so small gradients underflow to 0; use model.dtype: bfloat16 where the GPU has it "
        "(Ampere or newer), or float32"
    )


def _kl_penalty_warning(cfg: TrainerConfig) -> str | None:
    """``kl_mode: penalty`` takes the KL from the scores before GRPO/GiGPO divide by the group's
    std (``trainer.algos.advantages.kl_penalised_rewards``, as verl does): the std divides
    ``kl_coef`` out where the KL is what differs, and a group whose episodes all scored alike
    gets full-size advantages from the KL's noise alone."""
    algo, loss = cfg.algorithm, cfg.algorithm.loss
    if cfg.train.steps == 0 or loss.kl_coef == 0 or loss.kl_mode != "penalty":
        return None
    if algo.advantage_estimator not in ("grpo", "gigpo") or not algo.normalize_std:
        return None
    return (
        f"algorithm.loss.kl_mode=penalty with {algo.advantage_estimator}: the KL is taken from "
        "the scores before the group's std divides them, so the std divides kl_coef="
        f"{loss.kl_coef:g} out where the KL is what differs, and a group whose episodes all "
        "scored alike is trained on the KL's noise at full size; use kl_mode: loss (GRPO's "
        "own), or "
        "algorithm.normalize_std: false (Dr. GRPO)"
    )
