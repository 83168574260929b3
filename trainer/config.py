"""The trainer's one typed config tree, loaded from YAML with ``a.b.c=value`` overrides.

Every section is a small pydantic model, a :class:`~trainer.config_section.Section`: unknown
keys are errors and each field has a docstring (shown by ``TrainerConfig.model_json_schema()``
and in error hints). ``load_config`` reads
a YAML file, applies command-line overrides (values parsed as YAML scalars, so ``lr=3e-4``
is a float and ``roles.actor_train.device_mapping=[0,1]`` a list), validates the whole
tree, and reports *every* problem at once with its dotted path and where it came from::

    invalid trainer config examples/run.yaml: 2 problems
      - rollout.group_sise: unknown key; did you mean env.group_size? (at examples/run.yaml:9)
      - train.lr: Input should be greater than 0 (got -0.1) (at override 'train.lr=-0.1')

Field checks run first; checks across sections (the device mapping, the batch splitting
evenly over data-parallel ranks, an unknown env id) run once every field is valid, and are
also reported all together. Derived values (``batch_size``, ``active_roles``,
``device_plan``, ...) are computed once, during validation.

Sections: ``model``, ``env``, ``rollout``, ``algorithm`` (with ``algorithm.loss``),
``train``, ``roles`` (one :class:`RoleConfig` per role), ``cluster``, ``weight_sync``; the
run-lifecycle sections ``checkpoint``, ``eval``, ``sft`` and ``logging`` live in
``trainer.config_lifecycle``, ``env`` and ``rollout`` in ``trainer.config_rollout``,
``algorithm`` in ``trainer.config_algorithm``, ``roles``,
``cluster`` and ``weight_sync`` in ``trainer.config_cluster``; plus ``output_dir`` and ``seed``
at the top.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from trainer.config_algorithm import AlgorithmConfig, LossConfig
from trainer.config_cluster import (
    ROLE_NAMES,
    ClusterConfig,
    RoleConfig,
    RolesConfig,
    WeightSyncConfig,
)
from trainer.config_lifecycle import (
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    SFTConfig,
    own_folder,
)
from trainer.config_rollout import EnvConfig, EnvEntry, RolloutConfig
from trainer.config_section import Section
from trainer.devices import AutoDeviceMapping, DevicePlan
from trainer.errors import ConfigError, Problem
from trainer.models import Architecture, TokenizerKind
from trainer.strategies.registry import INFERENCE_ENGINES

if TYPE_CHECKING:
    from trainer.strategies.base import TrainOptions

_log = logging.getLogger(__name__)

__all__ = [
    "ROLE_NAMES",
    "AlgorithmConfig",
    "ClusterConfig",
    "EnvConfig",
    "EnvEntry",
    "LossConfig",
    "ModelConfig",
    "RoleConfig",
    "RolesConfig",
    "RolloutConfig",
    "TinyModelConfig",
    "TrainConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "load_config",
    "parse_overrides",
]

# --------------------------------------------------------------------------- model


class TinyModelConfig(Section):
    """A small causal LM built from config (no download), for CPU runs and tests."""

    architecture: Architecture = "llama"
    """HF ``model_type`` of the model to build: ``llama`` or ``gpt2``. (``qwen2`` cannot be built
    with a custom tokenizer, as AutoTokenizer forces Qwen2Tokenizer for it; load real Qwen
    checkpoints by path.)"""
    hidden_size: int = Field(default=64, gt=0)
    """Width of the residual stream."""
    num_layers: int = Field(default=2, gt=0)
    """Number of transformer blocks."""
    num_heads: int = Field(default=4, gt=0)
    """Attention heads; must divide ``hidden_size``."""
    num_kv_heads: int | None = Field(default=None, gt=0)
    """Key/value heads (grouped-query attention); None means ``num_heads``."""
    intermediate_size: int = Field(default=256, gt=0)
    """Width of the MLP."""
    max_position_embeddings: int = Field(default=2048, gt=0)
    """Longest sequence (prompt plus all turns) the model accepts."""
    tokenizer: TokenizerKind = "bpe"
    """How to build the tokenizer over the env's texts: ``bpe`` (shortest sequences), ``word`` or
    ``char`` (see ``trainer.models``)."""
    vocab_size: int = Field(default=2048, ge=64)
    """Most entries of the ``bpe`` tokenizer. A small vocabulary keeps the words a task copies
    (names, digits) tokens of their own instead of merging whole frequent sentences into one."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}"
            )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.architecture == "llama" and (head := self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size / num_heads = {head} must be even for llama (rotary embeddings "
                "rotate pairs of each head's dimensions); change hidden_size or num_heads"
            )
        return self


class LoraConfig(Section):
    """Low-rank adapters on the policy (``peft``): only the adapters train; the engines keep the
    base weights and receive the adapters at each sync (``trainer.strategies.lora``)."""

    rank: int = Field(default=8, ge=0)
    """Adapter rank r (``peft.LoraConfig.r``); 0 turns adapters off (full fine-tuning), so a
    config can hold LoRA settings that ``model.lora.rank=8`` switches on."""
    alpha: int | None = Field(default=None, ge=1)
    """Scaling numerator (``lora_alpha``; the update is scaled by alpha / rank); None: 2 x rank."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training. Under PPO it makes the ratio noisy even
    on-policy (the training forward drops, the old log-probs were computed without), and an RL
    run (``train.steps`` > 0) warns so as it starts: keep 0 unless you want that regularisation
    (an SFT-only run is not warned)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (or name suffixes) to adapt, e.g. ``[q_proj, v_proj]``; ``all-linear`` adapts
    every linear layer (GPT-2's ``Conv1D`` too) but the output head, and may start a list:
    ``[all-linear, embed_tokens]`` also adapts the input embedding (input side only, also where
    the head shares its weight). An empty list is refused (it would adapt nothing)."""
    lr: float | None = Field(default=None, gt=0)
    """The adapters' learning rate (RL and, unless ``sft.lr`` is set, the warm start); None:
    ``train.lr``. Adapters usually want a larger rate than full fine-tuning."""
    warm_start: Literal["adapters", "full"] = "adapters"
    """What the warm start (``sft``) trains: the adapters, or every weight (for a model whose
    embeddings and norms must still be learnt, such as the quickstart's randomly initialised
    one); either way it is folded into the base and RL trains fresh adapters."""
    sync: Literal["adapter", "merged"] = "adapter"
    """What each weight sync sends: ``adapter`` (the engines keep the base and load only the
    adapters) or ``merged`` (full weights, adapters merged in: for engines without LoRA)."""
    export: Literal["merged", "adapter"] = "merged"
    """``final_policy/`` as a plain HF model with the adapters merged in, or as a peft adapter
    folder (``adapter_config.json`` + ``adapter_model.safetensors``) beside its base."""

    @field_validator("target_modules")
    @classmethod
    def _adapts_something(cls, targets: list[str] | str) -> list[str] | str:
        if not targets:
            raise ValueError(
                "[] adapts nothing; name the layers to adapt (e.g. [q_proj, v_proj]), use "
                "all-linear, or set model.lora.rank: 0 to train every weight instead"
            )
        return targets


class ModelConfig(Section):
    """The policy: a local HF checkpoint (``path``) or a tiny model built from ``tiny``."""

    path: str | None = None
    """Folder of a HF causal LM (``from_pretrained``; ``~`` is the home folder); must exist where
    the config is loaded and where the workers run (nothing is downloaded)."""
    tiny: TinyModelConfig | None = None
    """Build a small model from this spec instead of loading one (exclusive with ``path``)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """What the engines and the frozen reference hold, each weight sync sends, and training
    computes in on GPUs; the roles that train keep fp32 master weights and AdamW moments
    (``workers.strategy_worker.master_dtype``). ``float16`` trains without loss scaling
    (warned at start: prefer ``bfloat16``)."""
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's own (None: the tokenizer's)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of every weight (``model.lora.rank=8`` turns it on);
    ``hf`` and ``fsdp2`` training strategies. None: full fine-tuning."""

    @field_validator("path")
    @classmethod
    def _path_exists(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).expanduser().exists():
            raise ValueError(
                f"{path!r} does not exist; point model.path at a local save_pretrained "
                "checkpoint folder (with config.json; nothing is downloaded), or use model.tiny "
                "to build a tiny policy"
            )
        if path is not None:
            from trainer.models import weights_problem

            problem = weights_problem(path)
            if problem is not None:
                raise ValueError(problem)
        return path

    @model_validator(mode="after")
    def _lora_off_at_rank_0(self) -> ModelConfig:
        if self.lora is not None and self.lora.rank == 0:
            self.lora = None
        return self

    @model_validator(mode="after")
    def _path_or_tiny(self) -> ModelConfig:
        if self.path is not None and self.tiny is not None:
            raise ValueError(
                "set model.path (a local checkpoint) or model.tiny (build one), not both"
            )
        if self.path is None and self.tiny is None:
            raise ValueError(
                "set model.path (a local HF checkpoint folder) or model.tiny: {} (build a tiny one)"
            )
        return self


class TrainConfig(Section):
    """The optimisation loop of ``actor_train`` (and ``critic``)."""

    lr: float = Field(default=1e-4, gt=0)
    """Adam learning rate of the policy."""
    critic_lr: float | None = Field(default=None, gt=0)
    """Learning rate of the critic; None means ``lr``."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    steps: int = Field(default=100, ge=0)
    """Training steps (each: one rollout batch, then updates)."""
    micro_batch_size: int = Field(default=8, gt=0)
    """Sequences per forward/backward pass on one data-parallel rank (when
    ``micro_batch_tokens`` is unset)."""
    micro_batch_tokens: int | None = Field(default=None, gt=0)
    """Group rows so each micro-batch holds about this many tokens (padding included, or packed
    tokens with ``packing``) instead of ``micro_batch_size`` rows; balanced across data-parallel
    ranks. A row longer than this is its own micro-batch."""
    packing: bool = False
    """Pack several sequences into each row (positions restart per sequence; attention never
    crosses sequences, sliding-window layers keep their window) for training, reference and
    critic passes: no compute on padding. Needs ``eager``, ``sdpa`` or FlashAttention-2/3
    attention and full or sliding-window layers: anything else is refused when the model first
    runs (``trainer.strategies.packing``)."""
    grad_accumulation: int | None = Field(default=None, gt=0)
    """Micro-batches per optimiser step; None accumulates the whole per-rank batch (one step)."""
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this; None disables clipping."""
    ppo_epochs: int = Field(default=1, gt=0)
    """Passes over each rollout batch (PPO-style reuse; the clip keeps later passes close to the
    sampling policy). More passes learn more per rollout at the cost of update time."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How the RL learning rate moves over ``steps``: ``constant``, or ``linear``/``cosine``
    decay from ``lr`` to ``lr * min_lr_ratio`` at the last step (a policy that found the answer
    stops drifting)."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate of a decaying schedule, as a fraction of ``lr``."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warm-up from ``lr / (warmup_steps + 1)`` to ``lr`` (at most ``steps``)."""

    @model_validator(mode="after")
    def _warmup_within_the_run(self) -> TrainConfig:
        if self.warmup_steps > self.steps:
            raise ConfigError(
                [
                    Problem(
                        "train.warmup_steps",
                        f"{self.warmup_steps} warm-up steps are more than the run's "
                        f"train.steps={self.steps}, so the learning rate would never reach "
                        f"train.lr; set train.warmup_steps <= {self.steps}",
                    )
                ]
            )
        return self

    def options(self, lr: float | None = None) -> TrainOptions:
        """What every training strategy takes from this section (``strategies.base.TrainOptions``),
        at learning rate ``lr`` (None: ``train.lr``; the critic passes ``critic_lr``)."""
        return {
            "lr": lr or self.lr,
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
            "micro_batch_size": self.micro_batch_size,
            "micro_batch_tokens": self.micro_batch_tokens,
            "packing": self.packing,
            "grad_accumulation": self.grad_accumulation,
        }

    def lr_at(self, step: int, base: float | None = None) -> float:
        """The policy learning rate of RL step ``step`` (1-based), by ``lr_schedule`` and
        ``warmup_steps``, scaling ``base`` (None: ``lr``; LoRA passes its own rate)."""
        return scheduled_lr(
            step,
            self.steps,
            self.lr if base is None else base,
            self.lr_schedule,
            min_ratio=self.min_lr_ratio,
            warmup=self.warmup_steps,
        )


def scheduled_lr(
    step: int,
    total: int,
    lr: float,
    schedule: Literal["constant", "linear", "cosine"],
    *,
    min_ratio: float = 0.0,
    warmup: int = 0,
) -> float:
    """The learning rate of optimiser step ``step`` (1-based) of ``total``: a linear warm-up
    from ``lr / (warmup + 1)`` over ``warmup`` steps, then ``schedule`` (constant, or a
    linear/cosine decay to ``lr * min_ratio`` at the last step). RL and the warm start share it."""
    import math

    if step <= warmup:
        return lr * step / (warmup + 1)
    if schedule == "constant":
        return lr
    span = max(total - warmup - 1, 1)
    progress = min(max(step - warmup - 1, 0) / span, 1.0)
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_ratio + (1.0 - min_ratio) * shape)


