"""``envhub train CONFIG [a.b=value ...] [--resume | --dry-run]``: run the trainer from the command
line, or print its plan (``--dry-run``: roles, devices, per-device memory, weight-sync buckets)
and exit without starting anything.

Only click and ``envhub.cli`` (its ``--import`` option, shared with the other commands) are
imported at module level (``envhub --help`` stays instant); the config, torch and the pipeline
load when the command runs. The run folder (``output_dir``) is printed
first; a live progress bar shows the train/eval success, reward and invalid-action rate of each
step (plain ``step N: ...`` lines when the output is not a terminal); the folder
ends up with ``metrics.jsonl``, checkpoints, ``reward_curve.png``, the trajectory store
(``trajectories/``, browsed with ``envhub view``) and ``final_policy/``.
Starting again without ``--resume`` moves an existing run folder aside (nothing of it is
deleted; a folder that is not a run is refused), and puts it back when the new start fails
before it saved anything; ``--resume`` refuses a missing checkpoint or a setting its state
cannot be loaded with before building anything.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from envhub.cli import import_option

if TYPE_CHECKING:
    from trainer.resume import ResumePoint

__all__ = ["train"]


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@import_option
@click.option(
    "--resume", is_flag=True, help="Continue the run in output_dir from its latest checkpoint."
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (roles, devices, memory per device, weight-sync buckets) and exit: "
    "0 when it fits, 1 when it does not. Needs the model's config.json, not its weights. With "
    "--resume, first the checkpoint it would continue (1 when --resume would be refused).",
)
def train(config: Path, overrides: tuple[str, ...], resume: bool, dry_run: bool) -> None:
    """Train a policy on envhub environments as CONFIG (YAML) says.

    \b
    OVERRIDES are a.b.c=value pairs (YAML values); a mapping value replaces the file's mapping
    ('env.kwargs={size: 4}'; env.kwargs={} clears it), a dotted key sets one entry, e.g.:
      envhub train examples/quickstart.yaml train.steps=20 output_dir=runs/try
      envhub train examples/quickstart.yaml --resume      # after a crash or kill -9
      envhub train examples/qwen2.5-0.5b-sokoban-8gpu.yaml model.path=DIR --dry-run
          # will it fit? DIR: a folder holding the checkpoint's config.json (weights unneeded)
      envhub train --import my_envs run.yaml env.id=acme/echo-v0   # ids my_envs.py registers
    """
    from rich.console import Console
    from rich.markup import escape

    from envhub.errors import EnvhubError
    from trainer.errors import TrainerError

    console, errors = Console(), Console(stderr=True)
    if dry_run:
        from trainer import cli_dry_run

        sys.exit(cli_dry_run.dry_run(config, overrides, console, errors, resume=resume))
    try:
        from trainer.config import load_config

        cfg = load_config(config, overrides)
    except TrainerError as error:
        _print_error(errors, error)
        sys.exit(2)
    out = Path(cfg.output_dir)
    try:  # refusals that cost nothing come before anything is built, moved or created
        point = _check_resume(cfg) if resume else None
        moved = [] if resume else _move_previous_run_aside(out, Path(cfg.checkpoint_dir))
    except TrainerError as error:
        _print_error(errors, error)
        sys.exit(1)
    resuming, builds = point.describe(cfg) if point is not None else ("", True)
    if not builds:  # the run is complete: nothing was asked that it has not done (exit 0)
        console.print(resuming, highlight=False, soft_wrap=True)
        return
    for what, folder, aside in moved:
        console.print(
            f"moved {what} in {folder} to {aside} (use --resume to continue a run)",
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"output: {out.resolve()}", highlight=False)
    if resuming:
        console.print(resuming, highlight=False, soft_wrap=True)
    from trainer.start_warnings import start_warnings

    for line in [*(point.drift if point is not None else []), *start_warnings(cfg)]:
        errors.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
    try:
        with (
            _put_back_unless_saved(moved, out, Path(cfg.checkpoint_dir), errors),
            _sigterm_stops(),
            _warnings_to(errors),
        ):
            rows = _run(cfg, resume, console)
    except (TrainerError, EnvhubError) as error:  # raised on purpose: the message names the fix
        _print_error(errors, error)
        sys.exit(1)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (Terminated): the same way out
        from trainer.checkpoint import resume_hint

        signum = signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT
        said = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C (SIGINT)"
        errors.print(
            f"stopped by {said}: workers shut down; {escape(resume_hint(cfg.checkpoint_dir))}",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(128 + signum)
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


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a scheduler's preemption, ``kill``): the run stops as for Ctrl-C."""


@contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread, so the run shuts its workers down
    as for Ctrl-C (Python's default ends the process at once; ``ray.init`` would install Ray's,
    which aborts with a stack dump: ``trainer.controller.resources`` keeps this one)."""

    def stop(signum: int, frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _warnings_to(errors: Any) -> Iterator[None]:
    """During the run, the trainer's log records of level WARNING and above (a run without a
    learning signal, a worker that failed to stop) are ``warning: ...`` / ``error: ...`` lines
    on stderr, as the command's own are (above the progress bar), instead of Python's bare
    last-resort lines; they still propagate to handlers a caller configured."""
    import logging

    from rich.markup import escape

    class Printer(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            level = "bold yellow" if record.levelno < logging.ERROR else "bold red"
            errors.print(
                f"[{level}]{record.levelname.lower()}:[/] {escape(self.format(record))}",
                highlight=False,
                soft_wrap=True,
            )

    logger, printer = logging.getLogger("trainer"), Printer(logging.WARNING)
    logger.addHandler(printer)  # (records still reach the user's own handlers, if any)
    try:
        yield
    finally:
        logger.removeHandler(printer)


def _print_error(errors: Any, error: BaseException) -> None:
    """``error: MESSAGE`` on stderr (the message verbatim: brackets in it are not markup)."""
    from rich.markup import escape

    errors.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)


_RUN_FILES = ("metrics.jsonl", "checkpoints", "initial_policy")
"""With ``trainer.resume.RUN_FILE`` and ``RUN_LOCK``, what a run writes into ``output_dir``
first (the metrics log, the default checkpoint folder, the built tiny policy): a folder
holding one of them is a previous run; one holding none is someone's files, never moved."""
_CHECKPOINT_FILES = re.compile(
    r"^(\.lock|latest|step_\d+|\.(tmp|trash)-(step_|latest).*|\.pruned-step_.*)$"
)
"""What a ``CheckpointManager`` writes into ``checkpoint.dir`` (its lock, the ``latest``
pointer, ``step_N`` folders and their half-written ``.tmp-``/``.trash-``/``.pruned-`` forms)."""


def _move_previous_run_aside(out: Path, checkpoints: Path) -> list[tuple[str, Path, Path]]:
    """Before a fresh start: move the previous run in ``out`` aside, and its checkpoint folder
    when ``checkpoint.dir`` lies outside ``out`` (a later ``--resume`` would otherwise continue
    the old run); returns ``(what, folder, aside)`` of each move. Nothing is deleted. Refused,
    before anything moves: a folder that does not hold an envhub run (someone's files), the
    folder this command runs in (or one holding it), and a folder a live run still writes
    (its pid)."""
    from trainer.errors import CheckpointError
    from trainer.folder_lock import FolderLock
    from trainer.resume import RUN_FILE, RUN_LOCK

    out, checkpoints = Path(os.path.abspath(out)), Path(os.path.abspath(checkpoints))
    folders = [(out, RUN_LOCK, "output_dir", "the previous run")]
    if not checkpoints.is_relative_to(out):  # otherwise it moves with out
        folders.append((checkpoints, ".lock", "checkpoint.dir", "its checkpoints"))
    due = [f for f in folders if f[0].is_dir() and any(f[0].iterdir())]
    here = Path.cwd().resolve()
    for folder, _, setting, _ in due:
        if folder.resolve() == here or folder.resolve() in here.parents:
            raise CheckpointError(
                f"{setting} {folder} is the folder this command runs in (or holds it), which a "
                f"fresh start cannot move aside; choose another {setting} (e.g. runs/NAME)"
            )
        names = sorted(p.name for p in folder.iterdir())
        ours = (
            [n for n in names if _CHECKPOINT_FILES.match(n)]
            if setting == "checkpoint.dir"
            else [n for n in names if n in (RUN_FILE, RUN_LOCK, *_RUN_FILES)]
        )
        if not ours:
            kind = "envhub checkpoints" if setting == "checkpoint.dir" else "an envhub run"
            raise CheckpointError(
                f"{setting} {folder} holds files that are not {kind} ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}); choose another {setting} (or empty it)"
            )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    locks, moved = [], []
    try:  # every lock first: a live run on either folder leaves both where they are
        for folder, lock_name, setting, _ in due:
            locks.append(FolderLock(folder, name=lock_name, setting=setting))
        for folder, _, _, what in due:
            aside = folder.with_name(f"{folder.name}.old-{stamp}")
            folder.rename(aside)
            moved.append((what, folder, aside))
    finally:
        for lock in locks:
            lock.release()
    return moved


