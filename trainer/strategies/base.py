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
``generate_batch(requests) -> list[GenerationResult]``
    The same for a whole batch at once, in order, blocking (what a worker rank serves).
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
applying a NaN update. Both take log-probs at a sampling ``temperature`` (``ForwardOutput``).
``state_dict()`` / ``load_state_dict()`` cover model + optimiser for checkpoints;
``full_weights()`` yields full tensors for the weight sync; ``save_pretrained(path)`` writes an
HF folder (``from_pretrained`` loads it); ``offload(params=, optimizer=)`` / ``reload()``
move state off and back onto the device around colocated phases (``trainer.strategies.offload``:
tracked no-ops on CPU; a call that needs an offloaded state reloads it first). In a sharded
strategy (``fsdp2``, ``megatron``) ``full_weights``, ``state_dict`` and ``save_pretrained`` are
*collectives*: every rank calls them; rank 0 receives the full tensors (and writes the folder).
``set_lr(lr)`` changes the learning rate of every parameter group (the SFT stage, LR schedules).

``BaseTrainStrategy`` - the shared loop every training strategy is built on
---------------------------------------------------------------------------
The public methods (``train_step``, ``forward``, ``set_lr``, ``offload``/``reload``) live here
once and call small hooks, the way ``sandboxes.base.Sandbox`` calls ``_start/_exec/_stop``.
What a strategy module implements:

``__init__(model, *, device=..., <its options>, **common)``
    ``super().__init__(**common)`` (``TrainOptions``), lay the model out, set ``self.model`` and
    ``self.device``, then ``self._init_optimizer(owner)``: AdamW, freezing and ``residency``.
``_run(micro, with_entropy, temperature) -> ForwardOutput``
    One micro-batch forward (gradients recorded when enabled), log-probs at ``temperature``.
``_clip() -> float``
    The global gradient norm before clipping, after clipping to ``max_grad_norm``.
``full_weights`` / ``state_dict`` / ``load_state_dict`` / ``save_pretrained``
    The model's layout decides them (collectives in a sharded strategy).

Optional hooks, no-ops or the single-device answer by default: ``_configure`` (a classmethod:
refuse a layout the strategy cannot run, fill defaults), ``_group_rows`` (the rows
model-parallel peers share), ``_forward_micros`` / ``_accumulate`` (how micro-batches run, e.g.
a pipeline schedule), ``_on_micro_batch`` and ``_reduce_gradients``. Set ``collective = True``
when ranks run collectives together: micro-batch counts are then padded to agree. The
strategy's name and capabilities live in ``trainer.strategies.registry``, one line per strategy.
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Literal,
    Protocol,
    Self,
    TypedDict,
    runtime_checkable,
)

from trainer.errors import NonFiniteLossError
from trainer.strategies.distributed import (
    micro_batch_scales,
    pad_micro_count,
    resolve_device,
    summed_over_group,
)
from trainer.strategies.offload import Residency, state_movers
from trainer.strategies.parallel_errors import ParallelConfigError

if TYPE_CHECKING:
    import torch

    from trainer.algos.losses import AggregationMode

__all__ = [
    "BaseTrainStrategy",
    "FinishReason",
    "ForwardOutput",
    "GenerationRequest",
    "GenerationResult",
    "InferenceEngine",
    "LossFn",
    "TrainOptions",
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

    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]: ...

    async def abort(self, request_id: str) -> None: ...

    def update_weights(self, weights: Weights) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


@dataclass
class ForwardOutput:
    """Per-token outputs aligned with ``input_ids``: ``logprobs[:, t] = log p(token_t | <t)``.

    ``p = softmax(logits / temperature)``, the distribution rollouts sampled at that temperature
    draw from: the actor and reference pass ``rollout.temperature`` (SFT keeps 1), so the PPO ratio
    compares the policy that sampled; ``entropy`` is that distribution's too. Position 0 (no
    context) is 0. ``entropy`` and ``values`` are present only when asked.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None


LossFn = Callable[
    [ForwardOutput, Mapping[str, "torch.Tensor"]], tuple["torch.Tensor", dict[str, float]]
]
"""``loss_fn(outputs, micro_batch) -> (scalar loss, metrics)``: what a worker trains on.

