"""``envhub train CONFIG [a.b=value ...] [--resume | --dry-run]``: run the trainer from the command
line, or print its plan (``--dry-run``: roles, devices, per-device memory, weight-sync buckets)
and exit without starting anything.

Only click is imported at module level (``envhub --help`` stays instant); the config, torch
and the pipeline load when the command runs. The run folder (``output_dir``) is printed
first; a live progress bar shows the train/eval success and reward of each step; the folder
ends up with ``metrics.jsonl``, checkpoints, ``reward_curve.png``, the trajectory store
(``trajectories/``, browsed with ``envhub view``) and ``final_policy/``.
Starting again without ``--resume`` moves an existing run folder aside (nothing is deleted).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

__all__ = ["train"]


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@click.option(
    "--resume", is_flag=True, help="Continue the run in output_dir from its latest checkpoint."
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (roles, devices, memory per device, weight-sync buckets) and exit: "
    "0 when it fits, 1 when it does not. Needs the model's config.json, not its weights.",
)
def train(config: Path, overrides: tuple[str, ...], resume: bool, dry_run: bool) -> None:
    """Train a policy on envhub environments as CONFIG (YAML) says.

    \b
    OVERRIDES are a.b.c=value pairs (YAML values), e.g.:
      envhub train examples/quickstart.yaml train.steps=20 output_dir=runs/try
      envhub train examples/quickstart.yaml --resume      # after a crash or kill -9
      envhub train examples/qwen2.5-0.5b-sokoban-8gpu.yaml --dry-run   # will it fit?
    """
    from rich.console import Console

    from trainer.errors import TrainerError

    console, errors = Console(), Console(stderr=True)
    if dry_run:
        sys.exit(_dry_run(config, overrides, console, errors))
    try:
        from trainer.config import load_config

        cfg = load_config(config, overrides)
    except TrainerError as error:
        errors.print(f"[bold red]error:[/] {error}", highlight=False, markup=True, soft_wrap=True)
        sys.exit(2)
    out = Path(cfg.output_dir)
    try:
        if not resume:
            for line in _move_previous_run_aside(out, Path(cfg.checkpoint_dir)):
                console.print(line, highlight=False, soft_wrap=True)
    except TrainerError as error:
        errors.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        sys.exit(1)
    console.print(f"output: {out.resolve()}", highlight=False)
    if resume:
        for line in config_drift(cfg):
            errors.print(f"[bold yellow]warning:[/] {line}", highlight=False, soft_wrap=True)
    try:
        rows = _run(cfg, resume, console)
    except TrainerError as error:
        errors.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        sys.exit(1)
    evals = [row for row in rows if row.get("eval/success") is not None]
    first_eval: dict[str, Any] = evals[0] if evals else {}
    last_eval: dict[str, Any] = evals[-1] if evals else {}
    console.print(
        f"done: eval/success {_fmt(first_eval.get('eval/success'))} "
        f"(step {first_eval.get('step', '-')}) -> "
        f"{_fmt(last_eval.get('eval/success'))} (step {last_eval.get('step', '-')}) in "
        f"{rows[-1]['time_s'] / 60:.1f} min\n"
        f"  metrics  {out / 'metrics.jsonl'}\n  curve    {out / 'reward_curve.png'}\n"
        f"  view     envhub view {out}\n"
        f"  policy   {out / 'final_policy'}\n  serve    {_serve_hint(out / 'final_policy')}",
        highlight=False,
        soft_wrap=True,  # paths and commands are copied: never wrapped mid-word
    )


def _move_previous_run_aside(out: Path, checkpoints: Path) -> list[str]:
    """Before a fresh start: move the previous run in ``out`` aside, and its checkpoint folder
    when ``checkpoint.dir`` lies outside ``out`` (a later ``--resume`` would otherwise continue
    the old run). Nothing is deleted; a folder a live run still writes is refused (its pid)."""
    from trainer.folder_lock import FolderLock
    from trainer.resume import RUN_LOCK

    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for folder, lock_name, setting, what in (
        (out, RUN_LOCK, "output_dir", "the previous run"),
        (checkpoints, ".lock", "checkpoint.dir", "its checkpoints"),
    ):
        if not folder.is_dir() or not any(folder.iterdir()):
            continue
        lock = FolderLock(folder, name=lock_name, setting=setting)
        try:
            aside = folder.with_name(f"{folder.name}.old-{stamp}")
            folder.rename(aside)
        finally:
            lock.release()
        moved.append(f"moved {what} in {folder} to {aside} (use --resume to continue a run)")
    return moved


def _serve_hint(policy: Path) -> str:
    """The command that serves ``policy`` over an OpenAI-compatible API (then ``envhub eval
    --model URL``), and on a machine without CUDA the retraining that vLLM's CPU build needs
    when the model's attention head size is one its kernels lack."""
    import json

    from trainer.strategies.vllm_platform import CPU_HEAD_SIZES, head_size

    command = f"python -m vllm.entrypoints.openai.api_server --model {policy}"
    try:
        head_dim, hidden, _ = head_size(json.loads((policy / "config.json").read_text()))
    except (OSError, ValueError):
        return command
    cuda = False
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        pass
    if not cuda and head_dim is not None and hidden and head_dim not in CPU_HEAD_SIZES:
        heads = max(1, hidden // 32)
        command += (
            f" (on a GPU; vLLM on CPU lacks head size {head_dim}: train with "
            f"model.tiny.num_heads={heads} to serve it here)"
        )
    return command


def config_drift(cfg: Any, *, limit: int = 12) -> list[str]:
    """Lines naming every setting that differs from the config saved in the latest checkpoint.

    ``--resume`` runs the config as given now (so ``train.steps=200`` can extend a run), but an
    edited YAML silently changing a resumed run is a classic surprise: the differences are
    listed so the user sees them before training continues. Empty when nothing differs or
    there is no checkpoint with a saved config.
    """
    import json

    from trainer.checkpoint import CheckpointManager

    try:
        latest = CheckpointManager(cfg.checkpoint_dir, lock=False).latest()
    except Exception:  # noqa: BLE001 - no checkpoint folder: the pipeline reports that itself
        return []
    if latest is None or not (latest / "config.json").is_file():
        return []
    saved = json.loads((latest / "config.json").read_text())
    now = json.loads(json.dumps(cfg.model_dump(mode="json"), default=str))
    changed = _diff(saved, now)
    if not changed:
        return []
    lines = [f"{key}: {old!r} in {latest.name} -> {new!r} now" for key, old, new in changed[:limit]]
    if len(changed) > limit:
        lines.append(f"... and {len(changed) - limit} more")
    header = (
        f"the config differs from the one the run was saved with ({len(changed)} setting(s)); "
        "resuming with the config as given now:"
    )
    return [header, *lines]


def _diff(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def _run(cfg: Any, resume: bool, console: Any) -> list[dict[str, Any]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from envhub.gc_tuning import relax_gc
    from trainer.pipeline import AgenticPipeline

    relax_gc()  # this process will hold every episode in play
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    ]
    with Progress(
        *columns, console=console, disable=not cfg.logging.progress, transient=False
    ) as progress:
        task = progress.add_task(
            "starting", total=cfg.train.steps, status="building policy and workers"
        )
        eval_success: list[Any] = [None]

        def on_step(metrics: dict[str, Any]) -> None:
            if metrics.get("eval/success") is not None:
                eval_success[0] = metrics["eval/success"]
            step = metrics["step"]
            status = (
                f"train success {_fmt(metrics.get('train/success'))}"
                f"  reward {_fmt(metrics.get('train/reward'))}"
                f"  eval success {_fmt(eval_success[0])}"
            )
            progress.update(
                task, completed=step, description="RL" if step else "warm start", status=status
            )
            if not cfg.logging.progress:
                console.print(f"step {step}: {status}", highlight=False)

        pipeline = AgenticPipeline(cfg, resume=resume, on_step=on_step)
        console.print(f"eval: {pipeline.describe_eval()}", highlight=False, soft_wrap=True)
        progress.update(
            task,
            completed=pipeline.step,
            description="warm start" if not resume else "resuming",
            status="",
        )
        return pipeline.fit()


# --------------------------------------------------------------------------- --dry-run


def _dry_run(config: Path, overrides: tuple[str, ...], console: Any, errors: Any) -> int:
    """Print the plan of CONFIG; 0 when it fits, 1 when a device does not, 2 when the config is
    invalid or there is no model config to estimate from."""
    from trainer.config import load_config
    from trainer.errors import TrainerError
    from trainer.memory import estimate
    from trainer.model_shape import UnknownModelShape

    try:  # every other problem still refuses the config; the memory ones are shown with the plan
        cfg = load_config(config, [*overrides, "cluster.check_memory=false"])
    except TrainerError as error:
        errors.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        return 2
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
        errors.print(f"[bold red]error:[/] {why}", highlight=False, soft_wrap=True)
        return 2
    for renderable in plan_view(cfg, plan):
        console.print(renderable)
    problems = plan.problems()
    if not problems:
        console.print("[bold green]fits[/]: nothing started (--dry-run)", highlight=False)
        return 0
    strict = "cluster.check_memory=false" not in overrides and _checks_memory(config)
    head = (
        "does not fit" if strict else "does not fit (cluster.check_memory is off: it would start)"
    )
    errors.print(f"[bold red]{head}:[/]", highlight=False)
    for problem in problems:
        errors.print(f"  - {problem}", highlight=False, soft_wrap=True)
    return 1 if strict else 0


def _checks_memory(config: Path) -> bool:
    """Whether CONFIG itself leaves ``cluster.check_memory`` on."""
    import yaml

    cluster = (yaml.safe_load(config.read_text()) or {}).get("cluster") or {}
    return bool(cluster.get("check_memory", True))


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
    model = (
        f"[bold]model[/]    {shape.model_type}, {shape.num_params / 1e6:,.1f}M parameters "
        f"({shape.num_layers} layers, hidden {shape.hidden_size}, vocabulary "
        f"{shape.vocab_size:,}) in {cfg.model.dtype}, from {plan.shape_source}"
    )
    tokens = (
        f"[bold]tokens[/]   rows up to {plan.sequence_tokens:,} ({plan.sequence_note}); "
        f"{plan.micro_tokens:,} per micro-batch"
    )
    summary = [model, tokens, f"[bold]devices[/]  {plan.capacity_note}{host}"]
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
