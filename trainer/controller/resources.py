"""``ResourceManager``: binds an AutoDeviceMapping to a live Ray cluster as placement groups.

The Ray layer under :mod:`trainer.devices`. It reads the alive nodes that offer the device
resource (``GPU`` on GPU clusters; a custom resource such as ``envhub_device`` on CPU, so
the same logic runs on any machine), orders them (head node first, then by node id), and
numbers their devices globally in that order. It validates the mapping against those nodes
(every problem at once), then reserves, per node in use, one ``STRICT_PACK`` placement
group pinned to that node (label ``ray.io/node-id``), with one bundle per used device.

Each worker is scheduled into the bundle of its first device and asks for a sliver of the
device resource, so colocated roles share bundles while Ray still keeps other jobs off the
reserved devices. ``actor_options(slot)`` gives the ``.options(...)`` for one worker.

On GPU clusters (``device_resource="GPU"``) Ray makes only the first bundle's GPU visible to
a worker (``CUDA_VISIBLE_DEVICES``), and which physical GPU each bundle got is Ray's choice,
not the node-local device id. So once the groups are reserved, a tiny probe task in each
bundle asks Ray for that bundle's GPU id, once per device; ``gpu_ids(slot)`` gives a worker
the ids of all its devices, first device first, and the worker shows exactly those GPUs to
its process (``trainer.controller.worker``): a tensor-parallel engine sees all of its GPUs,
and colocated workers on one device see the same GPU. Custom device resources have no
GPU ids: there ``gpu_ids`` is None and nothing is probed.

:func:`init_local_ray` starts a single-node Ray for a run on this machine (loopback only,
no dashboard) declaring the devices as a custom resource.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.devices import AutoDeviceMapping, DevicePlan, WorkerSlot
from trainer.errors import DeviceMappingError, Problem, TrainerError

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = [
    "LOOPBACK_NODE_IP",
    "WORKER_DEVICE_SHARE",
    "NodeInfo",
    "ResourceManager",
    "cluster_nodes",
    "init_local_ray",
    "resources_for",
]

WORKER_DEVICE_SHARE = 0.01
"""Amount of the device resource each worker requests inside its bundle (colocation-friendly)."""

LOOPBACK_NODE_IP = "127.0.0.2"
"""Node address for a Ray started on this machine only. Ray replaces ``127.0.0.1`` (and
``localhost``) by the machine's interface address, but keeps any other loopback address, so
this keeps all of Ray's traffic on the loopback interface."""


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node that offers devices."""

    index: int
    node_id: str
    address: str
    num_devices: int
    is_head: bool


def cluster_nodes(device_resource: str) -> list[NodeInfo]:
    """Alive nodes offering ``device_resource``: head first, then by node id."""
    import ray

    nodes = [
        n
        for n in ray.nodes()
        if n.get("Alive") and n.get("Resources", {}).get(device_resource, 0) >= 1
    ]
    nodes.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"]))
    return [
        NodeInfo(
            i,
            n["NodeID"],
            n.get("NodeManagerAddress", ""),
            int(n["Resources"][device_resource]),
            "node:__internal_head__" in n["Resources"],
        )
        for i, n in enumerate(nodes)
    ]


def _missing_resource(device_resource: str) -> Problem:
    """No live Ray node offers ``device_resource``: the problem, with what the nodes do offer."""
    import ray

    found = sorted(
        {
            k
            for n in ray.nodes()
            if n.get("Alive")
            for k in n.get("Resources", {})
            if not k.startswith("node:")
        }
    )
    return Problem(
        "cluster.device_resource",
        f"no Ray node offers the resource {device_resource!r} (resources seen: {found}); start "
        f"Ray with resources={{'{device_resource}': N}} or set cluster.device_resource",
    )


def _node_local_devices(plan: DevicePlan) -> dict[int, list[int]]:
    """Node index -> the node-local device ids that the plan's workers use (sorted, each once)."""
    used: dict[int, set[int]] = {}
    for placement in plan.roles.values():
        for slot in placement.workers:
            if slot.node is not None and slot.local_devices is not None:
                used.setdefault(slot.node, set()).update(slot.local_devices)
    return {node: sorted(ids) for node, ids in sorted(used.items())}