The loss is the micro-batch's own aggregate (``trainer.algos.losses.aggregate``); an optional
``loss_fn.agg_mode`` attribute names the mode (default ``token-mean``). The strategy weighs each
micro-batch by its share of the step's tokens (or sequences) over every micro-batch,
accumulation step and data-parallel rank (``distributed.micro_batch_scales``), so the step's
gradient is that of the mean over the whole step. Metrics weigh alike, but those an optional
``loss_fn.token_metrics`` names (token means: a clipped share) weigh by tokens in every mode."""


@runtime_checkable
class TrainStrategy(Protocol):
    """A way to run and train a model (see the module docstring)."""

    model: Any
    """The module it runs (laid out by the strategy; a ``peft`` model when adapters train)."""
    residency: Residency
    """Which states are on the device, and the history of offload/reload moves."""

    def forward(
        self,
        batch: Mapping[str, torch.Tensor],
        *,
        with_entropy: bool = False,
        temperature: float = 1.0,
    ) -> ForwardOutput: ...

    def train_step(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, float]: ...

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_pretrained(self, path: str) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def offload(self, *, params: bool = True, optimizer: bool = True) -> None: ...

    def reload(self) -> None: ...


class TrainOptions(TypedDict, total=False):
    """The settings every training strategy takes (``BaseTrainStrategy.__init__``)."""

    lr: float
    weight_decay: float
    max_grad_norm: float | None
    micro_batch_size: int
    micro_batch_tokens: int | None
    """Micro-batches of about this many tokens instead of ``micro_batch_size`` rows."""
    packing: bool
    """Pack sequences into shared rows (block-diagonal attention, positions per sequence)."""
    grad_accumulation: int | None
    """Micro-batches per optimiser step; None: one step over the whole batch."""
    trainable: bool
    """False freezes the model (a reference policy): no optimiser, no ``train_step``."""
    kind: Literal["lm", "value"]
    """``value``: the model returns ``values`` of shape ``(B, T)`` (a critic) instead of logits."""


class BaseTrainStrategy(abc.ABC):
    """The shared train loop, forward, learning rate and offload (see the module docstring)."""

    name: ClassVar[str]
    """The strategy's name in ``trainer.strategies.registry.TRAIN_STRATEGIES``."""
    collective: ClassVar[bool] = False
    """Ranks run forward/backward collectives together: pad micro-batch counts to agree."""
    rank: int = 0
    world_size: int = 1
    dp_group: Any = None
    """The data-parallel group micro-batch weights are summed over (None: this rank alone)."""
    dp_size: int = 1
    model: Any
    device: str
    residency: Residency

    def __init__(
        self,
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int = 8,
        micro_batch_tokens: int | None = None,
        packing: bool = False,
        grad_accumulation: int | None = None,
        trainable: bool = True,
        kind: Literal["lm", "value"] = "lm",
    ) -> None:
        self.lr, self.weight_decay, self.trainable, self.kind = lr, weight_decay, trainable, kind
        self.micro_batch_size, self.grad_accumulation, self.max_grad_norm = (
            micro_batch_size,
            grad_accumulation,
            max_grad_norm,
        )
        self.micro_batch_tokens, self.packing = micro_batch_tokens, packing
        self.optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ building from a config
    @classmethod
    def create(
        cls,
        model: Any,
        *,
        world_size: int = 1,
        strategy_args: Mapping[str, Any] | None = None,
        **common: Any,
    ) -> Self:
        """``cls(model, **common, **strategy_args)`` for a role of ``world_size`` ranks; a layout it
        cannot run (``_configure``) or an unknown ``strategy_args`` key is refused with the fix."""
        args = dict(strategy_args or {})
        cls._configure(world_size, args, common)
        accepted = cls.options()
        unknown = sorted(set(args) - accepted)
        if unknown:
            raise ParallelConfigError(
                f"strategy_args {unknown} are not options of the {cls.name!r} strategy; it takes "
                f"{sorted(accepted - set(common))}"
            )
        # ``cls`` is a concrete strategy, whose constructor takes the model first (the module
        # docstring's contract); the abstract base's own ``__init__`` takes the common options only
        build: Callable[..., Self] = cls
        return build(model, **{**common, **args})

    @classmethod
    def options(cls) -> set[str]:
        """Every keyword the constructor takes: ``TrainOptions`` and the strategy's own."""
        own = {
            name
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        }
        return (own - {"self", "model"}) | set(TrainOptions.__annotations__)

    @classmethod
    def _configure(cls, world_size: int, args: dict[str, Any], common: dict[str, Any]) -> None:
        """Hook: refuse a layout this strategy cannot run on ``world_size`` ranks; fill defaults in
        place. The tensor x pipeline parallel layout is checked here for every strategy
        (``registry.layout_problem``)."""
        from trainer.strategies.registry import layout_problem

        problem = layout_problem(cls.name, world_size, args)
        if problem is not None:
            raise ParallelConfigError(f"{cls.name} strategy_args.{problem[0]}={problem[1]}")

    def _use_device(self, device: str | None, *, cpu_refusal: str | None = None) -> bool:
        """Set ``self.device`` (``auto``: CUDA when visible); True on CUDA. ``cpu_refusal`` is the
        message (bad option and fix) for an option that needs CUDA, raised when there is none."""
        self.device = resolve_device(device)
        on_cuda = self.device.startswith("cuda")
        if cpu_refusal is not None and not on_cuda:
            raise ParallelConfigError(cpu_refusal)
        return on_cuda

    def _init_optimizer(
        self,
        owner: str,
        *,
        foreach: bool | None = None,
        movers: Mapping[str, Callable[[str], None]] | None = None,
    ) -> None:
        """AdamW over the trainable parameters (or freeze the model) and the offload bookkeeping."""
        import torch

        if self.trainable:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad],
                lr=self.lr,
                weight_decay=self.weight_decay,
                foreach=foreach,
            )
        else:
            self.model.requires_grad_(False)
        self.model.train(self.trainable)
        movers = state_movers(self.model, self.optimizer) if movers is None else movers
        self.residency = Residency(str(self.device), dict(movers), owner=owner)

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _run(
        self, micro: Mapping[str, torch.Tensor], with_entropy: bool, temperature: float
    ) -> ForwardOutput:
        """One micro-batch forward, log-probs (and entropy) at ``temperature``."""

    @abc.abstractmethod
    def _clip(self) -> float:
        """Clip the global gradient norm to ``max_grad_norm``; return the norm before clipping."""

    def _group_rows(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], slice]:
        """The rows this rank runs (its model-parallel peers' union), and where its own sit."""
        return dict(batch), slice(None)

    def _micro_batches(self, batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """``batch`` in micro-batches on the device (``micro_batch_size`` rows of like length
        within each optimiser step's rows, or about ``micro_batch_tokens`` tokens; packed with
        ``packing``: ``trainer.strategies.packing``); counts padded to agree when
        ``collective``."""
        from trainer.strategies.packing import build_micro, plan_micro_batches

        plans = plan_micro_batches(
            [int(n) for n in batch["attention_mask"].sum(-1).tolist()],
            rows_per_micro=self.micro_batch_size,
            tokens_per_micro=self.micro_batch_tokens,
            packing=self.packing,
            rows_per_step=(self.grad_accumulation or 0) * self.micro_batch_size or None,
        )
        micros = [build_micro(batch, plan, self.device) for plan in plans]
        return pad_micro_count(micros, batch, self.device) if self.collective else micros

    def _forward_micros(
        self, micros: list[dict[str, torch.Tensor]], with_entropy: bool, temperature: float
    ) -> list[ForwardOutput]:
        """Outputs of every micro-batch (no gradients), dummies included."""
        return [self._run(micro, with_entropy, temperature) for micro in micros]

    def _on_micro_batch(self, index: int, count: int) -> None:
        """Called before micro-batch ``index`` of the ``count`` in one optimiser step."""

    def _micro_loss(
        self, out: ForwardOutput, micro: Mapping[str, torch.Tensor], loss_fn: LossFn
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The worker's loss on a real micro-batch; a zero-weighted one (same graph) on a dummy."""
        if "_dummy" in micro:
            head = out.values if self.kind == "value" else out.logprobs
            if head is None:
                raise RuntimeError(
                    f"{type(self).__name__}._run returned no values for a kind='value' model; "
                    "a value strategy's forward must set ForwardOutput.values"
                )
            return head.sum() * 0.0, {}
        return loss_fn(out, micro)

    def _accumulate(
        self,
        group: list[dict[str, torch.Tensor]],
        scales: list[float],
        loss_fn: LossFn,
        with_entropy: bool,
        temperature: float,
    ) -> list[tuple[float, dict[str, float]]]:
        """Forward and backward of one optimiser step's micro-batches, each loss times its scale;
        the ``(loss, metrics)`` of each, stopping after the first non-finite loss (no backward)."""
        losses: list[tuple[float, dict[str, float]]] = []
        for index, micro in enumerate(group):
            self._on_micro_batch(index, len(group))
            out = self._run(micro, with_entropy, temperature)
            loss, metrics = self._micro_loss(out, micro, loss_fn)
            losses.append((float(loss.detach()), metrics))
            if not math.isfinite(losses[-1][0]):
                break  # the step is refused: the rest would be wasted work
            (loss * scales[index]).backward()
        return losses

    def _reduce_gradients(self) -> None:
        """Called after a step's backward passes, before clipping (e.g. a data-parallel reduce)."""

    # ------------------------------------------------------------------ forward / train
    def forward(
        self,
        batch: Mapping[str, torch.Tensor],
        *,
        with_entropy: bool = False,
        temperature: float = 1.0,
    ) -> ForwardOutput:
        """Per-token outputs for this rank's rows at ``temperature``, no gradients, padded back
        to the batch width."""
        import torch

        self.residency.require("params")
        width = batch["input_ids"].shape[1]
        union, mine = self._group_rows(batch)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            micros = self._micro_batches(union)
            outs = self._forward_micros(micros, with_entropy, temperature)
            real = [(o, m) for o, m in zip(outs, micros, strict=True) if "_dummy" not in m]
        self.model.train(was_training)
        full = union["input_ids"].shape[1]
        # rows in the caller's order: micro-batches grouped by tokens say where theirs came from
        order = [m["_rows"].cpu() for _, m in real if "_rows" in m]
        inverse = torch.argsort(torch.cat(order)) if order else None

        def cat(name: str) -> torch.Tensor | None:
            tensors = [getattr(o, name) for o, _ in real]
            if not tensors or tensors[0] is None:
                return None
            rows = torch.cat(
                [torch.nn.functional.pad(t.cpu(), (0, full - t.shape[1])) for t in tensors]
            )
            return (rows[inverse] if inverse is not None else rows)[mine, :width]

        logprobs = cat("logprobs")
        if logprobs is None:  # no real rows on this rank: an empty batch of the batch's width
            logprobs = torch.zeros(0, width)
        return ForwardOutput(logprobs=logprobs, entropy=cat("entropy"), values=cat("values"))

    def train_step(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Optimiser steps over this rank's rows (``grad_accumulation`` micro-batches each); the
        loss sees log-probs at ``temperature``."""
        if self.optimizer is None:
            raise RuntimeError(
                "train_step on a frozen model; build the strategy with trainable=True"
            )
        self.residency.require("params", "optimizer")
        union, _ = self._group_rows(batch)  # model-parallel peers train on the same rows
        micros = self._micro_batches(union)
        per_step = self.grad_accumulation or len(micros)
        mode: AggregationMode = getattr(loss_fn, "agg_mode", "token-mean")
        scales = micro_batch_scales(
            micros, per_step, mode, group=self.dp_group, replicas=self.dp_size
        )
        # the metrics describe the step as its loss does: each micro-batch weighs its share of the
        # units (tokens or sequences; tokens for ``token_metrics``) of its optimiser step on every
        # data-parallel rank (its scale without the replicas), steps alike; the ranks' parts are
        # summed below, so every rank reports the whole batch's figures (ranks hold equally many
        # micro-batches, and the fullest rank has real rows in every step)
        token_metrics = set(getattr(loss_fn, "token_metrics", ()))
        by_tokens = scales
        if token_metrics and mode != "token-mean":
            by_tokens = micro_batch_scales(
                micros, per_step, "token-mean", group=self.dp_group, replicas=self.dp_size
            )
        n_steps = -(-len(micros) // per_step) or 1
        totals: dict[str, float] = {}
        steps = 0
        self.model.train()
        grad_clip = "train.max_grad_norm (now " + (
            f"{self.max_grad_norm:g})" if self.max_grad_norm else "off; 1.0 is the default)"
        )
        for first in range(0, len(micros), per_step):
            step = slice(first, first + per_step)
            self.optimizer.zero_grad(set_to_none=True)
            for offset, (value, metrics) in enumerate(
                self._accumulate(micros[step], scales[step], loss_fn, with_entropy, temperature)
            ):
                if not math.isfinite(value):
                    where = f" on rank {self.rank}" if self.collective else ""
                    self._refuse(
                        f"the loss became {value}{where} (metrics {metrics})",
                        "Lower train.lr, algorithm.loss.clip_low / algorithm.loss.clip_high or "
                        f"{grad_clip}, or check the rewards",
                    )
                for key, metric in metrics.items():
                    weight = (by_tokens if key in token_metrics else scales)[first + offset]
                    totals[key] = totals.get(key, 0.0) + metric * weight / self.dp_size / n_steps
            self._reduce_gradients()
            norm = self._clip()
            if not math.isfinite(norm):
                self._refuse(f"the gradient norm became {norm}", f"Lower train.lr or {grad_clip}")
            self.optimizer.step()
            steps += 1
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + norm
        if self.dp_size > 1:
            totals = summed_over_group(totals, self.dp_group, self.dp_size)
        totals["grad_norm"] = totals.get("grad_norm", 0.0) / max(steps, 1)
        totals["optimizer_steps"] = float(steps)
        return totals

    def _refuse(self, what: str, fix: str) -> None:
        """Drop this step's gradients and raise: model and optimiser keep their last good state."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(f"{what}; the update was not applied. {fix}")

    # ------------------------------------------------------------------ learning rate and residency
    def set_lr(self, lr: float) -> None:
        """Change the learning rate of every parameter group (the SFT stage uses its own)."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def offload(self, *, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters and/or optimiser state to host memory; a tracked no-op on CPU.

        See ``trainer.strategies.offload``: the next call that needs a state reloads it.
        """
        self.residency.offload(params=params, optimizer=optimizer)

    def reload(self) -> None:
        """Bring every offloaded state back onto the device."""
        self.residency.reload()

    # ------------------------------------------------------------------ weights, state (per layout)
    @abc.abstractmethod
    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def save_pretrained(self, path: str) -> None: ...
