"""AutoDeviceMapping: from each role's ``device_mapping`` to colocated and disaggregated groups.

Each role names the global device ids it uses (``device_mapping: [0, 1, 2, 3]``) and how
many devices one worker holds (``num_devices_per_worker``); worker ``r`` gets devices
``device_mapping[r*k:(r+1)*k]``. Roles whose device sets overlap (directly or through a
chain of roles) form one *colocation group*: they take turns on the devices, and the
:class:`Colocation` switcher offloads the others' states to CPU memory and reloads the
active role's around each phase. Roles with disjoint devices are *disaggregated* and run
concurrently. A role with an empty mapping runs ``num_workers`` device-less CPU workers.

Global device ids number the devices node by node: with nodes of 4 and 4 devices, ids 0-3
are node 0's and 4-7 node 1's. ``plan(node_devices=[4, 4])`` binds workers to nodes;
without ``node_devices`` (at config load time, before a cluster exists) only the checks
that need no cluster run. Every check runs and all problems are reported at once::

    impossible device mapping: 2 problems
      - roles.actor_train.device_mapping: 3 devices do not split into workers of 2 devices; ...
      - roles.critic.device_mapping: device 9 does not exist: the cluster has 8 devices ...

This module is plain Python (no Ray, no torch). ``trainer.controller.resources``
turns a plan into Ray placement groups; on CPU, devices are a Ray custom resource.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from trainer.errors import DeviceMappingError, Problem

__all__ = [
    "PHASE_ROLES",
    "AutoDeviceMapping",
    "Colocation",
    "ColocationGroup",
    "DevicePlan",
    "Offloadable",
    "RolePlacement",
    "RoleSpec",
    "WorkerSlot",
    "default_can_offload",
    "id_ranges",
]


def local_gpu_count() -> int:
    """The GPUs this process can use (``torch.cuda.device_count()``, which counts only those
    ``CUDA_VISIBLE_DEVICES`` shows); 0 without torch or CUDA. A locally started Ray is told
    this many, so a mapping naming more is refused before it starts (see
    ``trainer._config_layout_checks.local_gpu_problems``)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


def default_can_offload(strategy: str) -> bool | None:
    """Whether ``strategy`` can offload, as ``trainer.strategies.registry`` declares it; None when
    the registry does not know the strategy. A caller may pass its own
    ``AutoDeviceMapping(can_offload=...)``."""
    from trainer.strategies.registry import can_offload

    return can_offload(strategy)


class RoleSpec(Protocol):
    """What the mapping reads from a role's config (``trainer.config.RoleConfig`` fits)."""

    strategy: str | None
    device_mapping: list[int]
    num_devices_per_worker: int
    num_workers: int
    offload_params: bool
    offload_optimizer: bool


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker runs: its global device ids and, once bound, its node and local ids."""

    role: str
    rank: int
    devices: tuple[int, ...]
    """Global device ids (empty for a device-less worker)."""
    node: int | None = None
    """Index of the node in the cluster's node order; None before binding or when device-less."""
    local_devices: tuple[int, ...] | None = None
    """Device ids within the node, in this plan's numbering; on GPU clusters Ray picks the GPU
    of each (``ResourceManager.gpu_ids`` gives those ids, what ``CUDA_VISIBLE_DEVICES`` lists)."""


@dataclass(frozen=True)
class RolePlacement:
    """One role's workers and how it shares devices."""

    role: str
    strategy: str
    workers: tuple[WorkerSlot, ...]
    num_devices_per_worker: int
    offload: bool
    """Whether this role moves its state off the devices while another colocated role runs."""

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for w in self.workers for d in w.devices)


@dataclass(frozen=True)
class ColocationGroup:
    """Roles that share devices (a connected component of overlapping device sets)."""

    roles: tuple[str, ...]
    devices: tuple[int, ...]

    @property
    def colocated(self) -> bool:
        """True when more than one role takes turns on these devices."""
        return len(self.roles) > 1