# --------------------------------------------------------------------------- the tree


class TrainerConfig(Section):
    """The whole trainer. Build it with :func:`load_config` or ``TrainerConfig.model_validate``."""

    @field_validator("env", mode="before")
    @classmethod
    def _env_list_is_a_mix(cls, value: Any) -> Any:
        return {"id": value} if isinstance(value, list) else value

    @field_validator("output_dir")
    @classmethod
    def _a_folder_of_its_own(cls, folder: str) -> str:
        return own_folder(folder)

    model: ModelConfig = Field(default_factory=lambda: ModelConfig(tiny=TinyModelConfig()))
    """The policy model."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Environments and batch shape (a list here is shorthand for ``env.id``: a mix)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Episode generation."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantages and loss."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation."""
    roles: RolesConfig = Field(default_factory=RolesConfig)
    """Per-role placement and strategy."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Worker backend and Ray cluster."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """Train -> inference weight sync (buckets, transport)."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """Supervised warm start."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metric sinks."""
    output_dir: str = "runs/latest"
    """Run folder: ``metrics.jsonl``, checkpoints, plots. Printed at start. A folder of the run's
    own (``~`` is the home folder): a fresh start moves a previous run in it aside."""
    seed: int = 0
    """Seed of everything (model init, sampling, env seeds)."""

    _device_plan: DevicePlan | None = PrivateAttr(default=None)

    # -- derived values (computed once, in validation) --------------------------------

    @property
    def batch_size(self) -> int:
        """Episodes per training step: ``env.group_size * env.num_groups`` (at most, when a mix
        gives envs their own group sizes)."""
        return max(self.env.group_sizes) * self.env.num_groups

    @property
    def policy_lr(self) -> float:
        """The policy's RL learning rate: ``model.lora.lr`` when adapters train and it is set,
        else ``train.lr``."""
        lora = self.model.lora
        return lora.lr if lora is not None and lora.lr is not None else self.train.lr

    @property
    def active_roles(self) -> list[str]:
        """Roles this run starts, in creation order (reference/critic only when needed)."""
        active = ["actor_train", "actor_infer"]
        if self.algorithm.needs_reference and self.model.lora is None:
            active.append("reference")  # with LoRA the reference is the actor, adapters off
        if self.algorithm.needs_critic:
            active.append("critic")
        return active

    @property
    def device_plan(self) -> DevicePlan:
        """Colocation groups and per-worker devices of the active roles (not yet node-bound)."""
        if self._device_plan is None:  # only when validation was bypassed (model_construct)
            self._device_plan = self.device_mapping().plan()
        return self._device_plan

    @property
    def local_num_devices(self) -> int:
        """Devices a locally started Ray declares: ``cluster.num_devices``, else the highest
        mapped device id + 1."""
        if self.cluster.num_devices is not None:
            return self.cluster.num_devices
        mapped = [d for name in self.active_roles for d in getattr(self.roles, name).device_mapping]
        return max(mapped, default=0) + 1

    @property
    def checkpoint_dir(self) -> Path:
        """Absolute-or-relative checkpoint folder with ``output_dir`` applied."""
        return Path(self.output_dir) / (self.checkpoint.dir or "checkpoints")

    def device_mapping(self, **kwargs: Any) -> AutoDeviceMapping:
        """An :class:`AutoDeviceMapping` over the active roles (kwargs: ``can_offload``)."""
        roles = {name: getattr(self.roles, name) for name in self.active_roles}
        return AutoDeviceMapping(roles, path_prefix="roles", **kwargs)

    @model_validator(mode="after")
    def _cross_section(self) -> TrainerConfig:
        if self.roles.actor_infer.strategy is None:
            self.roles.actor_infer.strategy = self.rollout.engine
        elif (
            "engine" not in self.rollout.model_fields_set
            and self.roles.actor_infer.strategy in INFERENCE_ENGINES
        ):
            self.rollout.engine = self.roles.actor_infer.strategy  # either key selects the engine
        for role in self.roles.values():
            if role.strategy is None:
                role.strategy = "hf"
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        self._device_plan = self.device_mapping().plan()
        return self

    def problems(self) -> list[Problem]:
        """Every cross-section problem of an otherwise well-typed config (empty when fine): each
        invariant between sections is checked here, once (``trainer._config_checks``)."""
        from trainer._config_checks import cross_section_problems

        return cross_section_problems(self)


def load_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> TrainerConfig:
    """Load ``path`` (YAML; None for defaults only), apply ``a.b.c=value`` overrides, validate.

    Raises :class:`~trainer.errors.ConfigError` listing every problem with its dotted path
    and where the bad value came from (file and line, or the override).
    """
    from trainer._config_io import load_validated

    return load_validated(TrainerConfig, path, list(overrides))


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn ``["a.b=1", "a.c=[0,1]"]`` into ``{"a": {"b": 1, "c": [0, 1]}}`` (YAML scalars)."""
    from trainer._config_io import overrides_to_tree

    tree, problems = overrides_to_tree(list(overrides))
    if problems:
        raise ConfigError(problems)
    return tree
