"""The run-lifecycle sections of the trainer config: what happens around the RL steps.

``checkpoint`` (atomic saves for ``--resume``), ``eval`` (periodic evaluation), ``sft`` (the
optional supervised warm start before RL) and ``logging`` (metric sinks besides
``metrics.jsonl``). None of them changes what one training step computes. They are parts of
the tree in ``trainer.config``; build the whole config with ``trainer.config.load_config``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainer.config_section import Section
from trainer.errors import ConfigError, Problem

__all__ = [
    "CheckpointConfig",
    "EvalConfig",
    "LoggingConfig",
    "SFTConfig",
    "own_folder",
    "shared_folder",
]


def shared_folder(folder: str | Path) -> str | None:
    """What ``folder`` (``~`` expanded, relative to the current folder) is when it cannot be a
    run's own - the current folder, one above it or the home folder - and None when it can. A
    fresh start moves the previous run's folder aside whole (``envhub train``), so such a
    folder would take everything in it along."""
    try:
        here = Path.cwd().resolve()
        path = Path(folder).expanduser().resolve()
    except OSError:  # the current folder was deleted: a relative path means nothing
        return None
    home = Path.home().resolve()
    if path == here:
        return "the current folder"
    if path == Path(path.anchor):
        return "the filesystem root"
    if path in here.parents:
        return "a folder above the current one"
    if path == home:
        return "your home folder"
    if path in home.parents:
        return "a folder above your home folder"
    return None


def own_folder(folder: str) -> str:
    """``folder`` with ``~`` expanded, if it can be a run's own (``output_dir``); else a
    ValueError naming what it is and the fix."""
    shared = shared_folder(folder)
    if shared is not None:
        raise ValueError(
            f"{folder!r} is {shared}, and a fresh start moves the previous run in output_dir "
            "aside with everything in it; choose a folder of its own for the run, e.g. runs/NAME"
        )
    return os.path.expanduser(folder)


class CheckpointConfig(Section):
    """Atomic checkpoints for ``--resume``."""

    every: int = Field(default=10, ge=0)
    """Save every N steps (and after the last step); 0 saves only at the end."""
    keep: int = Field(default=2, gt=0)
    """Keep the newest N checkpoints; older ones are deleted after a successful save."""
    dir: str | None = None
    """Checkpoint folder; None means ``{output_dir}/checkpoints``; relative to ``output_dir``
    (``~`` is the home folder)."""

    @field_validator("dir")
    @classmethod
    def _expand_home(cls, folder: str | None) -> str | None:
        return os.path.expanduser(folder) if folder else folder


class EvalConfig(Section):
    """Periodic evaluation (greedy by default) on fresh seeds."""

    every: int = Field(default=10, ge=0)
    """Evaluate every N steps (plus before the first and after the last); 0: start and end only."""
    episodes: int = Field(default=32, gt=0)
    """Episodes per evaluation."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature during evaluation (0 is greedy)."""


