"""``envhub train CONFIG --dry-run``: the plan of a run - roles, devices, per-device memory,
weight-sync buckets - and the refusals its start would give, with nothing started
(``--resume --dry-run``: first what ``--resume`` would continue). Called by ``trainer.cli``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.cli import _check_resume, _print_error
from trainer.errors import ConfigError, Problem

__all__ = ["dry_run", "plan_view"]


def dry_run(
    config: Path, overrides: tuple[str, ...], console: Any, errors: Any, *, resume: bool = False
) -> int:
    """Print the plan of CONFIG (with ``resume``, first what ``--resume`` would continue); 0 when
    it fits, 1 when a device does not or ``--resume`` is refused, 2 when the config is invalid or
    there is no model config to estimate from."""
    from rich.markup import escape as markup_escape

    from trainer._config_layout_checks import local_device_problems
    from trainer.config import load_config
    from trainer.errors import TrainerError
    from trainer.memory import estimate
    from trainer.model_shape import UnknownModelShape

    try:  # every other problem still refuses the config; the memory ones are shown with the plan
        cfg = load_config(config, [*overrides, "cluster.check_memory=false"])
    except ConfigError as error:
        _print_error(errors, _config_json_is_enough(error))
        return 2
    except TrainerError as error:
        _print_error(errors, error)
        return 2
    if resume and not _dry_resume(cfg, config, overrides, console, errors):
        return 1
    try:
        plan = estimate(cfg)
    except (OSError, ValueError) as error:  # UnknownModelShape, StrategyArgError
        why = (
            f"model.path {cfg.model.path!r} has no config.json; the dry run sizes the model from "
            "it (no weights needed): point model.path at a folder holding the checkpoint's "
            "config.json"
            if isinstance(error, OSError)
            else str(error)
            if isinstance(error, UnknownModelShape)
            else f"{getattr(error, 'path', 'roles')}: {error}"
        )
        _print_error(errors, ValueError(why))
        return 2
    for renderable in plan_view(cfg, plan):
        console.print(renderable)
    from trainer.start_warnings import start_warnings

    for warning in start_warnings(cfg):  # what the run would warn as it starts
        errors.print(
            f"[bold yellow]warning:[/] {markup_escape(warning)}", highlight=False, soft_wrap=True
        )
    device_problems = local_device_problems(cfg, planning=True)  # devices a run here lacks
    problems = [*plan.problems(), *device_problems]
    if not problems:
        console.print("[bold green]fits[/]: nothing started (--dry-run)", highlight=False)
        return 0
    strict = bool(device_problems) or _memory_check_refuses(config, overrides)
    head = (
        "does not fit" if strict else "does not fit (cluster.check_memory is off: it would start)"
    )
    errors.print(f"[bold red]{head}:[/]", highlight=False)
    for problem in problems:
        errors.print(f"  - {markup_escape(str(problem))}", highlight=False, soft_wrap=True)
    return 1 if strict else 0


def _config_json_is_enough(error: ConfigError) -> ConfigError:
    """``error`` with a missing ``model.path`` told what the dry run needs of it: the
    checkpoint's config.json alone (it sizes the model; no weights are read)."""
    hint = "; for --dry-run, a folder holding only the checkpoint's config.json is enough"
    problems = [
        Problem(p.path, p.message + hint, p.where)
        if p.path == "model.path" and "does not exist" in p.message
        else p
        for p in error.problems
    ]
    return ConfigError(problems, source=error.source) if problems != error.problems else error


def _dry_resume(
    cfg: Any, config: Path, overrides: tuple[str, ...], console: Any, errors: Any
) -> bool:
    """``--resume --dry-run``: the run's own checks before it builds (:func:`_check_resume`, on
    the config as the run loads it) and what it would resume; False when it would be refused."""
    from rich.markup import escape

    from trainer.errors import TrainerError

    as_run = cfg.model_copy(
        update={
            "cluster": cfg.cluster.model_copy(
                update={"check_memory": _memory_check_refuses(config, overrides)}
            )
        }
    )  # the plan's config has the memory check off: that is no drift of the run's
    try:
        point = _check_resume(as_run)
    except TrainerError as error:
        _print_error(errors, error)
        return False
    console.print(point.describe(as_run)[0], highlight=False, soft_wrap=True)
    for line in point.drift:
        errors.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
    return True


def _memory_check_refuses(config: Path, overrides: tuple[str, ...]) -> bool:
    """Whether the run itself would be refused for memory: CONFIG with OVERRIDES loaded as the
    run loads it (the plan was loaded with the check off), so ``cluster.check_memory`` counts as
    the config says it, whatever its spelling and whether the YAML or an override sets it."""
    from trainer.config import load_config
    from trainer.errors import TrainerError

    try:
        return load_config(config, overrides).cluster.check_memory
    except TrainerError:  # loads with the check off: refused by the check
        return True


