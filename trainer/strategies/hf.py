"""``HFTrainStrategy``: plain torch training of an HF model on CPU or one GPU.

The embedded default ``TrainStrategy`` (see ``base.py``). It splits a padded batch into
micro-batches, trims each to its longest real sequence (right padding, so short episodes
cost no compute), computes per-token log-probs (and entropy, or values for a critic),
accumulates gradients over the micro-batches, clips the global norm and steps AdamW.
A non-finite loss or gradient norm raises ``NonFiniteLossError`` *before* the optimiser
step, so the model and optimiser keep their last good state.

A critic is any module whose forward returns ``values`` of shape ``(B, T)`` (see
``workers.critic.ValueModel``); ``kind="value"`` makes the strategy read those instead of
logits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from trainer.errors import NonFiniteLossError
from trainer.strategies.base import ForwardOutput, LossFn
from trainer.strategies.distributed import micro_batch_scales, split_micro_batches
from trainer.strategies.offload import Residency, state_movers

if TYPE_CHECKING:
    import torch

__all__ = ["HFTrainStrategy", "token_logprobs"]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(B, T)`` log p(token_t | <t) from ``(B, T, V)`` logits (column 0 is 0), and entropy."""
    import torch

    from trainer.algos.losses import entropy_from_logits

    shifted = logits[:, :-1].float()
    logprobs = torch.log_softmax(shifted, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    logprobs = torch.nn.functional.pad(logprobs, (1, 0))
    entropy = torch.nn.functional.pad(entropy_from_logits(shifted), (1, 0)) if with_entropy else None
    return logprobs, entropy


class HFTrainStrategy:
    """Runs and trains one torch model (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int = 8,
        grad_accumulation: int | None = None,
        trainable: bool = True,
        kind: Literal["lm", "value"] = "lm",
        device: str = "cpu",
    ) -> None:
        import torch

        self.model = model.to(device)
        self.device = device
        self.kind = kind
        self.micro_batch_size = micro_batch_size
        self.grad_accumulation = grad_accumulation
        self.max_grad_norm = max_grad_norm
        self.optimizer: torch.optim.Optimizer | None = None
        if trainable:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay
            )
        else:
            self.model.requires_grad_(False)
        self.model.train(trainable)
        self.residency = Residency(str(device), state_movers(self.model, self.optimizer), owner="hf")

    # ------------------------------------------------------------------ forward
    def _micro_batches(self, batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return split_micro_batches(batch, self.micro_batch_size, self.device)

    def _run(self, micro: Mapping[str, torch.Tensor], with_entropy: bool) -> ForwardOutput:
        out = self.model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
        if self.kind == "value":
            return ForwardOutput(logprobs=out * 0.0, values=out)
        logprobs, entropy = token_logprobs(out.logits, micro["input_ids"], with_entropy)
        return ForwardOutput(logprobs=logprobs, entropy=entropy)

    def forward(self, batch: Mapping[str, torch.Tensor], *, with_entropy: bool = False) -> ForwardOutput:
        """Per-token outputs for the whole batch, no gradients, padded back to the batch width."""
        import torch

        self.residency.require("params")
        width = batch["input_ids"].shape[1]
        parts: list[ForwardOutput] = []
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for micro in self._micro_batches(batch):
                parts.append(self._run(micro, with_entropy))
        self.model.train(was_training)

        def cat(field: str) -> torch.Tensor | None:
            tensors = [getattr(p, field) for p in parts]
            if tensors[0] is None:
                return None
            return torch.cat([torch.nn.functional.pad(t.cpu(), (0, width - t.shape[1])) for t in tensors])

        return ForwardOutput(logprobs=cat("logprobs"), entropy=cat("entropy"), values=cat("values"))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ train
    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, with_entropy: bool = False) -> dict[str, float]:
        """One or more optimiser steps over ``batch`` (``grad_accumulation`` micro-batches each)."""
        import torch

        if self.optimizer is None:
            raise RuntimeError("train_step on a frozen model; build the strategy with trainable=True")
        self.residency.require("params", "optimizer")
        micros = list(self._micro_batches(batch))
        per_step = self.grad_accumulation or len(micros)
        scales = micro_batch_scales(micros, per_step, getattr(loss_fn, "agg_mode", "token-mean"))
        totals: dict[str, float] = {}
        steps = 0
        self.model.train()
        for first in range(0, len(micros), per_step):
            group = micros[first:first + per_step]
            self.optimizer.zero_grad(set_to_none=True)
            for index, micro in enumerate(group):
                loss, metrics = loss_fn(self._run(micro, with_entropy), micro)
                if not torch.isfinite(loss):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise NonFiniteLossError(
                        f"the loss became {loss.item()} (metrics {metrics}); the update was not applied. "
                        "Lower train.lr, raise algorithm.loss.clip/grad clipping, or check the rewards"
                    )
                (loss * scales[first + index]).backward()
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value / len(micros)
            norm = self._clip()
            if not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteLossError(
                    f"the gradient norm became {norm}; the update was not applied. Lower train.lr or "
                    "set train.max_grad_norm"
                )
            self.optimizer.step()
            steps += 1
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + norm
        totals["grad_norm"] = totals.get("grad_norm", 0.0) / max(steps, 1)
        totals["optimizer_steps"] = float(steps)
        return totals

    def _clip(self) -> float:
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        limit = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, limit))

    # ------------------------------------------------------------------ weights and state
    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.residency.require("params")
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def state_dict(self) -> dict[str, Any]:
        self.residency.require("params", "optimizer")
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residency.require("params", "optimizer")
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    def save_pretrained(self, path: str) -> None:
        """Write the model as an HF folder (``from_pretrained(path)`` loads it back)."""
        self.model.save_pretrained(path)

    def set_lr(self, lr: float) -> None:
        """Change the learning rate of every parameter group (the SFT stage uses its own)."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def offload(self, *, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters and/or optimiser state to host memory (colocation); a tracked no-op on CPU.

        See ``trainer.strategies.offload``: the next call that needs a state reloads it.
        """
        self.residency.offload(params=params, optimizer=optimizer)

    def reload(self) -> None:
        """Bring every offloaded state back onto the device."""
        self.residency.reload()
