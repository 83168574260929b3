"""``HFTrainStrategy``: plain torch training of an HF model on CPU or one GPU.

The embedded default ``TrainStrategy`` (see ``base.py``). It splits a padded batch into
micro-batches, trims each to its longest real sequence (right padding, so short episodes
cost no compute), computes per-token log-probs (and entropy, or values for a critic) under
``softmax(logits / temperature)`` (``token_logprobs``: the distribution rollouts sample from),
accumulates gradients over the micro-batches, clips the global norm and steps AdamW.
A non-finite loss or gradient norm raises ``NonFiniteLossError`` *before* the optimiser
step, so the model and optimiser keep their last good state.

A critic is any module whose forward returns ``values`` of shape ``(B, T)`` (see
``workers.critic.ValueModel``); ``kind="value"`` makes the strategy read those instead of
logits.

Precision: the model trains in the dtype it was loaded in, which for a trainable role is fp32
(master weights and AdamW moments: ``workers.strategy_worker.master_dtype``). ``compute_dtype``
(``model.dtype``, set by the worker) is what forward and backward run in on CUDA, under
``torch.autocast``; on CPU they run in the parameters' dtype (fp32), which is exact and, unlike
bf16 autocast on a CPU without native bf16 (AVX512-BF16/AMX), not slower.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Unpack

from trainer.strategies.base import BaseTrainStrategy, ForwardOutput, TrainOptions

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

__all__ = ["HFTrainStrategy", "half_dtype", "hf_outputs", "token_logprobs"]


def half_dtype(name: str | None) -> torch.dtype | None:
    """``torch.bfloat16`` / ``torch.float16`` for a ``model.dtype`` of that name; None for
    ``float32`` (or None): the dtype mixed-precision compute runs in, if any."""
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name or "")


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    with_entropy: bool = False,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(B, T)`` log p_T(token_t | <t) from ``(B, T, V)`` logits (column 0 is 0), and entropy.

    ``p_T = softmax(logits / temperature)``: the distribution an engine sampling at that
    temperature draws from and reports log-probs of (``rollout.temperature``), so the PPO ratio,
    the policy gradient and the KL compare the policy that sampled. The entropy is p_T's too.
    A temperature of 0 (greedy) has no such distribution and is refused.
    """
    import torch

    from trainer.algos.losses import entropy_from_logits

    if not (temperature > 0 and math.isfinite(temperature)):  # NaN too
        raise ValueError(
            f"temperature must be > 0 to take log-probs under softmax(logits / temperature), got "
            f"{temperature}; greedy (0) sampling has no distribution to train on"
        )
    shifted = logits[:, :-1].float()
    if temperature != 1.0:
        shifted = shifted / temperature
    logprobs = torch.log_softmax(shifted, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    logprobs = torch.nn.functional.pad(logprobs, (1, 0))
    entropy = (
        torch.nn.functional.pad(entropy_from_logits(shifted), (1, 0)) if with_entropy else None
    )
    return logprobs, entropy


def hf_outputs(
    model: Any,
    micro: Mapping[str, torch.Tensor],
    kind: str,
    with_entropy: bool,
    temperature: float = 1.0,
) -> ForwardOutput:
    """An HF model's per-token outputs for one micro-batch (its rows, or its packed rows
    unpacked back to them: ``trainer.strategies.packing``), log-probs and entropy at
    ``temperature`` (``token_logprobs``); ``kind="value"``: a critic's values."""
    import torch

    from trainer.strategies.packing import packed_model_inputs, unpack

    packed = "_packed_ids" in micro
    out = model(**packed_model_inputs(model, micro))
    shape = micro["_packed_ids" if packed else "input_ids"].shape  # (flash: one flat row)
    if kind == "value":
        # token t's value is V(the state before t): read at t - 1, where the model has not
        # seen t (read at t, the critic would learn Q(s, a) and GAE's baseline the action's own
        # value); a sequence's first token has none, as it has no log-prob
        values = torch.nn.functional.pad(out.float().reshape(shape)[:, :-1], (1, 0))
        if packed:
            values = unpack(values, micro)
        return ForwardOutput(logprobs=values * 0.0, values=values)
    ids = micro["_packed_ids"] if packed else micro["input_ids"]
    logprobs, entropy = token_logprobs(
        out.logits.reshape(*shape, -1), ids, with_entropy, temperature=temperature
    )
    if packed:
        logprobs = unpack(logprobs, micro)
        entropy = unpack(entropy, micro) if entropy is not None else None
    return ForwardOutput(logprobs=logprobs, entropy=entropy)


class HFTrainStrategy(BaseTrainStrategy):
    """Runs and trains one torch model (see the module docstring)."""

    name = "hf"

    def __init__(
        self,
        model: Any,
        *,
        device: str = "cpu",
        compute_dtype: str | None = None,
        **common: Unpack[TrainOptions],
    ) -> None:
        super().__init__(**common)
        self.model = model.to(device)
        self.device = device
        self.autocast = half_dtype(compute_dtype) if device.startswith("cuda") else None
        """What forward/backward run in on CUDA (``model.dtype``); None: the parameters' dtype."""
        self._init_optimizer(owner="hf")

    @classmethod
    def _configure(cls, world_size: int, args: dict[str, Any], common: dict[str, Any]) -> None:
        """One full copy on one device (CUDA when visible): no gradient sync, one trainable rank."""
        import torch

        if world_size > 1 and common.get("trainable", True):
            raise ValueError(
                f"the 'hf' training strategy runs on one device but this role has {world_size} "
                "workers; map it to one device (device_mapping: [0]) or use a data-parallel "
                "strategy (fsdp2)"
            )
        common.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")

    def _run(
        self, micro: Mapping[str, torch.Tensor], with_entropy: bool, temperature: float
    ) -> ForwardOutput:
        if self.autocast is None:
            return hf_outputs(self.model, micro, self.kind, with_entropy, temperature)
        import torch

        with torch.autocast("cuda", dtype=self.autocast):
            return hf_outputs(self.model, micro, self.kind, with_entropy, temperature)

    def _clip(self) -> float:
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        limit = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, limit))

    # ------------------------------------------------------------------ weights and state
    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from trainer.strategies.tied import full_state

        self.residency.require("params")
        yield from full_state(self.model, lambda tensor: tensor.detach())

    def state_dict(self) -> dict[str, Any]:
        from trainer.resume import strategy_stamp

        self.residency.require("params", "optimizer")
        state: dict[str, Any] = {"model": self.model.state_dict(), **strategy_stamp(self.name)}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load model and optimizer state; the optimizer keeps its configured settings (lr,
        weight decay: ``trainer.resume``); a state of another strategy is refused."""
        from trainer.resume import check_saved_strategy, keep_optimizer_settings

        self.residency.require("params", "optimizer")
        if self.optimizer is not None:
            check_saved_strategy(state, self.name)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            with keep_optimizer_settings(self.optimizer):
                self.optimizer.load_state_dict(state["optimizer"])

    def save_pretrained(self, path: str) -> None:
        """Write the model as an HF folder (``from_pretrained(path)`` loads it back)."""
        self.model.save_pretrained(path)
