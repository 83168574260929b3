"""The run-lifecycle sections of the trainer config: what happens around the RL steps.

``checkpoint`` (atomic saves for ``--resume``), ``eval`` (periodic evaluation), ``sft`` (the
optional supervised warm start before RL) and ``logging`` (metric sinks besides
``metrics.jsonl``). None of them changes what one training step computes. They are parts of
the tree in ``trainer.config``; build the whole config with ``trainer.config.load_config``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainer.config_section import Section

__all__ = ["CheckpointConfig", "EvalConfig", "LoggingConfig", "SFTConfig"]


class CheckpointConfig(Section):
    """Atomic checkpoints for ``--resume``."""

    every: int = Field(default=10, ge=0)
    """Save every N steps (and after the last step); 0 saves only at the end."""
    keep: int = Field(default=2, gt=0)
    """Keep the newest N checkpoints; older ones are deleted after a successful save."""
    dir: str | None = None
    """Checkpoint folder; None means ``{output_dir}/checkpoints``; relative to ``output_dir``."""


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
    """JSONL of trajectories (``source: file``)."""
    episodes: int = Field(default=64, gt=0)
    """Demonstrations to collect from the expert (``source: expert``)."""
    lr: float | None = Field(default=None, gt=0)
    """Learning rate of the warm start; None means ``train.lr``."""
    batch_size: int = Field(default=32, gt=0)
    """Demonstrations per SFT optimiser step."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How the warm start's learning rate moves over its optimiser steps (epochs x batches):
    ``constant``, or a ``linear``/``cosine`` decay to ``lr * min_lr_ratio`` at the last one."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate of a decaying schedule, as a fraction of the warm start's rate."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimiser steps of linear warm-up before the schedule starts (a randomly initialised
    model's first large steps are where a warm start can diverge)."""
    expert_noise: float = Field(default=0.0, ge=0, le=1)
    """Probability that an expert demonstration move is replaced (a sloppy demonstrator; ``source:
    expert``): by ``noise_action``, or by a random move the expert has made when that is None."""
    noise_action: str | None = None
    """The sloppy demonstrator's habitual move (e.g. ``down``); None: random moves
    (epsilon-greedy)."""
    noise_turns: int | None = Field(default=None, gt=0)
    """Only the first N moves of a demonstration may be replaced (1: a demonstrator that
    sometimes answers at once instead of using its tools, but always finishes what it starts);
    None: every move."""

    @model_validator(mode="after")
    def _file_needs_path(self) -> SFTConfig:
        if self.source == "file" and not self.path:
            raise ValueError("source 'file' needs path: a JSONL of trajectories")
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
    """Show the live progress bar."""
    trajectories: TrajectoryLogConfig = Field(default_factory=TrajectoryLogConfig)
    """The trajectory store: every episode's messages, tokens, masks, log-probs, rewards."""