class ResourceManager:
    """Validates a device mapping against the Ray cluster and reserves its devices.

    Raises :class:`~trainer.errors.DeviceMappingError` (all problems at once) when the mapping
    does not fit the cluster, and ``TimeoutError`` when Ray cannot reserve the devices within
    ``timeout_s`` (another job holds them). Call :meth:`shutdown` to release the reservation.
    """

    def __init__(
        self,
        mapping: AutoDeviceMapping,
        *,
        device_resource: str = "envhub_device",
        timeout_s: float = 60.0,
    ) -> None:
        import ray

        if not ray.is_initialized():
            raise DeviceMappingError(
                [
                    Problem(
                        "cluster",
                        "Ray is not initialised; call ray.init(...) "
                        "or trainer.controller.resources.init_local_ray() first",
                    )
                ]
            )
        self.device_resource = device_resource
        self.nodes = cluster_nodes(device_resource)
        if not self.nodes and any(s.device_mapping for s in mapping.roles.values()):
            raise DeviceMappingError([_missing_resource(device_resource), *mapping.problems()])
        self.plan: DevicePlan = mapping.plan([n.num_devices for n in self.nodes])
        self._id = uuid.uuid4().hex[:8]
        self._bundle_of: dict[tuple[int, int], tuple[Any, int]] = {}
        self._gpu_of: dict[tuple[int, int], str] = {}
        """(node index, node-local device id) -> Ray's id of that device's GPU (GPU clusters)."""
        self.placement_groups: list[Any] = []
        self._reserve(_node_local_devices(self.plan), timeout_s)
        if device_resource == "GPU":
            self._probe_gpu_ids(timeout_s)

    def _reserve(self, used: dict[int, list[int]], timeout_s: float) -> None:
        """One ``STRICT_PACK`` placement group per node in ``used`` (node index -> its used
        local device ids), one bundle per device; wait until Ray has reserved them all."""
        from ray.util.placement_group import placement_group

        for node_index, local_ids in used.items():
            node = self.nodes[node_index]
            bundles = [{self.device_resource: 1.0} for _ in local_ids]
            pg = placement_group(
                bundles,
                strategy="STRICT_PACK",
                name=f"envhub-{self._id}-node{node_index}",
                bundle_label_selector=[{"ray.io/node-id": node.node_id}] * len(bundles),
            )
            self.placement_groups.append(pg)
            for bundle_index, local in enumerate(local_ids):
                self._bundle_of[(node_index, local)] = (pg, bundle_index)
        for pg in self.placement_groups:
            if not pg.wait(timeout_s):
                self.shutdown()
                raise TimeoutError(
                    f"Ray could not reserve the mapped devices within {timeout_s:.0f} s (placement "
                    f"group {pg.bundle_specs}); another job may hold them: check `ray status`"
                )

    def _probe_gpu_ids(self, timeout_s: float) -> None:
        """Learn each bundle's GPU id: one task per bundle, asking Ray what it assigned there
        (``ray.get_gpu_ids()``, the id Ray would put in ``CUDA_VISIBLE_DEVICES``)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = ray.remote(num_cpus=0, num_gpus=WORKER_DEVICE_SHARE)(_bundle_gpu_ids)
        devices = list(self._bundle_of)
        answers = [
            probe.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle_index
                )
            ).remote()
            for pg, bundle_index in self._bundle_of.values()
        ]
        try:
            found = ray.get(answers, timeout=timeout_s)
        except BaseException as error:  # a worker that cannot start, Ctrl-C: free the devices
            self.shutdown()
            if isinstance(error, ray.exceptions.GetTimeoutError):
                why = f"it did not run within {timeout_s:.0f} s; see `ray status` for pending tasks"
            elif isinstance(error, Exception):
                said = str(error).strip().splitlines() or [type(error).__name__]
                why = f"it failed: {said[-1]}; check the GPU nodes"
            else:
                raise
            raise TrainerError(
                f"Ray's task that asks each reserved GPU bundle its GPU id (for the workers' "
                f"CUDA_VISIBLE_DEVICES) could not answer, so the devices were freed: {why}"
            ) from None
        for (node_index, local), ids in zip(devices, found, strict=True):
            if len(ids) != 1:
                self.shutdown()
                raise DeviceMappingError(
                    [
                        Problem(
                            "cluster.device_resource",
                            f"node {node_index} device {local}: Ray assigned GPU ids {ids} to its "
                            "bundle of one GPU, expected one id; check the node's GPUs "
                            "(`ray status`, CUDA_VISIBLE_DEVICES of the raylet)",
                        )
                    ]
                )
            self._gpu_of[(node_index, local)] = ids[0]

    def gpu_ids(self, slot: WorkerSlot) -> tuple[str, ...] | None:
        """Ray's GPU ids of the devices of the worker in ``slot``, in its device order (what its
        ``CUDA_VISIBLE_DEVICES`` lists); None off GPU clusters or for a device-less worker."""
        if self.device_resource != "GPU" or not slot.devices:
            return None
        if slot.node is None or slot.local_devices is None:
            raise DeviceMappingError(
                [Problem(f"roles.{slot.role}", f"worker {slot.rank} is not bound to a node")]
            )
        return tuple(self._gpu_of[(slot.node, local)] for local in slot.local_devices)

    def actor_options(self, slot: WorkerSlot) -> dict[str, Any]:
        """``ray.remote(...).options(**actor_options(slot))`` for the worker in ``slot``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not slot.devices:
            return {"num_cpus": 0}
        if slot.node is None or slot.local_devices is None:
            raise DeviceMappingError(
                [Problem(f"roles.{slot.role}", f"worker {slot.rank} is not bound to a node")]
            )
        pg, bundle_index = self._bundle_of[(slot.node, slot.local_devices[0])]
        options: dict[str, Any] = {
            "num_cpus": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_index
            ),
        }
        if self.device_resource == "GPU":
            options["num_gpus"] = WORKER_DEVICE_SHARE
        else:
            options["resources"] = {self.device_resource: WORKER_DEVICE_SHARE}
        return options

    def node_id(self, node_index: int) -> str:
        """Ray node id of node ``node_index`` in this manager's order."""
        return self.nodes[node_index].node_id

    def shutdown(self) -> None:
        """Release every placement group (safe to call twice)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for pg in self.placement_groups:
            if ray.is_initialized():
                try:
                    remove_placement_group(pg)
                except (ValueError, ray.exceptions.RayError):
                    pass  # removed already (Ray says "not found"), or the GCS is gone with it
        self.placement_groups = []
        self._bundle_of = {}
        self._gpu_of = {}


def _bundle_gpu_ids() -> list[str]:
    """In a probe task: the GPU ids Ray assigned it (those of its placement-group bundle)."""
    import ray

    return [str(gpu) for gpu in ray.get_gpu_ids()]


QUIET_WORKERS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
"""The environment every worker of a local Ray starts with: no per-load progress bars ("Loading
weights") or advisory warnings of transformers in the run's output, as in the driver
(``trainer.pipeline._quiet_libraries``); errors still show."""


def init_local_ray(
    num_devices: int,
    *,
    device_resource: str = "envhub_device",
    num_cpus: int | None = None,
    env_vars: dict[str, str] | None = None,
    **kwargs: Any,
) -> None:
    """Start a new single-node Ray declaring ``num_devices`` of ``device_resource``.

    It listens on :data:`LOOPBACK_NODE_IP` only, with no dashboard, and never joins a Ray
    another process started (``address="local"``). No-op if Ray is already initialised in
    this process. ``env_vars`` reach every worker process (via the job's runtime env), over
    :data:`QUIET_WORKERS`; ``kwargs`` go to ``ray.init``. Ray's own INFO lines ("Started a local
    Ray instance") are left out (``logging_level`` WARNING), and so is its notice, on every
    start, that a new local cluster authenticates with a token (its default, kept).
    """
    import logging

    import ray

    if ray.is_initialized():
        return
    _start_reaper()
    kwargs.setdefault("logging_level", logging.WARNING)
    runtime_env = {"env_vars": {**QUIET_WORKERS, **(env_vars or {})}}
    if device_resource == "GPU":  # Ray declares GPUs itself, never as a custom resource
        devices: dict[str, Any] = {"num_gpus": num_devices}
    else:
        devices = {"resources": {device_resource: float(num_devices)}}
    with keep_sigterm_handler(), _quiet_logger(AUTH_NOTICES):
        ray.init(
            address="local",
            num_cpus=num_cpus,
            **devices,
            include_dashboard=False,
            _node_ip_address=LOOPBACK_NODE_IP,
            runtime_env=runtime_env,
            **kwargs,
        )


AUTH_NOTICES = "ray._private.authentication.authentication_token_setup"
"""The Ray module that announces the authentication mode a new cluster starts with."""


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Around a call: the logger ``name`` passes errors only."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def keep_sigterm_handler() -> Iterator[None]:
    """Around ``ray.init``: a SIGTERM handler this process set in Python stays. Ray installs its
    own, which aborts the process with a stack dump, so ``envhub train``'s orderly stop (workers
    shut down, as for Ctrl-C) would never run."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


_reaper: subprocess.Popen[bytes] | None = None


def _start_reaper() -> None:
    """Start ``ray_reaper`` beside this process (once): a ``kill -9`` of it would otherwise
    leave Ray's agents running forever (see that module)."""
    global _reaper
    if _reaper is None and sys.platform.startswith("linux"):
        _reaper = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("ray_reaper.py")), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


