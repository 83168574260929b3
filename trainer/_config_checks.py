"""The invariants between config sections, each checked once: ``TrainerConfig.problems()``.

A single section validates itself (pydantic field constraints and its own validators in
``trainer.config``); what needs two sections - the engine named twice, a batch that must
split over the trainer ranks, device mappings, parallel layouts (``registry.layout_problem``,
``registry.process_problem``), weight-sync buckets against the model, env ids against the
registry, env kwargs with a remote hub, the agent's code, and whether the run fits its devices'
memory (``trainer.memory``) - is here, reported with its key path and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.errors import Problem
from trainer.strategies.registry import (
    TRAIN_STRATEGIES,
    engine_spec,
    layout_problem,
    process_problem,
)

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = ["cross_section_problems"]


def cross_section_problems(cfg: TrainerConfig) -> list[Problem]:
    """Every cross-section problem of ``cfg`` (empty when fine)."""
    problems: list[Problem] = []
    if cfg.roles.actor_infer.strategy != cfg.rollout.engine:
        problems.append(
            Problem(
                "roles.actor_infer.strategy",
                f"{cfg.roles.actor_infer.strategy!r} disagrees with "
                f"rollout.engine={cfg.rollout.engine!r}; set only rollout.engine",
            )
        )
    dp = cfg.roles.actor_train.world_size
    if cfg.batch_size % dp and len(set(cfg.env.group_sizes)) == 1:
        problems.append(
            Problem(
                "env.num_groups",
                f"the batch of {cfg.batch_size} episodes (env.group_size * env.num_groups) does "
                f"not split evenly over the {dp} actor_train workers; make it a multiple of {dp}",
            )
        )
    problems.extend(cfg.device_mapping().problems())
    problems.extend(_parallel_problems(cfg))
    if cfg.env.hub is None:
        problems.extend(_unknown_env_ids(cfg.env.ids))
    elif cfg.env.kwargs or cfg.env.eval_kwargs() or any(e.kwargs for e in cfg.env.entries):
        problems.append(
            Problem(
                "env.kwargs",
                f"env kwargs cannot be sent to the remote hub {cfg.env.hub!r}; "
                "configure the env where the hub serves it, or remove env.kwargs",
            )
        )
    if cfg.algorithm.advantage_estimator == "gigpo" and cfg.rollout.sample_unit != "turn":
        problems.append(
            Problem(
                "algorithm.advantage_estimator",
                "gigpo compares turns that answered the same state, so it trains one sample per "
                f"turn; set rollout.sample_unit: turn (it is {cfg.rollout.sample_unit!r}, which "
                "may train whole episodes)",
            )
        )
    if cfg.rollout.route_in_workers and cfg.cluster.backend != "ray":
        problems.append(
            Problem(
                "rollout.route_in_workers",
                "env workers route their turns to the actor_infer workers' Ray actors, and with "
                f"cluster.backend: {cfg.cluster.backend} those live in the driver; set "
                "cluster.backend: ray, or rollout.route_in_workers: false",
            )
        )
    problems.extend(_agent_problems(cfg))
    problems.extend(_lora_problems(cfg))
    if cfg.train.packing:
        for name in ("actor_train", "reference", "critic"):
            spec = TRAIN_STRATEGIES.get(getattr(cfg.roles, name).strategy or "hf")
            if name in cfg.active_roles and spec is not None and not spec.packing:
                able = [n for n, s in TRAIN_STRATEGIES.items() if s.packing]
                problems.append(
                    Problem(
                        "train.packing",
                        f"roles.{name}.strategy={spec.name!r} does not run packed rows; use one "
                        f"of {able} or set train.packing: false",
                    )
                )
    if not problems:  # the estimate needs a valid device plan and layouts
        problems.extend(_memory_problems(cfg))
    return problems


def _lora_problems(cfg: TrainerConfig) -> list[Problem]:
    """``model.lora``: a training strategy that can hold adapters, an engine that can load them."""
    lora = cfg.model.lora
    if lora is None:
        return []
    problems = []
    strategy = cfg.roles.actor_train.strategy or "hf"
    spec = TRAIN_STRATEGIES.get(strategy)
    if spec is not None and not spec.lora:
        able = [name for name, s in TRAIN_STRATEGIES.items() if s.lora]
        problems.append(
            Problem(
                "model.lora",
                f"roles.actor_train.strategy={strategy!r} cannot train adapters (it trains every "
                f"weight); use one of {able} or drop model.lora",
            )
        )
    if lora.sync == "adapter" and not engine_spec(cfg.rollout.engine).adapters:
        problems.append(
            Problem(
                "model.lora.sync",
                f"the {cfg.rollout.engine!r} engine cannot load adapters; set "
                "model.lora.sync: merged",
            )
        )
    return problems


def _memory_problems(cfg: TrainerConfig) -> list[Problem]:
    """A device whose estimated peak exceeds its capacity, or a vLLM KV cache too small to start
    (``trainer.memory``); nothing when there is no config.json to estimate from (the run says so
    when it starts) or ``cluster.check_memory`` is off."""
    if not cfg.cluster.check_memory:
        return []
    from trainer.memory import estimate
    from trainer.memory_roles import StrategyArgError
    from trainer.model_shape import UnknownModelShape

    try:
        plan = estimate(cfg)
    except (OSError, UnknownModelShape):
        return []
    except StrategyArgError as error:
        return [Problem(error.path, str(error))]
    return plan.problems()


def _agent_problems(cfg: TrainerConfig) -> list[Problem]:
    """``rollout.agent``: the function imports, the program exists (before any model loads)."""
    agent = cfg.rollout.agent
    if agent is None:
        return []
    if agent.callable is not None:
        from trainer.rollout.agents import load_agent

        try:
            load_agent(agent.callable)
        except ValueError as error:
            return [
                Problem(
                    "rollout.agent.callable", str(error).removeprefix("rollout.agent.callable: ")
                )
            ]
        return []
    import shlex
    import shutil

    command = shlex.split(agent.command) if isinstance(agent.command, str) else agent.command
    if command and shutil.which(command[0]) is None:
        return [
            Problem(
                "rollout.agent.command",
                f"{command[0]!r} is not an executable on PATH; give its full path",
            )
        ]
    return []


def _parallel_problems(cfg: TrainerConfig) -> list[Problem]:
    """Sharded training strategies and the weight sync: layouts that cannot run, with the fix."""
    from trainer.weights.buckets import largest_tensor

    problems = []
    actor = cfg.roles.actor_train
    for name in ("actor_train", "reference", "critic"):
        role = getattr(cfg.roles, name)
        if name in cfg.active_roles and (
            problem := process_problem(role.strategy, role.world_size, cfg.cluster.backend)
        ):
            problems.append(Problem("cluster.backend", f"{name} {problem}"))
    if (
        layout := layout_problem(actor.strategy, actor.world_size, actor.strategy_args)
    ) is not None:
        problems.append(Problem(f"roles.actor_train.strategy_args.{layout[0]}", layout[1]))
    largest = largest_tensor(cfg.model.path, cfg.model.dtype) if cfg.model.path else None
    bucket_mb = cfg.weight_sync.bucket_mb
    if bucket_mb is not None and largest and largest[1] > bucket_mb * 2**20:
        tensor_name, tensor_bytes = largest
        problems.append(
            Problem(
                "weight_sync.bucket_mb",
                f"{bucket_mb:g} MiB cannot hold {tensor_name} of {cfg.model.path} "
                f"({tensor_bytes / 2**20:.1f} MiB in {cfg.model.dtype}); set "
                f"weight_sync.bucket_mb >= {-(-tensor_bytes // 2**20)} or leave it unset",
            )
        )
    if cfg.weight_sync.only_changed and not engine_spec(cfg.rollout.engine).partial_weights:
        problems.append(
            Problem(
                "weight_sync.only_changed",
                "vLLM reloads whole layers, so every sync must carry every tensor; set "
                "weight_sync.only_changed: false",
            )
        )
    return problems


def _unknown_env_ids(ids: list[str]) -> list[Problem]:
    import envhub  # the registry (lazy: loading it discovers plugins)

    problems = []
    for i, env_id in enumerate(ids):
        try:
            envhub.spec(env_id)
        except KeyError as err:  # UnknownEnvError / RegistrationError carry the hint
            path = "env.id" if len(ids) == 1 else f"env.id[{i}]"
            problems.append(Problem(path, str(err)))
    return problems