@dataclass(frozen=True)
class DevicePlan:
    """The validated result: per-role workers and the colocation groups."""

    roles: Mapping[str, RolePlacement]
    groups: tuple[ColocationGroup, ...]
    node_devices: tuple[int, ...] | None = None
    """Devices per node this plan was bound to (None: not bound to a cluster yet)."""

    def group_of(self, role: str) -> ColocationGroup | None:
        """The group holding ``role``; None for device-less roles."""
        return next((g for g in self.groups if role in g.roles), None)

    def colocated(self, a: str, b: str) -> bool:
        """Whether roles ``a`` and ``b`` share devices (e.g. weights sync by shared memory)."""
        group = self.group_of(a)
        return a != b and group is not None and b in group.roles

    def colocated_with(self, role: str) -> tuple[str, ...]:
        """The other roles on ``role``'s devices."""
        group = self.group_of(role)
        return tuple(r for r in group.roles if r != role) if group else ()

    def describe(self) -> str:
        """A few human lines: one per group, for the start-of-run log."""
        lines = []
        for group in self.groups:
            kind = "colocated" if group.colocated else "dedicated"
            lines.append(f"devices {id_ranges(group.devices)}: {', '.join(group.roles)} ({kind})")
        cpu_only = [r for r, p in self.roles.items() if not p.devices]
        if cpu_only:
            lines.append(f"no devices: {', '.join(cpu_only)}")
        return "\n".join(lines)


