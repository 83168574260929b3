"""``envhub train CONFIG [a.b=value ...] [--resume]``: run the trainer from the command line.

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
def train(config: Path, overrides: tuple[str, ...], resume: bool) -> None:
    """Train a policy on envhub environments as CONFIG (YAML) says.

    \b
    OVERRIDES are a.b.c=value pairs (YAML values), e.g.:
      envhub train examples/quickstart.yaml train.steps=20 output_dir=runs/try
      envhub train examples/quickstart.yaml --resume      # after a crash or kill -9
    """
    from rich.console import Console

    from trainer.errors import TrainerError

    console, errors = Console(), Console(stderr=True)
    try:
        from trainer.config import load_config

        cfg = load_config(config, overrides)
    except TrainerError as error:
        errors.print(f"[bold red]error:[/] {error}", highlight=False, markup=True, soft_wrap=True)
        sys.exit(2)
    out = Path(cfg.output_dir)
    if not resume and out.exists() and any(out.iterdir()):
        aside = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        out.rename(aside)
        console.print(
            f"moved the previous run in {out} to {aside} (use --resume to continue a run)"
        )
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
        latest = CheckpointManager(cfg.checkpoint_dir).latest()
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

    from trainer.pipeline import AgenticPipeline

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
        progress.update(
            task,
            completed=pipeline.step,
            description="warm start" if not resume else "resuming",
            status="",
        )
        return pipeline.fit()
