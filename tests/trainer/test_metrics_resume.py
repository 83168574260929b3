"""Metric sinks after ``--resume``: TensorBoard shows each step once, with the resumed run's
value, and W&B continues the same run instead of starting another one.

A resumed run writes again the steps between its checkpoint and the kill. ``metrics.jsonl``
drops the killed run's lines; for TensorBoard, whose older event files cannot be rewritten,
the resumed writer starts with a ``SessionLog START`` event at the first step it writes again,
from which TensorBoard discards the older files' data (``purge_step`` of
``torch.utils.tensorboard.SummaryWriter``). The event files are read back with TensorBoard's
own ``EventAccumulator`` when it is installed, otherwise by the reader below, which applies the
rule of ``EventAccumulator._CheckForRestartAndMaybePurge``.
"""

from __future__ import annotations

import importlib.machinery
import struct
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.test_metric_sinks import _fields, read_scalars_raw
from trainer.metrics import MetricsLog

_SESSION_LOG, _START = 7, 1  # event.proto: Event.session_log (6 is log_message); START


def tensorboard_shows(folder: Path) -> list[tuple[int, float]]:
    """``(step, value)`` of ``train/reward`` as TensorBoard shows them."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        pass
    else:
        accumulator = EventAccumulator(str(folder))
        accumulator.Reload()
        return [(e.step, e.value) for e in accumulator.Scalars("train/reward")]
    read_scalars_raw(folder)  # (checks every CRC)
    shown: list[tuple[int, float]] = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            fields = dict(_fields(data[i + 12 : i + 12 + length]))
            i += 16 + length
            step = int(fields.get(2, 0))
            if dict(_fields(fields.get(_SESSION_LOG, b""))).get(1) == _START:
                shown = [(s, v) for s, v in shown if s < step]
            for number, value in _fields(fields.get(5, b"")):
                parts = dict(_fields(value))
                if number == 1 and parts[1] == b"train/reward":
                    shown.append((step, struct.unpack("<f", parts[2])[0]))
    return shown


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path: Path) -> None:
    killed = MetricsLog(tmp_path, tensorboard=True)  # checkpoint at 3, killed after step 5
    for step in range(1, 6):
        killed.write({"step": step, "train/reward": float(step)})
    killed.close()
    resumed = MetricsLog(tmp_path, tensorboard=True)
    resumed.truncate_after(3)  # what AgenticPipeline.restore does
    for step in range(4, 7):
        resumed.write({"step": step, "train/reward": 100.0 + step})
    resumed.close()
    assert [row["step"] for row in resumed.read()] == [1, 2, 3, 4, 5, 6]
    assert sorted(tensorboard_shows(tmp_path / "tensorboard")) == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 104.0),
        (5, 105.0),
        (6, 106.0),
    ]


def test_a_fresh_run_purges_nothing(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, tensorboard=True)
    for step in range(3):
        log.write({"step": step, "train/reward": float(step)})
    log.close()
    assert tensorboard_shows(tmp_path / "tensorboard") == [(0, 0.0), (1, 1.0), (2, 2.0)]


@pytest.fixture
def wandb_inits(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A stand-in ``wandb`` module recording each ``wandb.init``'s arguments."""
    inits: list[dict[str, Any]] = []

    class Run:
        def log(self, *args: Any, **kwargs: Any) -> None: ...

        def finish(self) -> None: ...

    def init(**kwargs: Any) -> Run:
        inits.append(kwargs)
        return Run()

    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # (config checks look it up)
    wandb.init = init
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return inits


def test_a_resumed_run_continues_its_wandb_run(
    tmp_path: Path, wandb_inits: list[dict[str, Any]]
) -> None:
    pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
    from tests.trainer.test_cli import QUICKSTART, TINY
    from trainer.config import load_config
    from trainer.pipeline import AgenticPipeline
    from trainer.resume import run_id_of

    out = tmp_path / "run"
    cfg = load_config(
        QUICKSTART,
        [*TINY, "sft.epochs=0", "train.steps=1", "logging.wandb=true", f"output_dir={out}"],
    )
    first = AgenticPipeline(cfg)
    try:
        first.save_checkpoint()  # (a resume without a checkpoint is refused)
    finally:
        first.close()
    AgenticPipeline(cfg, resume=True).close()
    run_id = run_id_of(out)
    assert run_id is not None
    assert [(init.get("id"), init.get("resume")) for init in wandb_inits] == [
        (run_id, "allow"),
        (run_id, "allow"),
    ]
