"""Run metrics: ``metrics.jsonl`` (one line per step), optional TensorBoard/W&B, the PNG curve.

``metrics.jsonl`` is the run's record: every line has ``step`` and ``time_s`` (seconds since
the run started, warm start included), rollout statistics under ``train/``, evaluation
under ``eval/`` (when evaluated), losses under ``actor/``/``critic/``/``sft/`` and the time
of each phase under ``timing/``. On ``--resume`` lines after the checkpoint's step are
dropped, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.errors import TrainerError
from trainer.rollout.trajectory import Trajectory

__all__ = ["MetricsLog", "plot_curves", "summarise"]


def summarise(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
    """Success rate, mean return, turns, invalid-action rate and lengths of ``trajectories``."""
    n = max(len(trajectories), 1)
    turns = sum(t.num_turns for t in trajectories)
    return {
        f"{prefix}/success": sum(t.success for t in trajectories) / n,
        f"{prefix}/reward": sum(t.episode_reward for t in trajectories) / n,
        f"{prefix}/turns": turns / n,
        f"{prefix}/invalid_rate": sum(t.invalid_actions for t in trajectories) / max(turns, 1),
        f"{prefix}/response_tokens": sum(t.num_policy_tokens for t in trajectories) / n,
        f"{prefix}/sequence_tokens": sum(len(t.token_ids) for t in trajectories) / n,
        f"{prefix}/episodes": float(len(trajectories)),
    }


class MetricsLog:
    """Appends step metrics to ``{output_dir}/metrics.jsonl`` (and TensorBoard/W&B if enabled)."""

    def __init__(self, output_dir: str | Path, *, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "envhub", config: dict[str, Any] | None = None) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise TrainerError(f"logging.tensorboard needs the tensorboard package ({error}); "
                                   "pip install tensorboard, or set logging.tensorboard=false") from None
            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise TrainerError("logging.wandb needs the wandb package; pip install wandb, "
                                   "or set logging.wandb=false") from None
            self._wandb = wandb_module.init(project=wandb_project, config=config, dir=str(self.path.parent))

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> list[dict[str, Any]]:
        """Drop lines of steps after ``step`` (written by a run killed before its next checkpoint)."""
        kept = [row for row in self.read() if row.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        return kept

    def write(self, metrics: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        step = int(metrics.get("step", 0))
        numbers = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def plot_curves(rows: Sequence[dict[str, Any]], png: str | Path, title: str = "envhub train") -> Path:
    """Training reward/success and eval success against wall time, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train/success", "-"), ("train/reward", ":"), ("eval/success", "o-")):
        points = [(r["time_s"] / 60, r[key]) for r in rows if r.get(key) is not None and "time_s" in r]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, label=key)
    ax.set_xlabel("wall time (minutes, warm start included)")
    ax.set_ylabel("rate / mean return")
    ax.set_ylim(-0.15, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    target = Path(png)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