def resources_for(config: TrainerConfig, **mapping_kwargs: Any) -> ResourceManager | None:
    """The resource manager a run of ``config`` uses; None for ``cluster.backend: local``.

    Joins ``cluster.address`` or starts a local Ray with ``config.local_num_devices``
    devices, then validates and reserves the active roles' devices. ``mapping_kwargs`` go to
    :meth:`TrainerConfig.device_mapping` (e.g. ``can_offload=`` from the strategies).
    """
    if config.cluster.backend == "local":
        return None
    import ray

    cluster = config.cluster
    if not ray.is_initialized():
        if cluster.address is None:
            from trainer._config_layout_checks import local_device_problems

            problems = local_device_problems(config)
            if problems:  # before Ray declares GPUs this machine lacks
                raise DeviceMappingError(problems)
            init_local_ray(
                config.local_num_devices,
                device_resource=cluster.device_resource,
                num_cpus=cluster.num_cpus,
            )
        else:
            _join_ray(cluster.address)
    elif cluster.address is not None:
        _check_joined(cluster.address)
    try:
        return ResourceManager(
            config.device_mapping(**mapping_kwargs),
            device_resource=cluster.device_resource,
            timeout_s=cluster.reserve_timeout_s,
        )
    except TimeoutError as error:  # the devices stay taken
        where = f"cluster.address {cluster.address!r}" if cluster.address else "the local Ray"
        raise TrainerError(
            f"{where}: {error}; wait for that job to end, map devices that are free "
            "(roles.*.device_mapping), or wait longer (cluster.reserve_timeout_s)"
        ) from None