@contextmanager
def _put_back_unless_saved(
    moved: list[tuple[str, Path, Path]], out: Path, checkpoints: Path, errors: Any
) -> Iterator[None]:
    """Run the block (the run); when it fails before the new run saved anything (a checkpoint
    or a metrics row: a setting refused while building, Ctrl-C during the warm start), remove
    what that start wrote and put the runs :func:`_move_previous_run_aside` moved back where
    they were: the failed start left nothing to continue or to look at, and ``--resume`` looks
    for the previous run in ``output_dir``."""
    try:
        yield
    except BaseException:
        from rich.markup import escape

        from trainer.checkpoint import CheckpointManager

        metrics = out / "metrics.jsonl"
        logged = metrics.is_file() and metrics.stat().st_size > 0
        if moved and not logged and not CheckpointManager(checkpoints, lock=False).list():
            for what, folder, aside in reversed(moved):
                shutil.rmtree(folder, ignore_errors=True)  # made by this start: moved aside first
                try:
                    aside.rename(folder)
                except OSError as error:
                    errors.print(
                        f"[bold yellow]warning:[/] {what} stays in {aside}: it could not be put "
                        f"back in {folder} ({escape(str(error))})",
                        highlight=False,
                        soft_wrap=True,
                    )
                else:
                    errors.print(
                        f"put {what} back in {folder} (this start failed before its first "
                        "checkpoint)",
                        highlight=False,
                        soft_wrap=True,
                    )
        raise


def _check_resume(cfg: Any) -> ResumePoint:
    """Before ``--resume`` builds anything or creates a folder: refuse when a live run still
    writes ``output_dir`` (its pid), when there is no checkpoint to continue (naming the run a
    fresh start moved aside, if any), when a setting changes the shape of its saved state
    (``trainer.resume.resume_conflicts``) or when ``train.steps`` is below the steps it did
    (``steps_behind``); returns what it would resume otherwise."""
    from trainer.checkpoint import CheckpointManager
    from trainer.errors import CheckpointError
    from trainer.folder_lock import FolderLock
    from trainer.resume import RUN_LOCK, ResumePoint, refuse_unresumable

    if (Path(cfg.output_dir) / RUN_LOCK).is_file():  # a run started there: is it still live?
        FolderLock(cfg.output_dir, name=RUN_LOCK, setting="output_dir").release()
    manager = CheckpointManager(cfg.checkpoint_dir, lock=False)
    root, latest = Path(cfg.checkpoint_dir), manager.latest()  # what the run's manager loads
    odd = [
        f"{link} is a symbolic link (to {link.resolve()}): ignored, a checkpoint must be a "
        f"folder in {root}"
        for link in manager.symlinked()
    ]
    interrupted = manager.interrupted()
    if interrupted and (latest is None or interrupted[-1] > latest.name):
        return ResumePoint(None, 0, [*odd, *config_drift(cfg)])  # the run's manager puts it back
    if latest is None:
        raise CheckpointError(
            f"no checkpoint in {root}; run without --resume to start fresh"
            f"{_moved_aside_hint(Path(cfg.output_dir), root)}"
        )
    checkpoint = manager.load(latest)
    refuse_unresumable(checkpoint, cfg.model_dump(mode="json"))  # (engine ranks: by the run)
    warnings = [*odd, *checkpoint.warnings, *config_drift(cfg)]
    return ResumePoint(checkpoint.path, checkpoint.step, warnings)