def plan_view(cfg: Any, plan: Any) -> list[Any]:
    """The dry run's output: a summary, the roles, the memory of each kind of device (devices
    alike shown once) by role and component, and the weight sync."""
    from rich.table import Table

    from trainer.devices import id_ranges
    from trainer.memory import sync_buckets
    from trainer.memory_roles import GIB

    shape = plan.shape
    capacity = f"{plan.capacity / GIB:g} GiB" if plan.capacity else None
    host = f"; this machine has {plan.host_memory / GIB:.0f} GiB" if plan.host_memory else ""
    bound = plan.shape_source.startswith("model.tiny")  # sized at model.tiny.vocab_size
    vocabulary = (
        f"vocabulary up to {shape.vocab_size:,}: model.tiny's tokenizer is learnt at start"
        if bound
        else f"vocabulary {shape.vocab_size:,}"
    )
    model = (
        f"[bold]model[/]    {shape.model_type}, {'at most ' if bound else ''}"
        f"{shape.num_params / 1e6:,.1f}M parameters ({shape.num_layers} layers, hidden "
        f"{shape.hidden_size}, {vocabulary}) in {cfg.model.dtype}, from "
        f"{'model.tiny' if bound else plan.shape_source}"
    )
    tokens = (
        f"[bold]tokens[/]   rows up to {plan.sequence_tokens:,} ({plan.sequence_note}); "
        f"{plan.micro_tokens:,} per micro-batch"
    )
    summary = [model, tokens, algorithm_line(cfg), f"[bold]devices[/]  {plan.capacity_note}{host}"]
    roles = Table(title="roles", title_justify="left")
    for column in ("role", "layout", "devices", "offloaded when idle", "notes"):
        roles.add_column(column, overflow="fold")
    for name, memory in plan.roles.items():
        role = memory.config
        away = [f for f in ("params", "optimizer") if getattr(role, f"offload_{f}")]
        if memory.strategy == "vllm":
            away = ["sleeps"] if role.offload_params or role.offload_optimizer else []
        roles.add_row(
            name,
            memory.layout,
            id_ranges(memory.devices) if memory.devices else "none (CPU workers)",
            ", ".join(away) or "-",
            "; ".join(memory.notes) or "-",
        )
    out: list[Any] = ["\n".join(summary), roles]
    alike: dict[tuple[Any, ...], list[int]] = {}
    for load in plan.devices:
        key = (load.phase, tuple((r, p.name, p.nbytes) for r, p in load.parts))
        alike.setdefault(key, []).append(load.device)
    loads = {load.device: load for load in plan.devices}
    for ids in alike.values():
        load = loads[ids[0]]
        limit = f" of {capacity}" if capacity else ""
        fits = "" if not plan.capacity else (" fits" if load.total <= plan.capacity else " OVER")
        phases = ", ".join(f"{p} {n / GIB:.1f}" for p, n in load.phases.items())
        out.append(
            f"[bold]device {id_ranges(ids)}[/]: {load.total / GIB:.1f} GiB{limit} in its fullest "
            f"phase, {load.phase}{fits} (phases in GiB: {phases})"
        )
        table = Table()
        table.add_column("role")
        table.add_column("component")
        table.add_column("GiB", justify="right")
        for role, part in sorted(load.parts, key=lambda rp: -rp[1].nbytes):
            table.add_row(role, part.name, f"{part.nbytes / GIB:.2f}")
        out.append(table)
    bucket, count, total, what = sync_buckets(cfg, shape)
    setting = (
        f"weight_sync.bucket_mb={cfg.weight_sync.bucket_mb:g}"
        if cfg.weight_sync.bucket_mb
        else "weight_sync.bucket_mb unset: 256 MiB or the largest tensor"
    )
    out.append(
        f"[bold]weight sync[/]  {what}: {total / 2**20:,.1f} MiB in {count} bucket(s) of "
        f"{bucket / 2**20:.1f} MiB ({setting}; transport {cfg.weight_sync.transport})"
    )
    return out


def algorithm_line(cfg: Any) -> str:
    """The advantages, policy loss and sampling the run will use, as resolved at load (GSPO's
    own clip and aggregation when unset; the temperature log-probs are taken at)."""
    algo, loss, rollout = cfg.algorithm, cfg.algorithm.loss, cfg.rollout
    estimator = algo.advantage_estimator
    if estimator in ("grpo", "gigpo") and not algo.normalize_std:
        estimator += " (mean only: Dr. GRPO)"
    policy = (
        f"{'GSPO' if loss.gspo else 'PPO'} clip {loss.clip_low:g}/{loss.clip_high:g}, "
        f"{loss.agg_mode}" + (f", dual clip {loss.dual_clip:g}" if loss.dual_clip else "")
    )
    kl = f"KL {loss.kl_coef:g} ({loss.kl_estimator} as {loss.kl_mode})" if loss.kl_coef else "no KL"
    entropy = f", entropy {loss.entropy_coef:g}" if loss.entropy_coef else ""
    return (
        f"[bold]loss[/]     {estimator} advantages, {policy}, {kl}{entropy}; sampling at "
        f"temperature {rollout.temperature:g}, top_p {rollout.top_p:g} (log-probs at that "
        "temperature)"
    )