class AutoDeviceMapping:
    """Validate roles' device mappings and compute a :class:`DevicePlan`.

    ``roles`` maps role name to its config; ``can_offload(strategy)`` answers True/False, or
    None for "unknown here" (then nothing is reported). ``path_prefix`` is the config path of
    the roles section, used in problem paths.
    """

    def __init__(
        self,
        roles: Mapping[str, RoleSpec],
        *,
        can_offload: Callable[[str], bool | None] = default_can_offload,
        path_prefix: str = "roles",
    ) -> None:
        self.roles = dict(roles)
        self.can_offload = can_offload
        self.path_prefix = path_prefix

    def _path(self, role: str, field: str = "device_mapping") -> str:
        return f"{self.path_prefix}.{role}.{field}" if self.path_prefix else f"{role}.{field}"

    # -- checks (each returns problems; all of them always run) -------------------------

    def check_ids(self) -> list[Problem]:
        """Negative or repeated device ids within one role."""
        problems = []
        for role, spec in self.roles.items():
            ids = list(spec.device_mapping)
            bad = sorted({d for d in ids if d < 0})
            if bad:
                problems.append(Problem(self._path(role), f"device ids must be >= 0, got {bad}"))
            dupes = sorted({d for d in ids if ids.count(d) > 1})
            if dupes:
                problems.append(
                    Problem(
                        self._path(role), f"device ids {dupes} are listed twice; list each once"
                    )
                )
        return problems

    def check_world_sizes(self) -> list[Problem]:
        """``num_devices_per_worker`` must divide the number of mapped devices."""
        problems = []
        for role, spec in self.roles.items():
            n, k = len(spec.device_mapping), spec.num_devices_per_worker
            if n and n % k:
                problems.append(
                    Problem(
                        self._path(role),
                        f"{n} devices do not split into workers of {k} devices "
                        f"(num_devices_per_worker={k}); map a multiple of {k} devices or change "
                        "num_devices_per_worker",
                    )
                )
        return problems

    def check_exist(self, node_devices: Sequence[int]) -> list[Problem]:
        """Every mapped device exists in the cluster."""
        total = sum(node_devices)
        problems = []
        for role, spec in self.roles.items():
            missing = sorted({d for d in spec.device_mapping if d >= total})
            if missing:
                have = f"ids 0-{total - 1}" if total else "none"
                noun = "devices" if len(missing) > 1 else "device"
                do = "do" if len(missing) > 1 else "does"
                nodes = f"{len(node_devices)} node{'s' if len(node_devices) != 1 else ''}"
                problems.append(
                    Problem(
                        self._path(role),
                        f"{noun} {id_ranges(missing)} {do} not exist: the cluster has {total} "
                        f"devices ({have}) across {nodes}; use smaller ids or add nodes/devices",
                    )
                )
        return problems

    def check_workers_within_nodes(self, node_devices: Sequence[int]) -> list[Problem]:
        """A worker's devices must all be on one node."""
        total = sum(node_devices)
        problems = []
        for role, spec in self.roles.items():
            for slot in self._slots(role, spec):
                nodes = {_node_of(d, node_devices)[0] for d in slot.devices if 0 <= d < total}
                if len(nodes) > 1:
                    problems.append(
                        Problem(
                            self._path(role),
                            f"worker {slot.rank} would span nodes {sorted(nodes)} "
                            f"(devices {list(slot.devices)}); a worker's devices must be on one "
                            "node: reorder device_mapping or change num_devices_per_worker",
                        )
                    )
        return problems

    def check_colocated_can_offload(self) -> list[Problem]:
        """Roles that share devices must be able to move their state off them."""
        problems = []
        for group in self._groups():
            if len(group.roles) < 2:
                continue
            for role in group.roles:
                strategy = self._strategy(role)
                if self.can_offload(strategy) is False:
                    others = ", ".join(r for r in group.roles if r != role)
                    problems.append(
                        Problem(
                            self._path(role),
                            f"shares devices with {others}, but strategy {strategy!r} cannot "
                            "offload its state; give it devices of its own (disjoint "
                            "device_mapping) or use a strategy that can",
                        )
                    )
        return problems

    def problems(self, node_devices: Sequence[int] | None = None) -> list[Problem]:
        """Every problem; the node checks run only when ``node_devices`` is given."""
        problems = self.check_ids() + self.check_world_sizes() + self.check_colocated_can_offload()
        if node_devices is not None:
            problems += self.check_exist(node_devices) + self.check_workers_within_nodes(
                node_devices
            )
        return problems

    # -- the plan -------------------------------------------------------------------------

    def plan(self, node_devices: Sequence[int] | None = None) -> DevicePlan:
        """Validate and return the plan, bound to nodes when ``node_devices`` is given.

        Raises :class:`~trainer.errors.DeviceMappingError` listing every problem.
        """
        problems = self.problems(node_devices)
        if problems:
            raise DeviceMappingError(problems)
        placements = {}
        for role, spec in self.roles.items():
            slots = self._slots(role, spec)
            if node_devices is not None:
                slots = [_bind(slot, node_devices) for slot in slots]
            placements[role] = RolePlacement(
                role=role,
                strategy=self._strategy(role),
                workers=tuple(slots),
                num_devices_per_worker=spec.num_devices_per_worker,
                offload=bool(spec.offload_params or spec.offload_optimizer),
            )
        nodes = tuple(node_devices) if node_devices is not None else None
        return DevicePlan(roles=placements, groups=tuple(self._groups()), node_devices=nodes)

    def _strategy(self, role: str) -> str:
        return self.roles[role].strategy or "hf"

    def _slots(self, role: str, spec: RoleSpec) -> list[WorkerSlot]:
        ids = list(spec.device_mapping)
        if not ids:
            return [WorkerSlot(role, r, ()) for r in range(spec.num_workers)]
        k = spec.num_devices_per_worker
        return [
            WorkerSlot(role, r, tuple(ids[r * k : (r + 1) * k]))
            for r in range(max(1, len(ids) // k))
        ]

    def _groups(self) -> list[ColocationGroup]:
        """Connected components of roles by shared devices, in role order."""
        with_devices = [r for r, s in self.roles.items() if s.device_mapping]
        parent = {r: r for r in with_devices}

        def find(r: str) -> str:
            while parent[r] != r:
                r = parent[r]
            return r

        for i, a in enumerate(with_devices):
            for b in with_devices[i + 1 :]:
                if set(self.roles[a].device_mapping) & set(self.roles[b].device_mapping):
                    parent[find(b)] = find(a)
        groups: dict[str, list[str]] = {}
        for r in with_devices:
            groups.setdefault(find(r), []).append(r)
        return [
            ColocationGroup(
                tuple(members),
                tuple(sorted({d for m in members for d in self.roles[m].device_mapping})),
            )
            for members in groups.values()
        ]


def _node_of(device: int, node_devices: Sequence[int]) -> tuple[int, int]:
    """(node index, local id) of a global device id."""
    offset = 0
    for node, count in enumerate(node_devices):
        if device < offset + count:
            return node, device - offset
        offset += count
    raise IndexError(device)


def _bind(slot: WorkerSlot, node_devices: Sequence[int]) -> WorkerSlot:
    if not slot.devices:
        return slot
    located = [_node_of(d, node_devices) for d in slot.devices]
    return WorkerSlot(
        slot.role, slot.rank, slot.devices, located[0][0], tuple(local for _, local in located)
    )


def id_ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'``."""
    ids = sorted(set(ids))
    parts, start = [], None
    for i, d in enumerate(ids):
        if start is None:
            start = d
        if i + 1 == len(ids) or ids[i + 1] != d + 1:
            parts.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return ",".join(parts)


# --------------------------------------------------------------------------- phases

PHASE_ROLES: dict[str, tuple[str, ...]] = {
    "rollout": ("actor_infer",),
    "eval": ("actor_infer",),
    "reference": ("reference",),
    "values": ("critic",),
    "train": ("actor_train", "critic"),
    "sync": ("actor_train", "actor_infer"),
}
"""The roles each pipeline phase uses: they are resident during it, colocated others are
offloaded (``AgenticPipeline.phase``; ``trainer.memory`` sizes each device phase by phase)."""


class Offloadable(Protocol):
    """What :class:`Colocation` drives: a role's cluster (``trainer.controller.Cluster`` fits)."""

    def offload(self) -> None:
        """Move the role's device state (weights, optimizer, KV cache) to CPU memory."""

    def reload(self) -> None:
        """Bring the state back onto the devices."""


class Colocation:
    """Switches colocated roles around phases: the active role is resident, the others offloaded.

    ``members`` maps role name to its cluster. Roles start resident (as built). ``activate``
    only offloads roles whose ``offload`` flag is set and that share a group with an
    activated role; disaggregated roles are never touched. Actions are recorded in
    ``history`` as ``("offload"|"reload", role)`` so tests and logs can see the switching.
    """

    def __init__(self, plan: DevicePlan, members: Mapping[str, Offloadable]) -> None:
        self.plan = plan
        self.members = dict(members)
        self.resident: dict[str, bool] = {role: True for role in self.members}
        self.history: list[tuple[str, str]] = []

    def activate(self, *roles: str) -> None:
        """Make ``roles`` resident; offload every other offloadable role sharing their devices."""
        unknown = [r for r in roles if r not in self.members]
        if unknown:
            raise KeyError(f"roles {unknown} have no cluster here; known: {sorted(self.members)}")
        for role in roles:
            for other in self.plan.colocated_with(role):
                if other in roles or other not in self.members or not self.resident[other]:
                    continue
                if self.plan.roles[other].offload:
                    self.members[other].offload()
                    self.resident[other] = False
                    self.history.append(("offload", other))
        for role in roles:
            if not self.resident[role]:
                self.members[role].reload()
                self.resident[role] = True
                self.history.append(("reload", role))

    @contextmanager
    def phase(self, *roles: str) -> Iterator[None]:
        """``with colocation.phase("actor_train"): ...`` — activate, then run the phase."""
        self.activate(*roles)
        yield