def _moved_aside_hint(out: Path, checkpoints: Path) -> str:
    """Where a fresh start moved the previous run (and an outside ``checkpoint.dir``), as the
    settings that continue it; empty when nothing of that name was moved aside."""

    def newest(folder: Path) -> Path | None:
        folder = Path(os.path.abspath(folder))
        found = [p for p in folder.parent.glob(f"{glob.escape(folder.name)}.old-*") if p.is_dir()]
        return max(found, default=None)

    aside = newest(out)
    if aside is None:
        return ""
    settings = f"output_dir={aside}"
    if not Path(os.path.abspath(checkpoints)).is_relative_to(os.path.abspath(out)):
        moved = newest(checkpoints)
        settings += f" checkpoint.dir={moved}" if moved is not None else ""
    return f"; the previous run was moved to {aside}; pass {settings} --resume to continue it"


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


PLAIN_LINE_EVERY_S = 30.0
"""Without a terminal (output into a file: nohup, sbatch, CI), where a live bar would draw
nothing until the run ends, ``envhub train`` prints a plain ``step N: ...`` line for the warm
start, every evaluated step and the last, and one at least this often (``logging.progress:
false``: one per step, terminal or not)."""


def _run(cfg: Any, resume: bool, console: Any) -> list[dict[str, Any]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from envhub.gc_tuning import relax_gc
    from trainer.errors import TrainerError
    from trainer.pipeline import AgenticPipeline

    relax_gc()  # this process will hold every episode in play
    bar = cfg.logging.progress and console.is_terminal  # else plain lines (a log file)
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    ]
    with Progress(*columns, console=console, disable=not bar, transient=False) as progress:
        task = progress.add_task(
            "starting", total=cfg.train.steps, status="building policy and workers"
        )
        last_eval = ["-"]  # the latest evaluation, with its step: it is carried forward
        printed = [time.monotonic()]

        def on_step(metrics: dict[str, Any]) -> None:
            step = metrics["step"]
            if metrics.get("eval/success") is not None:
                last_eval[0] = f"{_fmt(metrics['eval/success'])} (step {step})"
            status = (
                f"train success {_fmt(metrics.get('train/success'))}"
                f"  reward {_fmt(metrics.get('train/reward'))}"
                f"  invalid {_fmt(metrics.get('train/invalid_rate'))}"
                f"  eval success {last_eval[0]}"
            )
            progress.update(
                task, completed=step, description="RL" if step else "warm start", status=status
            )
            due = (  # without a terminal: the milestones, and a line every PLAIN_LINE_EVERY_S
                step in (0, cfg.train.steps)
                or "eval/success" in metrics
                or time.monotonic() - printed[0] >= PLAIN_LINE_EVERY_S
            )
            if not cfg.logging.progress or (not bar and due):
                console.print(f"step {step}: {status}", highlight=False, soft_wrap=True)
                printed[0] = time.monotonic()

        epoch_nll: list[float] = []

        def on_sft_step(done: int, total: int, nll: float) -> None:
            """The warm start's place (SFT steps, epoch, the epoch's mean NLL so far); without a
            terminal, a line per epoch (``logging.progress: false``) or as ``on_step``'s."""
            per_epoch = max(total // max(cfg.sft.epochs, 1), 1)
            epoch_nll.append(nll)
            epoch, mean = -(-done // per_epoch), sum(epoch_nll) / len(epoch_nll)
            status = f"epoch {epoch}/{cfg.sft.epochs}, SFT step {done}/{total}, nll {mean:.3f}"
            progress.update(task, description="warm start", status=status)
            if done % per_epoch and done != total:
                return
            epoch_nll.clear()
            if not cfg.logging.progress or (
                not bar and (done == total or time.monotonic() - printed[0] >= PLAIN_LINE_EVERY_S)
            ):
                console.print(f"warm start: {status}", highlight=False, soft_wrap=True)
                printed[0] = time.monotonic()

        try:
            pipeline = AgenticPipeline(cfg, resume=resume, on_step=on_step, on_sft_step=on_sft_step)
        except TrainerError:
            raise
        except ValueError as error:  # a setting only the build checks (an env's kwarg values):
            raise TrainerError(str(error)) from error  # said like the config's, no traceback
        console.print(f"eval: {pipeline.describe_eval()}", highlight=False, soft_wrap=True)
        progress.update(
            task,
            completed=pipeline.step,
            description="warm start" if not resume else "resuming",
            status="",
        )
        return pipeline.fit()
