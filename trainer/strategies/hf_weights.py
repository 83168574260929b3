"""How ``HFEngine`` loads new weights: all or nothing, never a silent mix of two policies.

An update is full HF-named tensors, a mapping or an iterator of ``(name, tensor)``; it may carry
every tensor of the model or some of them (``weight_sync.only_changed`` sends the ones that
changed; a tied ``lm_head.weight`` is the embedding's). Each tensor is checked before it is
copied, with the checks ``VLLMEngine`` uses (``vllm_weights.TensorChecks``): a name the model
has (``KeyError``), its shape and finite values (``ValueError``).

- A mapping is checked whole before anything is copied: a bad tensor anywhere in it loads none
  of it; the engine keeps serving the previous weights under the previous version.
- An iterator (a bucketed gather: it is never held whole) is checked tensor by tensor as it is
  consumed. One that fails after some of its tensors were copied leaves the model holding a
  mix: the engine then refuses to generate (``StaleWeightsError``; the requests it was running
  fail with it) until an update carrying every tensor succeeds. One that fails before its
  first copy changes nothing.

LoRA adapters (``with_adapter``) wrap the model with ``peft`` once and load the adapter's
tensors at every call; base updates keep reaching the base weights by their own names.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer.strategies.base import Weights
from trainer.strategies.vllm_weights import TensorChecks

if TYPE_CHECKING:
    from trainer.strategies.lora import AdapterWeights

__all__ = ["EngineWeights", "with_adapter"]


class EngineWeights:
    """The weights of an ``HFEngine``'s model, updated in place (see the module docstring).

    Built from the base model before any adapter wraps it: its state-dict names are the ones
    updates use. ``broken`` says why generation is refused (None: the weights are whole)."""

    def __init__(self, model: Any) -> None:
        self.params: dict[str, Any] = dict(model.state_dict(keep_vars=True))
        self.checks = TensorChecks(
            {name: tuple(tensor.shape) for name, tensor in self.params.items()}, self.params
        )
        self._tensors = {id(tensor) for tensor in self.params.values()}
        """What a complete update covers (tied names share one tensor)."""
        self.broken: str | None = None

    def load(self, weights: Weights) -> None:
        """Check and copy ``weights`` into the model (the caller holds the model: no forward
        runs meanwhile). Raises what the checks raise; see the module docstring for what is left
        loaded then."""
        import torch

        whole = isinstance(weights, Mapping)
        if isinstance(weights, Mapping):
            self.checks.check_tensors(weights)
        items = weights.items() if isinstance(weights, Mapping) else weights
        covered: set[int] = set()
        try:
            with torch.no_grad():
                for name, tensor in items:
                    if not whole:
                        self.checks.check_known([name])
                        self.checks.check_tensor(name, tensor)
                    target = self.params[name]
                    target.copy_(tensor.to(target.device, target.dtype))
                    covered.add(id(target))
        except BaseException as error:
            if covered:
                self.broken = (
                    f"a weight update failed part-way ({error!r}) after {len(covered)} of the "
                    f"model's {len(self._tensors)} tensors were loaded; the engine refuses to "
                    "generate until update_weights succeeds with every tensor"
                )
            raise
        if covered >= self._tensors:
            self.broken = None


def with_adapter(model: Any, adapter: AdapterWeights) -> Any:
    """``model`` serving ``adapter`` (LoRA): wrapped with the adapter's ``peft`` config the first
    time, then the adapter's tensors loaded (``KeyError`` for tensors it has no place for)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from trainer.strategies.lora import ADAPTER

    if not hasattr(model, "peft_config"):
        known = set(LoraConfig.__dataclass_fields__)
        config = LoraConfig(**{k: v for k, v in adapter.config.items() if k in known})
        with warnings.catch_warnings():  # a tied embedding's adapter: see lora.apply_lora
            warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*")
            model = get_peft_model(model, config, adapter_name=ADAPTER).eval()
    result: Any = set_peft_model_state_dict(model, adapter.tensors, adapter_name=ADAPTER)
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    if unexpected:
        raise KeyError(f"load_adapter got tensors the model has no place for: {unexpected[:3]}")
    return model