class SFTConfig(Section):
    """Optional supervised warm start before RL, with the same masks and checkpoint format."""

    epochs: int = Field(default=0, ge=0)
    """Passes over the demonstrations; 0 skips the warm start."""
    source: Literal["expert", "file"] = "expert"
    """``expert``: collect demonstrations with the env's scripted expert; ``file``: read
    ``path``."""
    path: str | None = None
    """JSONL of trajectories (``source: file``); it must exist when the config is loaded."""
    episodes: int = Field(default=64, gt=0)
    """Demonstrations to collect from the expert (``source: expert``)."""
    lr: float | None = Field(default=None, gt=0)
    """Learning rate of the warm start; None means ``train.lr``."""
    batch_size: int = Field(default=32, gt=0)
    """Demonstrations per SFT batch. A batch is one optimiser step, cut into micro-batches of
    ``train.micro_batch_size`` rows (or ``train.micro_batch_tokens``) whose gradients add up;
    with ``train.grad_accumulation`` it is ``ceil(micro-batches of a trainer rank /
    grad_accumulation)`` steps instead, as in RL (16 one-row demonstrations on one rank,
    micro-batches of 4, accumulation 2: 2 steps). ``sft/steps`` counts the optimiser steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How the warm start's learning rate moves over its batches (epochs x batches; the steps
    of one batch share its rate): ``constant``, or a ``linear``/``cosine`` decay to
    ``lr * min_lr_ratio`` at the last one."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate of a decaying schedule, as a fraction of the warm start's rate."""
    warmup_steps: int = Field(default=0, ge=0)
    """Batches of linear warm-up before the schedule starts (optimiser steps unless
    ``train.grad_accumulation`` cuts a batch into several; a randomly initialised model's first
    large steps are where a warm start can diverge)."""
    expert_noise: float = Field(default=0.0, ge=0, le=1)
    """Probability that an expert demonstration move is replaced (a sloppy demonstrator; ``source:
    expert``): by ``noise_action``, or by a random move the expert has made when that is None."""
    noise_action: str | None = None
    """The sloppy demonstrator's habitual move (e.g. ``down``); None: random moves
    (epsilon-greedy)."""
    reset_optimizer: bool = False
    """Start RL from a fresh optimiser after a full-weight warm start (as a separate RL run
    would: AdamW's first updates then move every weight by about ``train.lr``). False: RL
    continues the warm start's AdamW moments, whose second moments keep its first updates
    sized like the warm start's; the tests' and the quickstart's learning rates were chosen so
    (with a fresh optimiser a tiny policy at lr 4e-3 fell from 1.0 to 0.625 greedy success by
    step 20). A LoRA warm start always hands RL fresh adapters and moments."""
    noise_turns: int | None = Field(default=None, gt=0)
    """Only the first N moves of a demonstration may be replaced (1: a demonstrator that
    sometimes answers at once instead of using its tools, but always finishes what it starts);
    None: every move."""

    @model_validator(mode="after")
    def _file_needs_path(self) -> SFTConfig:
        if self.source == "file" and not self.path:
            raise ValueError("source 'file' needs path: a JSONL of trajectories")
        missing = self.path is not None and not Path(self.path).expanduser().exists()
        if self.source == "file" and self.epochs > 0 and missing:
            raise ConfigError(
                [
                    Problem(
                        "sft.path",
                        f"{self.path!r} does not exist; point it at a JSONL of "
                        '{"messages": [...]} lines, or set sft.source: expert',
                    )
                ]
            )
        return self


class TrajectoryLogConfig(Section):
    """Which episodes go to the run's trajectory store (``{output_dir}/trajectories/``, read by
    ``envhub view`` and ``envhub.runs.open``)."""

    every: int = Field(default=1, ge=0)
    """Store the training episodes of every N-th step (and every evaluation); 0 stores none."""
    sample: float = Field(default=1.0, gt=0)
    """Of a stored step, a fraction of its episodes (<= 1) or a count (> 1)."""
    keep_last: int | None = Field(default=None, ge=1)
    """Keep only the latest N stored training steps (None: all)."""


class LoggingConfig(Section):
    """Where metrics go besides ``metrics.jsonl`` (always written)."""

    tensorboard: bool = False
    """Write TensorBoard event files under ``{output_dir}/tensorboard``."""
    wandb: bool = False
    """Log to Weights & Biases (needs ``wandb`` installed and configured)."""
    wandb_project: str = "envhub"
    """W&B project name."""
    progress: bool = True
    """Show the live progress bar (output that is not a terminal gets plain ``step N: ...`` lines:
    the warm start, each evaluation, the last step, and one at least every 30 s); false: a plain
    line per step."""
    trajectories: TrajectoryLogConfig = Field(default_factory=TrajectoryLogConfig)
    """The trajectory store: every episode's messages, tokens, masks, log-probs, rewards."""
