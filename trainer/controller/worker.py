"""``Worker``: the base class of every role's worker (actor, critic, reference, infer, reward).

A worker is one rank of a role. The cluster builds it as ``worker_cls(ctx, config,
**worker_kwargs)``: ``ctx`` says who and where it is (role, rank, world size, its devices),
``config`` is the role's config (``trainer.config.RoleConfig`` or whatever the role's
cluster passes). The same class runs in-process (``backend="local"``) or as a Ray actor
(``backend="ray"``); it never imports Ray itself.

Methods a driver may call through the cluster are marked with
:func:`~trainer.controller.dispatch.register`. Two hooks matter to AutoDeviceMapping:
``offload()`` moves the worker's device state (weights, optimizer, caches) to CPU memory so
a colocated role can use the devices, and ``reload()`` brings it back. Both default to
bookkeeping only; roles with device state override them (undecorated overrides keep the
base's registration).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from trainer.controller.dispatch import Collect, Dispatch, register

__all__ = ["DEVICES_ENV", "GPUS_ENV", "Worker", "WorkerContext", "node_address"]

DEVICES_ENV = "ENVHUB_DEVICES"
"""Environment variable holding a worker's node-local device ids, comma-separated."""
GPUS_ENV = "CUDA_VISIBLE_DEVICES"
"""The GPUs a worker's process (and the processes it starts) may use, comma-separated."""


@dataclass(frozen=True)
class WorkerContext:
    """Who and where a worker is. Plain data: picklable, printable."""

    role: str
    rank: int
    world_size: int
    devices: tuple[int, ...] = ()
    """Global device ids of this worker (empty for device-less workers)."""
    local_devices: tuple[int, ...] | None = None
    """Node-local device ids, once bound to a cluster; None in-process without a binding."""
    node: int | None = None
    """Node index in the resource manager's node order (None when not bound)."""
    gpu_ids: tuple[str, ...] | None = None
    """Ray's ids of the GPUs of ``local_devices``, in that order (on GPU clusters: not always
    the local ids); None off GPU clusters (``ResourceManager.gpu_ids``)."""
    local_rank: int = 0
    """Rank among this role's workers on the same node."""
    backend: str = "local"
    """``local`` or ``ray``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything the creating cluster wants every rank to know (seeds, run folder, ...)."""


def node_address() -> str:
    """This host's address as the cluster sees it (Ray's node IP), or loopback without Ray."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return "127.0.0.1"


class Worker:
    """One rank of a role. Subclass it, add ``@register``-ed methods, override the hooks."""

    def __init__(self, ctx: WorkerContext, config: Any = None) -> None:
        self.ctx = ctx
        self.config = config
        self.offloaded = False
        """True between ``offload()`` and ``reload()``."""
        if ctx.backend == "ray":  # own process: publish the devices before any library reads them
            local = ctx.local_devices if ctx.local_devices is not None else ctx.devices
            os.environ[DEVICES_ENV] = ",".join(map(str, local))
            if ctx.gpu_ids:  # Ray showed only the first device's GPU: show all, first device first
                os.environ[GPUS_ENV] = ",".join(ctx.gpu_ids)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def role(self) -> str:
        return self.ctx.role

    # -- hooks for colocation ----------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def offload(self) -> None:
        """Move device state to CPU memory. Override in roles with device state; call super()."""
        self.offloaded = True

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def reload(self) -> None:
        """Bring device state back after :meth:`offload`. Override it together with
        :meth:`offload`, and call super()."""
        self.offloaded = False

    # -- introspection, used by tests and the start-of-run log ---------------------------

    @register(Dispatch.ONE_TO_ALL)
    def node_info(self) -> dict[str, Any]:
        """Where this rank actually runs: host, pid, Ray node id, devices it was given."""
        node_id = None
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
        return {
            "role": self.role,
            "rank": self.rank,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_id": node_id,
            "node": self.ctx.node,
            "devices": list(self.ctx.devices),
            "local_devices": None
            if self.ctx.local_devices is None
            else list(self.ctx.local_devices),
            "devices_env": os.environ.get(DEVICES_ENV),
            "offloaded": self.offloaded,
        }

    # -- torch.distributed rendezvous (used by the cluster, Ray backend) ----------------

    @register(Dispatch.RANK_ZERO)
    def _rendezvous_address(self) -> tuple[str, int]:
        """An address and a free port on rank 0's host for ``torch.distributed`` init."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return node_address(), int(sock.getsockname()[1])

    @register(Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def _set_distributed_env(self, master_addr: str, master_port: int) -> None:
        """Export the variables ``torch.distributed.init_process_group`` reads (env:// init)."""
        os.environ.update(
            {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.ctx.local_rank),
            }
        )
