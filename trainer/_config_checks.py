"""The invariants between config sections, each checked once: ``TrainerConfig.problems()``.

A single section validates itself (pydantic field constraints and its own validators in
``trainer.config``); what needs two sections - the engine named twice, the training strategies
(their names, layouts and ``strategy_args``, asked of ``trainer.strategies``), a batch that must
split over the trainer ranks, groups a group baseline can compare, device mappings, parallel
layouts (``registry.layout_problem``, ``registry.process_problem``), what a strategy or engine
refuses of this model when it builds (megatron's layouts and converter, fsdp2's tensor
parallelism, the ``hf`` engine's options, engine arguments the worker passes itself, LoRA on a
tied output head or embedding: ``trainer._config_layout_checks``), what the adapters and packing
need of the strategies, the engine and the model (``trainer._config_model_checks``: LoRA targets
the model has, vLLM's largest LoRA rank, no packing of ALiBi attention), weight-sync buckets against
the model, env ids and kwargs against the registry, env kwargs with a remote hub, reward domains
against the env ids, the checkpoint folder against the run's, the agent's code, the model's
tokenizer and the envs' experts (``trainer._config_start_checks``), and whether the run fits its
devices' memory (``trainer.memory``) - is here, reported with its key path and the fix.
``envhub train --dry-run`` loads the config as the run does, so it refuses all of these too.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from trainer._config_layout_checks import (
    WORKER_ENGINE_ARGS,
    engine_argument_problems,
    fsdp2_tensor_parallel_problems,
    sink_problems,
    tied_embedding_problems,
    vllm_option_problems,
)
from trainer._config_model_checks import lora_problems, packing_problems
from trainer._config_start_checks import start_problems
from trainer.config_lifecycle import shared_folder
from trainer.errors import Problem
from trainer.strategies.registry import (
    engine_spec,
    layout_problem,
    process_problem,
    train_strategy_spec,
)

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = ["cross_section_problems"]

GROUP_ESTIMATORS = ("grpo", "rloo", "gigpo")
"""Advantage estimators whose baseline is the other episodes of a group
(``trainer.algos.advantages``): a group of one episode gives every advantage 0."""

TRAIN_ROLES = ("actor_train", "reference", "critic")
"""Roles built by a training strategy (``TRAIN_STRATEGIES``); the others run an engine or
plain functions."""

ENGINE_ARGS_OF_THE_WORKER = tuple(WORKER_ENGINE_ARGS)
"""Engine factory arguments the ``actor_infer`` worker passes itself (``InferWorker``): not
``strategy_args`` (``engine_argument_problems`` refuses them there, naming the key to set)."""


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
    strategy_problems = _strategy_problems(cfg)
    problems.extend(strategy_problems)
    refused = {p.path for p in strategy_problems}
    problems.extend(_megatron_problems(cfg, refused))
    needs_policy = cfg.model.lora is not None or cfg.train.packing or _fsdp2_tp(cfg)
    policy = _policy_config(cfg) if needs_policy else None
    problems.extend(fsdp2_tensor_parallel_problems(cfg, policy, refused))
    problems.extend(_engine_option_problems(cfg))
    problems.extend(engine_argument_problems(cfg))
    problems.extend(sink_problems(cfg))
    dp = cfg.roles.actor_train.world_size
    actor_runs = not any(p.path.startswith("roles.actor_train.") for p in strategy_problems)
    if actor_runs and cfg.batch_size % dp and len(set(cfg.env.group_sizes)) == 1:
        problems.append(
            Problem(
                "env.num_groups",
                f"the batch of {cfg.batch_size} episodes (env.group_size * env.num_groups) does "
                f"not split evenly over the {dp} actor_train workers; make it a multiple of {dp}",
            )
        )
    problems.extend(cfg.device_mapping().problems())
    problems.extend(_parallel_problems(cfg))
    problems.extend(_group_problems(cfg))
    if cfg.env.hub is None:
        unknown = _unknown_env_ids(cfg.env.ids)
        problems.extend(unknown or _env_kwargs_problems(cfg))
    elif cfg.env.kwargs or cfg.env.eval_kwargs() or any(e.kwargs for e in cfg.env.entries):
        from envhub.server.config import serve_command  # a hub builds its envs: serve -k

        serve = [serve_command(i, k) for i in cfg.env.ids if (k := cfg.env.kwargs_for(i))]
        problems.append(
            Problem(
                "env.kwargs",
                f"env kwargs cannot be sent to the remote hub {cfg.env.hub!r}, which builds its "
                f"envs itself: serve them there ({'; '.join(serve) or 'a variant id'}) and clear "
                "them here (the override env.kwargs={} empties the file's env.kwargs)",
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
    problems.extend(_reward_problems(cfg))
    problems.extend(_checkpoint_problems(cfg))
    problems.extend(_agent_problems(cfg))
    problems.extend(lora_problems(cfg, policy))
    problems.extend(start_problems(cfg))  # the model's tokenizer, the warm start's expert
    problems.extend(tied_embedding_problems(cfg, policy))
    problems.extend(packing_problems(cfg, policy))
    if not problems:  # the estimate needs a valid device plan and layouts
        problems.extend(_memory_problems(cfg))
    return problems


def _group_problems(cfg: TrainerConfig) -> list[Problem]:
    """A group-baseline estimator with groups of one episode: it would train nothing."""
    estimator = cfg.algorithm.advantage_estimator
    if estimator not in GROUP_ESTIMATORS:
        return []
    paths = [
        f"env.id[{i}].group_size" if entry.group_size is not None else "env.group_size"
        for i, entry in enumerate(cfg.env.entries)
        if (entry.group_size or cfg.env.group_size) < 2
    ]
    return [
        Problem(
            path,
            f"algorithm.advantage_estimator={estimator} compares episodes within a group, and a "
            f"group of 1 has no baseline (every advantage would be 0); set {path} >= 2, or use "
            "reinforce_pp (or gae, with a critic)",
        )
        for path in dict.fromkeys(paths)
    ]


def _strategy_problems(cfg: TrainerConfig) -> list[Problem]:
    """The training roles' strategies, asked of the strategies themselves before any model
    loads: the name (``registry.train_strategy_spec``), the tensor x pipeline layout
    (``registry.layout_problem``), a layout the strategy refuses (its ``_configure`` hook, asked
    for multi-rank roles only: one rank is every strategy's layout, and asking imports torch)
    and ``strategy_args`` keys it does not take (``BaseTrainStrategy.options``)."""
    problems = []
    for name in TRAIN_ROLES:
        role = getattr(cfg.roles, name)
        try:
            spec = train_strategy_spec(role.strategy)
        except ValueError as error:
            problems.append(Problem(f"roles.{name}.strategy", str(error)))
            continue
        if name not in cfg.active_roles:
            continue
        if role.num_devices_per_worker > 1:  # a worker would see devices it never uses
            held = role.num_devices_per_worker
            problems.append(
                Problem(
                    f"roles.{name}.num_devices_per_worker",
                    f"is {held}, but each {name} worker is one rank on one device (the "
                    "strategy shards over workers; only actor_infer's vLLM engine spans several "
                    f"devices): set roles.{name}.num_devices_per_worker: 1, which starts a "
                    f"worker per device of the same device_mapping",
                )
            )
            continue
        layout = layout_problem(spec.name, role.world_size, role.strategy_args)
        if layout is not None:
            problems.append(Problem(f"roles.{name}.strategy_args.{layout[0]}", layout[1]))
            continue
        strategy = spec.load()
        if role.world_size > 1:
            try:
                strategy._configure(
                    role.world_size, dict(role.strategy_args), {"trainable": name != "reference"}
                )
            except ImportError:  # torch is missing: the workers cannot start either, and say so
                pass
            except ValueError as error:
                problems.append(Problem(f"roles.{name}.device_mapping", str(error)))
                continue
        problems.extend(_unknown_options(name, spec.name, role.strategy_args, strategy.options()))
    return problems


def _fsdp2_tp(cfg: TrainerConfig) -> bool:
    """Whether a training role runs fsdp2 with tensor parallelism (its model's sizes matter)."""
    roles = [getattr(cfg.roles, name) for name in TRAIN_ROLES]
    return any(
        r.strategy == "fsdp2" and r.strategy_args.get("tensor_parallel_size", 1) != 1 for r in roles
    )


def _policy_config(cfg: TrainerConfig) -> SimpleNamespace | None:
    """The policy's HF config as far as it is known before any model is built, with attributes
    as ``from_pretrained`` gives them: what ``model.tiny`` builds, or ``model.path``'s config.json
    over the sizes ``trainer.model_shape`` reads from it. None when there is no config.json to
    read (the run says so when it loads the model)."""
    from trainer.model_shape import ModelShape

    written: dict[str, Any] = {}
    if cfg.model.tiny is not None:  # what the run builds (a policy in output_dir may be older)
        shape = ModelShape.from_tiny(cfg.model.tiny)
    elif cfg.model.path is not None:
        try:
            read = json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None
        written = read if isinstance(read, dict) else {}
        try:
            shape = ModelShape.from_config(written)
        except ValueError:  # UnknownModelShape: what the file says is all there is
            return SimpleNamespace(**written) if written else None
    else:
        return None
    sizes = {
        "model_type": shape.model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": shape.tied_embeddings,
        "rms_norm_eps": 1e-6,  # not a size; no check here reads it
    }
    return SimpleNamespace(**{**sizes, **written})


def _megatron_problems(cfg: TrainerConfig, refused: set[str]) -> list[Problem]:
    """What the megatron strategy refuses when its workers build it, asked at load (and so by
    ``--dry-run``) for the roles whose strategy passed ``_strategy_problems`` (``refused``: the
    paths it reported): a critic (``MegatronTrainStrategy`` trains causal LMs only), a model the
    converter does not map, and a tensor or pipeline parallel size that the model's attention
    heads, KV heads, MLP width or layers do not divide (``megatron_convert.layout_from_hf_config``,
    with its own messages, at the key to change)."""
    names = [
        name
        for name in TRAIN_ROLES
        if name in cfg.active_roles
        and getattr(cfg.roles, name).strategy == "megatron"
        and not any(path.startswith(f"roles.{name}.") for path in refused)
    ]
    problems = []
    if "critic" in names:
        names.remove("critic")
        problems.append(
            Problem(
                "roles.critic.strategy",
                "the megatron strategy trains causal LMs only; use 'fsdp2' or 'hf' for a critic",
            )
        )
    config = _policy_config(cfg) if names else None
    if config is None:
        return problems
    from trainer.strategies.megatron_convert import layout_from_hf_config
    from trainer.strategies.parallel_errors import ParallelConfigError, UnsupportedModelError

    for name in names:
        args = getattr(cfg.roles, name).strategy_args
        try:
            layout_from_hf_config(config)
        except UnsupportedModelError as error:
            problems.append(Problem(f"roles.{name}.strategy", str(error)))
            continue
        except (AttributeError, TypeError, ValueError):
            continue  # a config.json without a field the converter reads: the build names it
        tp, pp = args.get("tensor_parallel_size", 1), args.get("pipeline_parallel_size", 1)
        for key, sizes in (("tensor_parallel_size", (tp, 1)), ("pipeline_parallel_size", (1, pp))):
            try:
                layout_from_hf_config(config, tp=sizes[0], pp=sizes[1])
            except ParallelConfigError as error:
                problems.append(Problem(f"roles.{name}.strategy_args.{key}", str(error)))
    return problems


def _engine_option_problems(cfg: TrainerConfig) -> list[Problem]:
    """``roles.actor_infer.strategy_args`` the ``hf`` engine does not take, or a
    ``prefix_cache_gib`` it refuses: its factory (``HFEngine.from_pretrained``) refuses them when
    the workers build it; for vLLM, keys that are not its engine arguments."""
    if cfg.rollout.engine != "hf":
        return vllm_option_problems(cfg)
    import inspect

    factory = engine_spec("hf").load()
    params = inspect.signature(factory).parameters.values()
    options = sorted(
        p.name
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in ENGINE_ARGS_OF_THE_WORKER
    )
    args = cfg.roles.actor_infer.strategy_args
    problems = []
    for key in sorted(set(args) - set(options) - set(ENGINE_ARGS_OF_THE_WORKER)):
        close = difflib.get_close_matches(key, options, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        problems.append(
            Problem(
                f"roles.actor_infer.strategy_args.{key}",
                f"not an option of the 'hf' inference engine (its options: {', '.join(options)}); "
                f"{hint}remove it, or set rollout.engine: vllm if it is a vLLM engine argument",
            )
        )
    cache = args.get("prefix_cache_gib", 0)
    if isinstance(cache, bool) or not isinstance(cache, int | float) or cache < 0:
        problems.append(
            Problem(
                "roles.actor_infer.strategy_args.prefix_cache_gib",
                f"must be a number >= 0 (GiB; 0 keeps no turn's KV cache), got {cache!r}",
            )
        )
    return problems


def _unknown_options(
    role: str, strategy: str, args: dict[str, Any], options: set[str]
) -> list[Problem]:
    """A ``strategy_args`` key the strategy's constructor does not take, with a suggestion (or
    its own options: the ``train`` section sets the ``TrainOptions`` every strategy takes)."""
    from trainer.strategies.base import TrainOptions

    own = sorted(options - set(TrainOptions.__annotations__))
    problems = []
    for key in sorted(set(args) - options):
        close = difflib.get_close_matches(key, sorted(options), n=1)
        hint = f"did you mean {close[0]}?" if close else f"its own options are {', '.join(own)}"
        problems.append(
            Problem(
                f"roles.{role}.strategy_args.{key}",
                f"not an option of the {strategy!r} strategy; {hint}",
            )
        )
    return problems


def _env_kwargs_problems(cfg: TrainerConfig) -> list[Problem]:
    """Env kwargs an env's constructor does not take (``EnvSpec.accepted_kwargs``, the check
    ``envhub.make`` runs), at their key path: ``env.kwargs`` go to every env, an entry's
    ``kwargs`` and ``eval.kwargs`` to its own."""
    import envhub
    from envhub.errors import RegistryError
    from trainer.config_rollout import EnvEval

    problems = []
    for i, entry in enumerate(cfg.env.entries):
        entry_path = f"env.id[{i}]"
        given = {f"env.kwargs.{key}": key for key in cfg.env.kwargs}
        given |= {f"{entry_path}.kwargs.{key}": key for key in entry.kwargs}
        if isinstance(entry.eval, EnvEval):
            given |= {f"{entry_path}.eval.kwargs.{key}": key for key in entry.eval.kwargs}
        if not given:
            continue
        try:
            accepted = envhub.spec(entry.id).accepted_kwargs()
        except RegistryError:  # an entry point that does not import: make() says so
            continue
        if accepted is None:  # it takes any keyword
            continue
        for path, key in given.items():
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                accepts = f" (it accepts: {', '.join(accepted) or 'none'})"
                if path.startswith("env.kwargs."):
                    accepts += "; the override env.kwargs={} empties the file's env.kwargs"
                problems.append(
                    Problem(path, f"{entry.id} takes no keyword argument {key!r}{hint}{accepts}")
                )
    return list({problem.path: problem for problem in problems}.values())


def _reward_problems(cfg: TrainerConfig) -> list[Problem]:
    """``env.rewards``: a domain that routes to none of the run's envs would never score."""
    from trainer.workers.reward import domain_matches

    ids = cfg.env.ids
    problems = []
    for i, reward in enumerate(cfg.env.rewards):
        domain = reward["domain"]
        if not any(domain_matches(domain, env_id) for env_id in ids):
            names = sorted({env_id.split("/")[0] for env_id in ids} | set(ids))
            close = difflib.get_close_matches(domain, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                Problem(
                    f"env.rewards[{i}].domain",
                    f"{domain!r} matches none of this run's envs ({', '.join(ids)}); {hint}use "
                    "'*', a namespace such as 'games', an env id or a glob like 'games/soko*'",
                )
            )
    return problems


def _checkpoint_problems(cfg: TrainerConfig) -> list[Problem]:
    """A checkpoint folder that is not one of its own: a fresh start moves it aside whole."""
    if cfg.checkpoint.dir is None:  # {output_dir}/checkpoints, inside the run's own folder
        return []
    folder = cfg.checkpoint_dir
    shared = shared_folder(folder)
    if shared is None:
        try:
            above = folder.resolve() in Path(cfg.output_dir).resolve().parents
        except OSError:  # the current folder was deleted
            above = False
        shared = "a folder above output_dir" if above else None
    if shared is None:
        return []
    return [
        Problem(
            "checkpoint.dir",
            f"{cfg.checkpoint.dir!r} puts the checkpoints in {folder} ({shared}), and a fresh "
            "start moves the previous checkpoints aside with everything in that folder; choose "
            "a folder of its own for the checkpoints, or leave checkpoint.dir unset "
            "({output_dir}/checkpoints)",
        )
    ]


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
    for name in type(cfg.roles).model_fields:
        role = getattr(cfg.roles, name)
        if (
            "num_workers" in role.model_fields_set
            and role.device_mapping
            and (role.num_workers != role.world_size)
        ):
            problems.append(
                Problem(
                    f"roles.{name}.num_workers",
                    f"counts device-less workers only; with device_mapping "
                    f"{role.device_mapping} this role runs {role.world_size} worker(s): map one "
                    f"device per worker (e.g. device_mapping: {list(range(role.num_workers))}) "
                    "or set device_mapping: [] to run num_workers on CPU",
                )
            )
    for name in TRAIN_ROLES:
        role = getattr(cfg.roles, name)
        if name in cfg.active_roles and (
            problem := process_problem(role.strategy, role.world_size, cfg.cluster.backend)
        ):
            problems.append(Problem("cluster.backend", f"{name} {problem}"))
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
