"""The ``roles``, ``cluster`` and ``weight_sync`` sections of the trainer config: where each
role's workers run (devices, worker counts, strategy), the Ray cluster they run on, and how
trained weights reach the inference engines. They are parts of the tree in ``trainer.config``;
build the whole config with ``trainer.config.load_config``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from trainer.config_section import Section
from trainer.devices import AutoDeviceMapping
from trainer.errors import ConfigError

__all__ = ["ROLE_NAMES", "ClusterConfig", "RoleConfig", "RolesConfig", "WeightSyncConfig"]

ROLE_NAMES: tuple[str, ...] = ("actor_train", "actor_infer", "reference", "critic", "reward")
"""Every role the trainer knows, in the order clusters are created."""


class RoleConfig(Section):
    """Where and how one role's workers run."""

    strategy: str | None = None
    """Strategy name (``hf``, ``fsdp2``, ``megatron``, ``vllm``, ...); None: the role's default."""
    device_mapping: list[int] = Field(default_factory=lambda: [0])
    """Global device ids this role uses; empty runs device-less CPU workers (``num_workers``)."""
    num_devices_per_worker: int = Field(default=1, gt=0)
    """Devices each worker holds; must divide ``len(device_mapping)``."""
    num_workers: int = Field(default=1, gt=0)
    """Worker count when ``device_mapping`` is empty (otherwise derived from the mapping)."""
    offload_params: bool = True
    """When colocated, move parameters to CPU memory while another role uses the devices."""
    offload_optimizer: bool = True
    """When colocated, move optimizer state to CPU memory between train phases."""
    strategy_args: dict[str, Any] = Field(default_factory=dict)
    """Strategy-specific settings (parallel sizes, engine options), passed through as is."""

    @property
    def world_size(self) -> int:
        """Number of workers of this role."""
        if not self.device_mapping:
            return self.num_workers
        return max(1, len(self.device_mapping) // self.num_devices_per_worker)


class RolesConfig(Section):
    """One entry per role. Roles the algorithm does not need are not started."""

    actor_train: RoleConfig = Field(default_factory=lambda: RoleConfig(strategy="hf"))
    """The trained policy."""
    actor_infer: RoleConfig = Field(default_factory=RoleConfig)
    """Rollout generation; its strategy defaults to ``rollout.engine``."""
    reference: RoleConfig = Field(default_factory=lambda: RoleConfig(strategy="hf"))
    """Frozen initial policy for the KL term (started only when ``algorithm.loss.kl_coef > 0``)."""
    critic: RoleConfig = Field(default_factory=lambda: RoleConfig(strategy="hf"))
    """Value model (started only for ``algorithm.advantage_estimator: gae``)."""
    reward: RoleConfig = Field(
        default_factory=lambda: RoleConfig(strategy="function", device_mapping=[])
    )
    """Reward workers scoring what envs don't (started only when reward functions are set)."""

    @model_validator(mode="after")
    def _mappings_well_formed(self) -> RolesConfig:
        # Per-role checks run here so they are reported together with other field errors;
        # colocation checks need the active roles and run on the whole tree.
        mapping = AutoDeviceMapping(dict(self.items()), path_prefix="roles")
        problems = mapping.check_ids() + mapping.check_world_sizes()
        if problems:
            raise ConfigError(problems)
        return self

    def items(self) -> list[tuple[str, RoleConfig]]:
        """``(name, config)`` for every role, in :data:`ROLE_NAMES` order."""
        return [(name, getattr(self, name)) for name in ROLE_NAMES]

    def values(self) -> list[RoleConfig]:
        """Every role's config, in :data:`ROLE_NAMES` order."""
        return [config for _, config in self.items()]


class ClusterConfig(Section):
    """Where workers run: in-process, a local Ray started for the run, or a Ray cluster."""

    backend: Literal["ray", "local"] = "ray"
    """``ray``: each worker is a Ray actor; ``local``: workers are objects in this process."""
    address: str | None = None
    """Ray address to join (``auto`` or ``host:port``); None starts a local Ray for the run."""
    device_resource: str = "envhub_device"
    """Ray resource that stands for one device: ``GPU`` on GPU clusters, a custom one on CPU."""
    num_devices: int | None = Field(default=None, gt=0)
    """Devices a locally started Ray declares; None: enough for the highest mapped device id."""
    num_cpus: int | None = Field(default=None, gt=0)
    """CPUs a locally started Ray declares; None: all of this machine's."""
    device_memory_gib: float | None = Field(default=None, gt=0)
    """Memory of one device in GiB, for the fit check (``trainer.memory``): a run whose estimate
    exceeds it on any device is refused before it starts. None: 80 when ``device_resource`` is
    ``GPU``; otherwise devices stand for host memory and nothing is refused."""
    reserve_timeout_s: float = Field(default=60.0, gt=0)
    """How long the run waits for Ray to reserve its mapped devices (another job may hold them
    on a shared cluster) before it stops with an error."""
    check_memory: bool = True
    """Refuse a run whose memory estimate does not fit its devices; false skips the refusal
    (``envhub train --dry-run`` still prints the estimate)."""


class WeightSyncConfig(Section):
    """How trained weights reach the inference engines after each step
    (``trainer.weights.sync``)."""

    transport: Literal["auto", "shared_memory", "broadcast"] = "auto"
    """``shared_memory`` (colocated: each trainer rank writes its shards into shared-memory
    buckets kept across syncs - one host copy of the model; gathered CUDA IPC on GPU),
    ``broadcast`` (a collective group between trainer rank 0 and the inference workers), or
    ``auto``: shared memory when they share a host."""
    bucket_mb: float | None = Field(default=None, gt=0)
    """Largest bucket in MiB; must hold the largest single tensor. None: 256, or the largest
    tensor when that is bigger."""
    only_changed: bool = False
    """Send only tensors that changed since the last sync (costs one host copy of the model)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a sync waits on any one step: the broadcast group's rendezvous and each
    collective, an engine taking a shared-memory bucket, an engine completing its update. A
    step that takes longer fails the sync with an error naming the engine and bucket; the
    engines then refuse to generate until a later sync completes."""
