"""The one table of strategy names: which class each name means and what it can do.

``roles.<role>.strategy`` and ``rollout.engine`` are looked up here, and nowhere else: the
config checks (``trainer.config``), the device mapping (``trainer.devices``) and the workers
read the capabilities below without importing torch, and ``make_train_strategy`` /
``make_engine`` import the class only when a worker builds it.

Adding a training strategy is one line in ``TRAIN_STRATEGIES`` and one module whose class
subclasses ``base.BaseTrainStrategy`` (an engine: one line in ``INFERENCE_ENGINES`` and a
factory ``(model_path, *, dtype, seed, **options) -> InferenceEngine``). An unknown name is
refused with the names that exist and a "did you mean" hint.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.strategies.base import InferenceEngine, TrainStrategy

__all__ = [
    "INFERENCE_ENGINES",
    "STATELESS_STRATEGIES",
    "TRAIN_STRATEGIES",
    "EngineSpec",
    "StrategySpec",
    "can_offload",
    "engine_spec",
    "layout_problem",
    "make_engine",
    "make_train_strategy",
    "process_problem",
    "train_strategy_spec",
]


@dataclass(frozen=True)
class _Spec:
    name: str
    target: str
    """``"module:attribute"`` (dots in the attribute walk into it), imported by ``load``."""
    offload: bool = True
    """It can move its state off the devices around colocated phases (``AutoDeviceMapping``)."""

    def load(self) -> Any:
        module, _, attribute = self.target.partition(":")
        found: Any = importlib.import_module(module)
        for part in attribute.split("."):
            found = getattr(found, part)
        return found


@dataclass(frozen=True)
class StrategySpec(_Spec):
    """A training strategy: a ``base.BaseTrainStrategy`` subclass."""

    sharded: bool = False
    """Its ranks build and run the model together (collectives): one process per rank, so a
    multi-rank role needs ``cluster.backend: ray`` and is built by ``setup()`` on all ranks."""
    tensor_parallel: bool = False
    """It takes ``strategy_args.tensor_parallel_size``."""
    pipeline_parallel: bool = False
    """It takes ``strategy_args.pipeline_parallel_size``."""
    lora: bool = False
    """It trains ``peft`` adapters (``model.lora``; ``trainer.strategies.lora``)."""
    packing: bool = False
    """It runs packed rows (``train.packing``; ``trainer.strategies.packing``)."""


@dataclass(frozen=True)
class EngineSpec(_Spec):
    """An inference engine: a factory ``(model_path, *, dtype, seed, **options)`` that returns
    an ``InferenceEngine``."""

    partial_weights: bool = True
    """A weight update may carry only the tensors that changed (``weight_sync.only_changed``)."""
    adapters: bool = True
    """It loads LoRA adapters beside its base weights (``load_adapter``; ``model.lora.sync``)."""


def _table(*specs: _Spec) -> dict[str, Any]:
    return {spec.name: spec for spec in specs}


TRAIN_STRATEGIES: dict[str, StrategySpec] = _table(
    StrategySpec("hf", "trainer.strategies.hf:HFTrainStrategy", lora=True, packing=True),
    StrategySpec(
        "fsdp2",
        "trainer.strategies.fsdp2:FSDP2TrainStrategy",
        sharded=True,
        tensor_parallel=True,
        lora=True,
        packing=True,
    ),
    StrategySpec(
        "megatron",
        "trainer.strategies.megatron:MegatronTrainStrategy",
        sharded=True,
        tensor_parallel=True,
        pipeline_parallel=True,
    ),
)
"""``roles.actor_train/reference/critic.strategy`` -> training strategy."""

INFERENCE_ENGINES: dict[str, EngineSpec] = _table(
    EngineSpec("hf", "trainer.strategies.hf_engine:HFEngine.from_pretrained"),
    EngineSpec("vllm", "trainer.strategies.vllm_engine:VLLMEngine", partial_weights=False),
)
"""``rollout.engine`` (= ``roles.actor_infer.strategy``) -> inference engine factory."""

STATELESS_STRATEGIES = ("function",)
"""Role strategies that hold no device state (the reward role's plain functions)."""


def _lookup(table: Mapping[str, Any], name: str, what: str) -> Any:
    if name in table:
        return table[name]
    close = difflib.get_close_matches(str(name), list(table), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown {what} {name!r}; use one of {', '.join(table)}{hint}")


def train_strategy_spec(name: str | None) -> StrategySpec:
    """The row of training strategy ``name`` (None: ``hf``); ValueError naming the choices."""
    return _lookup(TRAIN_STRATEGIES, name or "hf", "training strategy")


def engine_spec(name: str | None) -> EngineSpec:
    """The row of inference engine ``name`` (None: ``hf``); ValueError naming the choices."""
    return _lookup(INFERENCE_ENGINES, name or "hf", "inference engine")


def can_offload(name: str) -> bool | None:
    """Whether role strategy ``name`` can move its state off the devices; None if unknown."""
    if name in STATELESS_STRATEGIES:
        return True
    spec = TRAIN_STRATEGIES.get(name) or INFERENCE_ENGINES.get(name)
    return None if spec is None else spec.offload


def layout_problem(
    name: str | None, world_size: int, strategy_args: Mapping[str, Any]
) -> tuple[str, str] | None:
    """``(strategy_args key, what is wrong)`` when strategy ``name``'s tensor x pipeline parallel
    layout cannot run on ``world_size`` ranks; None when it can. The one check of the layout:
    ``config.problems()`` reports it with the key path, ``BaseTrainStrategy.create`` raises it."""
    spec = TRAIN_STRATEGIES.get(name or "hf")
    if spec is None:  # an unknown name is refused when the worker builds it
        return None
    tp = strategy_args.get("tensor_parallel_size", 1) if spec.tensor_parallel else 1
    pp = strategy_args.get("pipeline_parallel_size", 1) if spec.pipeline_parallel else 1
    if not isinstance(tp, int) or tp < 1 or world_size % tp:
        return "tensor_parallel_size", (
            f"{tp!r} must be a positive divisor of the role's {world_size} workers "
            "(its device_mapping)"
        )
    if not isinstance(pp, int) or pp < 1 or world_size % (tp * pp):
        return "pipeline_parallel_size", (
            f"{pp!r}: tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} "
            f"must divide the role's {world_size} workers (its device_mapping)"
        )
    return None


def process_problem(name: str | None, world_size: int, backend: str) -> str | None:
    """What is wrong with running ``world_size`` ranks of strategy ``name`` on ``backend``
    (None: nothing): a sharded strategy needs one OS process per rank. The one check:
    ``config.problems()`` and ``StrategyWorker`` (a cluster built without a config) ask here."""
    spec = TRAIN_STRATEGIES.get(name or "hf")
    if spec is None or not spec.sharded or world_size <= 1 or backend == "ray":
        return None
    return (
        f"strategy {spec.name!r} on {world_size} workers needs one process per rank; "
        f"{backend!r} runs workers as threads of one process - set cluster.backend: ray"
    )


def make_train_strategy(
    name: str | None,
    model: Any,
    *,
    world_size: int = 1,
    strategy_args: Mapping[str, Any] | None = None,
    **common: Any,
) -> TrainStrategy:
    """The ``TrainStrategy`` called ``name`` around ``model``, for a role of ``world_size`` ranks.

    ``common`` are the settings every strategy takes (``lr``, ``micro_batch_size``, ...;
    ``base.TrainOptions``); ``strategy_args`` (``roles.<role>.strategy_args``) the strategy's
    own options, e.g. ``tensor_parallel_size`` for ``megatron`` or ``mixed_precision`` for
    ``fsdp2``. A layout the strategy cannot run, or an option it does not have, is refused
    (``BaseTrainStrategy.create``) before anything is built.
    """
    spec = train_strategy_spec(name)
    return spec.load().create(
        model, world_size=world_size, strategy_args=dict(strategy_args or {}), **common
    )


def make_engine(
    name: str | None, model_path: str, *, dtype: str = "float32", seed: int = 0, **options: Any
) -> InferenceEngine:
    """The worker-side engine called ``name`` (``options``: ``roles.actor_infer.strategy_args``)."""
    return engine_spec(name).load()(model_path, dtype=dtype, seed=seed, **options)
