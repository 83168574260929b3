"""Run metrics: ``metrics.jsonl`` (one line per step), optional TensorBoard/W&B, the PNG curve.

``metrics.jsonl`` is the run's record: every line has ``step`` and ``time_s`` (seconds since
the run started, warm start included), rollout statistics under ``train/``, evaluation
under ``eval/`` (when evaluated), losses under ``actor/``/``critic/``/``sft/`` and the time
of each phase under ``timing/``. A NaN or infinite value is ``null`` there (JSON has neither)
and reaches TensorBoard and W&B as itself, so a diverged metric shows in every sink. On
``--resume`` lines after the checkpoint's step are dropped, so the file reads as one
uninterrupted run. So is each sink: TensorBoard's older event
files cannot be rewritten, so the resumed run's writer starts with a ``SessionLog START`` at the
first step it writes again (``purge_step``), from which TensorBoard discards what they hold; W&B
continues the W&B run of the same id (the run's id, ``run.json``), and keeps the values it had
for the steps written again (it logs steps in increasing order only).

``logging.tensorboard`` writes scalar event files under ``{output_dir}/tensorboard``: through
``torch.utils.tensorboard`` when the ``tensorboard`` package is installed, otherwise through
:class:`EventFileWriter`, a small writer of the same TFRecord/``Event`` format (so TensorBoard,
installed anywhere, reads the run without the trainer depending on it).
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import TrainerError
from trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = [
    "EventFileWriter",
    "MetricsLog",
    "SignalWatch",
    "learning_signal",
    "plot_curves",
    "run_summary",
    "summarise",
]


def summarise(
    trajectories: Sequence[Trajectory], prefix: str, env_ids: Sequence[str] = ()
) -> dict[str, float]:
    """Success rate, mean return, turns, invalid-action rate, the share of episodes cut short
    (``truncated``: ``rollout.max_turns``, the context, or the env's time limit) and lengths of
    ``trajectories``, pooled over envs (weighted by episodes).

    With several envs, also per env ``{prefix}/{env id}/episodes``, ``/success`` and ``/reward``:
    for every env of ``env_ids`` (the run's ``env.ids``), so each env of a mix has its keys on
    every step, also on a step whose batch happened to hold another env alone. An env with no
    episode in ``trajectories`` gets ``/episodes`` 0 and no success or reward (a rate over no
    episodes: the curve has a gap there). Without ``env_ids``, the envs ``trajectories`` hold."""
    n = max(len(trajectories), 1)
    turns = sum(t.num_turns for t in trajectories)
    by_env: dict[str, list[Trajectory]] = {env_id: [] for env_id in env_ids}
    for t in trajectories:
        by_env.setdefault(t.env_id, []).append(t)
    per_env: dict[str, float] = {}
    for env_id, episodes in sorted(by_env.items()) if len(by_env) > 1 else ():
        per_env[f"{prefix}/{env_id}/episodes"] = float(len(episodes))
        if episodes:
            per_env[f"{prefix}/{env_id}/success"] = sum(t.success for t in episodes) / len(episodes)
            per_env[f"{prefix}/{env_id}/reward"] = sum(t.episode_reward for t in episodes) / len(
                episodes
            )
    return {
        **per_env,
        f"{prefix}/success": sum(t.success for t in trajectories) / n,
        f"{prefix}/reward": sum(t.episode_reward for t in trajectories) / n,
        f"{prefix}/turns": turns / n,
        f"{prefix}/invalid_rate": sum(t.invalid_actions for t in trajectories) / max(turns, 1),
        f"{prefix}/truncated": sum(t.truncated for t in trajectories) / n,
        f"{prefix}/response_tokens": sum(t.num_policy_tokens for t in trajectories) / n,
        f"{prefix}/sequence_tokens": sum(t.num_tokens for t in trajectories) / n,
        f"{prefix}/episodes": float(len(trajectories)),
    }


def run_summary(
    trajectories: Sequence[Trajectory], prefix: str, cfg: TrainerConfig
) -> dict[str, float]:
    """A run's row figures for ``trajectories``: ``summarise`` over the run's envs, and for a
    training batch (``prefix`` ``train``) its ``learning_signal`` under the run's estimator."""
    row = summarise(trajectories, prefix, cfg.env.ids)
    if prefix == "train":
        estimator = cfg.algorithm.advantage_estimator
        row.update(learning_signal(trajectories, cfg.rollout.max_new_tokens, estimator))
    return row


def learning_signal(
    trajectories: Sequence[Trajectory], max_new_tokens: int, estimator: str = "grpo"
) -> dict[str, float]:
    """What a training batch gives the policy to learn from.

    ``train/zero_variance_groups``: the share of groups whose episodes all got the same return,
    reported only when ``estimator`` (``algorithm.advantage_estimator``) has a group baseline
    (grpo, rloo, gigpo), which gives each of them advantage 0 (a group of one episode too: it
    has no other episode to compare with; for gigpo only the episode part is 0, a step advantage
    may remain). gae and reinforce_pp compare an episode with a critic or with the whole batch,
    so a tied or one-episode group still teaches: the key is left out.
    ``train/turns_at_max_new_tokens``: the share of policy turns that used all
    ``rollout.max_new_tokens`` tokens (cut short, unless the last one ended the turn)."""
    from trainer._config_checks import GROUP_ESTIMATORS

    turns = [length for t in trajectories for length in _turn_lengths(t)]
    signal = {
        "train/turns_at_max_new_tokens": sum(n >= max_new_tokens for n in turns)
        / max(len(turns), 1)
    }
    if estimator in GROUP_ESTIMATORS:
        groups: dict[int, set[float]] = {}
        for t in trajectories:
            groups.setdefault(t.group_id, set()).add(round(t.episode_reward, 9))  # (sum order)
        tied = sum(len(returns) == 1 for returns in groups.values())
        signal["train/zero_variance_groups"] = tied / max(len(groups), 1)
    return signal


def _turn_lengths(trajectory: Trajectory) -> list[int]:
    """Policy tokens of each turn of ``trajectory`` (its rows' ``response_mask`` between turn
    ends), read through ``token_array``: a row an env worker sent stays packed."""
    lengths = []
    for row in trajectory.rows:
        mask, start = row.token_array("response_mask"), 0
        for end in row.turn_ends:
            lengths.append(sum(mask[start : end + 1]))
            start = end + 1
    return lengths


class SignalWatch:
    """Says once when ``patience`` RL steps in a row had no learning signal, naming the likely
    cause from the step's metrics and where to look. A step is silent when it took no optimiser
    step (``actor/optimizer_steps`` 0: every episode masked, e.g. all truncated under
    ``algorithm.mask_truncated``), when every group's episodes got the same return under a
    group baseline (``train/zero_variance_groups`` 1.0: ``learning_signal``), or when the
    policy's gradient was exactly 0. A run in that state (every turn an invalid action, every
    answer cut at ``rollout.max_new_tokens``, a task every episode wins or loses, every episode
    cut at ``rollout.max_turns``) would otherwise train to its end without a word."""

    def __init__(self, run_dir: Path, max_new_tokens: int, patience: int = 3) -> None:
        self.run_dir, self.max_new_tokens, self.patience = run_dir, max_new_tokens, patience
        self.steps_without, self.warned = 0, False

    def observe(self, metrics: dict[str, Any]) -> str | None:
        """The warning line, the first time ``patience`` steps in a row lacked a signal."""
        if metrics.get("step", 0) == 0 or "train/episodes" not in metrics:
            return None  # the warm start, or a step without rollouts
        why = self._silence(metrics)
        self.steps_without = self.steps_without + 1 if why else 0
        if why is None or self.warned or self.steps_without < self.patience:
            return None
        self.warned = True
        return self._warning(metrics, why)

    @staticmethod
    def _silence(metrics: dict[str, Any]) -> str | None:
        """Why this step's policy update learnt nothing from its episodes; None if it did."""
        if metrics.get("actor/optimizer_steps") == 0.0:
            if metrics.get("train/truncated", 0.0) >= 1.0:
                return (
                    "every episode was truncated (train/truncated 1.00) and "
                    "algorithm.mask_truncated gives such episodes no loss tokens, so no "
                    "optimiser step was taken"
                )
            return "no episode had a token to train, so no optimiser step was taken"
        if metrics.get("train/zero_variance_groups", 0.0) >= 1.0:
            return "every group's episodes got the same reward, so every advantage is 0"
        if metrics.get("actor/grad_norm") == 0.0:
            return "the policy's gradient was exactly 0"
        return None

    def _warning(self, metrics: dict[str, Any], why: str) -> str:
        invalid = metrics.get("train/invalid_rate", 0.0)
        cut = metrics.get("train/turns_at_max_new_tokens", 0.0)
        success = metrics.get("train/success", 0.0)
        truncated = metrics.get("train/truncated", 0.0)
        causes = []
        if truncated >= 0.5:
            causes.append(
                f"train/truncated {truncated:.2f}: episodes end at rollout.max_turns or the "
                "context before the env ends them: raise rollout.max_turns, or set "
                "algorithm.mask_truncated=false to train them with the rewards they earned"
            )
        if invalid >= 0.5:
            causes.append(
                f"train/invalid_rate {invalid:.2f}: the policy's turns are not valid actions "
                "(the env's feedback in the episodes says why: the answer format, the tools)"
            )
        if cut >= 0.5:
            causes.append(
                f"{cut:.0%} of turns used all rollout.max_new_tokens={self.max_new_tokens} "
                "tokens: raise it"
            )
        if success in (0.0, 1.0):
            causes.append(
                f"train/success {success:.2f}: every episode "
                f"{'won' if success else 'lost'}, the task is too "
                f"{'easy' if success else 'hard'} for this policy"
            )
        causes.append("a warm start (sft.epochs > 0) teaches the answer format first")
        return (
            f"no learning signal for {self.steps_without} steps: {why} and the policy learns "
            f"nothing. Likely: {'; '.join(causes)}. See the episodes with "
            f"`envhub view {self.run_dir}`"
        )


class MetricsLog:
    """Appends step metrics to ``{output_dir}/metrics.jsonl`` (and TensorBoard/W&B if enabled)."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "envhub",
        config: dict[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb: Any = None
        self._tb_dir = self.path.parent / "tensorboard" if tensorboard else None
        self._purge_step: int | None = None
        self._wandb: Any = None
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise TrainerError(
                    "logging.wandb needs the wandb package; pip install wandb, "
                    "or set logging.wandb=false"
                ) from None
            resume = {"id": run_id, "resume": "allow"} if run_id else {}  # --resume: the same run
            self._wandb = wandb_module.init(
                project=wandb_project, config=config, dir=str(self.path.parent), **resume
            )

    def _tensorboard(self, logdir: Path) -> Any:
        """The TensorBoard writer, opened at the first write (after :meth:`truncate_after`, one
        that purges the older files' steps from there on)."""
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # no tensorboard package: the built-in writer of the same format
                self._tb = EventFileWriter(logdir, purge_step=self._purge_step)
            else:
                self._tb = SummaryWriter(str(logdir), purge_step=self._purge_step)
        return self._tb

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> list[dict[str, Any]]:
        """Drop lines of steps after ``step`` (written by a run killed before its next
        checkpoint), and a line cut short by that kill (or a full disk) that no longer parses.
        The file is replaced atomically: a kill meanwhile leaves the old one. TensorBoard drops
        those steps of the older event files once this log writes again (module docstring)."""
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and row.get("step", 0) <= step:
                    kept.append(row)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with tmp.open("w") as f:
            f.write("".join(json.dumps(row) + "\n" for row in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._purge_step = step + 1
        if self._tb is not None:  # the next write opens a writer that purges
            self._tb.close()
            self._tb = None
        return kept

    def write(self, metrics: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        step = int(metrics.get("step", 0))
        # NaN and inf as they are: a sink that drops them shows a diverged metric as no point
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb_dir is not None:
            tb = self._tensorboard(self._tb_dir)
            for key, value in numbers.items():
                tb.add_scalar(key, value, step)
            tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecord files."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 fields are encoded as their two's complement
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


class EventFileWriter:
    """Scalars as a TensorBoard event file, written without the ``tensorboard`` package.

    The file is a TFRecord stream (``uint64 length, masked CRC-32C of it, data, masked
    CRC-32C of data``) of ``tensorflow.Event`` protobufs: first ``file_version:
    "brain.Event:2"``, then one event per ``add_scalar`` holding ``summary.value {tag,
    simple_value}``, the fields TensorBoard's scalar dashboard reads. The protobuf bytes are
    encoded here by field number (wall_time=1, step=2, file_version=3, summary=5,
    session_log=7; Summary.value=1; Value.tag=1, Value.simple_value=2; SessionLog.status=1,
    START=1). Same ``add_scalar``/``flush``/``close`` calls and ``purge_step`` as
    ``torch.utils.tensorboard.SummaryWriter``: with ``purge_step``, a ``session_log {status:
    START}`` event at that step follows the version, and TensorBoard then drops the data of the
    earlier files from that step on (a resumed run writing those steps again).
    """

    def __init__(self, logdir: str | Path, *, purge_step: int | None = None) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        name = f"events.out.tfevents.{stamp}.envhub"
        self.path = self.logdir / name
        self._file = self.path.open("ab")
        self._write_event(_length_delimited(3, b"brain.Event:2"), step=purge_step or 0)
        if purge_step is not None:
            start = _varint(1 << 3) + _varint(1)  # SessionLog.status = START
            self._write_event(_length_delimited(7, start), step=purge_step)
        self.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar ``value`` of ``tag`` at global step ``step``."""
        summary_value = (
            _length_delimited(1, tag.encode())
            + _varint(2 << 3 | 5)
            + struct.pack("<f", float(value))
        )
        self._write_event(_length_delimited(5, _length_delimited(1, summary_value)), step=step)

    def _write_event(self, body: bytes, *, step: int) -> None:
        event = _varint(1 << 3 | 1) + struct.pack("<d", time.time())
        if step:
            event += _varint(2 << 3) + _varint(int(step))
        event += body
        header = struct.pack("<Q", len(event))
        self._file.write(
            header
            + struct.pack("<I", _masked_crc(header))
            + event
            + struct.pack("<I", _masked_crc(event))
        )

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def plot_curves(
    rows: Sequence[dict[str, Any]], png: str | Path, title: str = "envhub train"
) -> Path:
    """Training and eval success (left axis, fixed at [0, 1]) and the training mean return
    (``train/reward``, right axis, its limits from the data: returns are not rates and may lie
    anywhere) against wall time, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, rates = plt.subplots(figsize=(7, 4))
    curves = (
        ("train/success", "-", "C0", rates),
        ("eval/success", "o-", "C2", rates),
        ("train/reward", ":", "C1", None),  # None: on the returns' own axis
    )
    lines, top = [], rates  # the legend goes on the axis drawn last, over every line
    for key, style, color, axis in curves:
        points = [
            (r["time_s"] / 60, r[key]) for r in rows if r.get(key) is not None and "time_s" in r
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            if axis is None:
                axis = top = rates.twinx()
                axis.set_ylabel("mean return (train/reward)")
            lines += axis.plot(xs, ys, style, color=color, label=key)
    rates.set_xlabel("wall time (minutes, warm start included)")
    rates.set_ylabel("success rate")
    rates.set_ylim(-0.05, 1.05)
    rates.grid(alpha=0.3)
    top.legend(handles=lines, loc="lower right")
    rates.set_title(title)
    fig.tight_layout()
    target = Path(png)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
