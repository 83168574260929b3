"""The two boundaries a worker talks through: ``InferenceEngine`` and ``TrainStrategy``.

A worker (``trainer.workers``) never knows which engine or strategy it holds: the embedded
defaults are ``hf_engine.HFEngine`` (torch generation) and ``hf.HFTrainStrategy`` (plain
torch on CPU or one GPU); vLLM, FSDP2 and Megatron-Core implement the same protocols.

``InferenceEngine`` - what a generation backend implements
----------------------------------------------------------
``async generate(request) -> GenerationResult``
    One request per policy turn: the *token ids* of the whole conversation so far (never
    text, so a multi-turn episode is never re-tokenised) and sampling settings. Returns the
    new token ids (the stop token included when one ended the turn) and the log-probability
    of each under the sampling distribution. Many requests are in flight at once; the engine
    batches them (continuous batching in vLLM, batch-what-is-queued in ``hf``).
``async abort(request_id)``
    Stop a request; its ``generate`` returns what it had with ``finish_reason="abort"``.
    Unknown or finished ids are ignored.
``update_weights(weights)``
    Load new policy weights (a state dict or an iterator of ``(name, tensor)``, full
    tensors in HF naming); bumps ``version``. Called between generations by the weight sync.
``sleep()`` / ``wake_up()``
    Release / re-acquire device memory around a colocated train phase; no-ops where the
    backend cannot (CPU).
``get_state()`` / ``set_state(state)``
    The sampling RNG state, so a resumed run samples exactly what the killed run would have.

``TrainStrategy`` - how a model is run forward/backward and stepped
-------------------------------------------------------------------
The strategy owns the model, optimiser, precision and parallel layout; the worker owns the
*loss*. ``forward(batch) -> ForwardOutput`` gives per-token log-probs (and optionally
entropy / hidden states) for a padded batch; ``train_step(batch, loss_fn)`` runs the
micro-batches, accumulates, clips and steps, and raises ``NonFiniteLossError`` instead of
applying a NaN update. ``state_dict()`` / ``load_state_dict()`` cover model + optimiser for
checkpoints; ``full_weights()`` yields full tensors for the weight sync; ``save_pretrained(path)``
writes an HF folder (``from_pretrained`` loads it); ``offload(params=, optimizer=)`` / ``reload()``
move state off and back onto the device around colocated phases (``trainer.strategies.offload``:
tracked no-ops on CPU; a call that needs an offloaded state reloads it first). In a sharded
strategy (``fsdp2``, ``megatron``) ``full_weights``, ``state_dict`` and ``save_pretrained`` are
*collectives*: every rank calls them; rank 0 receives the full tensors (and writes the folder).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "InferenceEngine",
    "ForwardOutput",
    "LossFn",
    "TrainStrategy",
    "Weights",
]

FinishReason = Literal["stop", "length", "abort"]
Weights = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


@dataclass
class GenerationRequest:
    """One turn's generation: continue ``prompt_ids`` by at most ``max_new_tokens`` tokens."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int = 32
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the tokenizer's EOS."""


@dataclass
class GenerationResult:
    """What came out: new ids (stop token included), their log-probs, why it ended."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int = 0
    """The engine's weight version that produced these tokens (for staleness accounting)."""
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class InferenceEngine(Protocol):
    """A generation backend (see the module docstring for the guarantees)."""

    version: int

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def abort(self, request_id: str) -> None: ...

    def update_weights(self, weights: Weights) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


@dataclass
class ForwardOutput:
    """Per-token outputs aligned with ``input_ids``: ``logprobs[:, t] = log p(token_t | <t)``.

    Position 0 (no context) is 0. ``entropy`` and ``values`` are present only when asked.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None


LossFn = Callable[[ForwardOutput, Mapping[str, "torch.Tensor"]], tuple["torch.Tensor", dict[str, float]]]
"""``loss_fn(outputs, micro_batch) -> (scalar loss, metrics)``: what a worker trains on.

The loss is the micro-batch's own aggregate (``trainer.algos.losses.aggregate``); an optional
``loss_fn.agg_mode`` attribute names the mode (default ``token-mean``). The strategy weighs each
micro-batch by its share of the step's tokens (or sequences) over every micro-batch,
accumulation step and data-parallel rank (``distributed.micro_batch_scales``), so the step's
gradient is that of the mean over the whole step."""


@runtime_checkable
class TrainStrategy(Protocol):
    """A way to run and train a model (see the module docstring)."""

    def forward(self, batch: Mapping[str, torch.Tensor], *, with_entropy: bool = False) -> ForwardOutput: ...

    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, with_entropy: bool = False) -> dict[str, float]: ...

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_pretrained(self, path: str) -> None: ...

    def offload(self, *, params: bool = True, optimizer: bool = True) -> None: ...

    def reload(self) -> None: ...