def _check_joined(address: str) -> None:
    """In a process already on Ray (an earlier run, or the user's ``ray.init``), refuse a
    ``host:port`` ``cluster.address`` naming another cluster: Ray joins once per process, so the
    run would go to the connected one, silently. ``auto`` and ``ray://`` addresses are not
    compared (they name no GCS address)."""
    import ray

    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    current = str(ray.get_runtime_context().gcs_address)
    here_host, _, here_port = current.rpartition(":")
    try:
        same = (socket.gethostbyname(host), port) == (socket.gethostbyname(here_host), here_port)
    except OSError:
        same = False
    if not same:
        raise TrainerError(
            f"cluster.address {address!r}: this process is already connected to the Ray "
            f"cluster at {current} (an earlier run or ray.init here), and Ray joins one cluster "
            "per process; call ray.shutdown() first, or start the run in a new process"
        )


def _join_ray(address: str) -> None:
    """``ray.init(address=...)``, refused as one ``TrainerError`` naming the address and the fix.

    A ``host:port`` that answers no TCP connection is refused at once: Ray itself retries such
    an address for minutes, printing a warning every few seconds."""
    import ray

    fix = (
        "check the address (`ray status` on the cluster's head node prints it), that this machine "
        "may join it (RAY_AUTH_TOKEN), or remove cluster.address to start a local Ray"
    )
    host, _, port = address.rpartition(":")
    if "://" not in address and host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as error:
            raise TrainerError(
                f"cluster.address {address!r}: cannot join the Ray cluster (nothing answers "
                f"there: {error}); {fix}"
            ) from None
    try:
        with keep_sigterm_handler():
            ray.init(address=address)
    except (ConnectionError, RuntimeError, ValueError) as error:
        ray.shutdown()  # a half-made connection would make the next ray.init a no-op
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise TrainerError(
            f"cluster.address {address!r}: cannot join the Ray cluster "
            f"({type(error).__name__}: {first}); {fix}"
        ) from None
