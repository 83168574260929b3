"""TensorBoard and W&B sinks: a run with them on leaves the same numbers as ``metrics.jsonl``.

TensorBoard event files are read back with TensorBoard's own reader when the package is
installed, otherwise with the small TFRecord/protobuf decoder below (CRCs checked), so the
test pins the on-disk format either way. W&B runs in offline mode and only when ``wandb`` is
installed (it is not a dependency of the trainer).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import load_config
from trainer.metrics import EventFileWriter, crc32c
from trainer.pipeline import AgenticPipeline


def train(out: Path, *overrides: str) -> list[dict]:
    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            "train.steps=2",
            "train.ppo_epochs=1",
            "sft.epochs=0",
            "eval.episodes=4",
            "eval.every=1",
            "checkpoint.every=0",
            f"output_dir={out}",
            *overrides,
        ],
    )
    return AgenticPipeline(cfg).fit()


# ----------------------------------------------------------------------------- a TFRecord reader


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i


def _fields(data: bytes) -> list[tuple[int, object]]:
    """``(field number, value)`` of a protobuf message (varint, fixed64, bytes, fixed32)."""
    out, i = [], 0
    while i < len(data):
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 1:
            value, i = data[i : i + 8], i + 8
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i : i + size], i + size
        elif wire == 5:
            value, i = data[i : i + 4], i + 4
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((field, value))
    return out


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars_raw(folder: Path) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """(file versions, tag -> [(step, value)]) from every event file in ``folder``."""
    versions, scalars = [], {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            header = data[i : i + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[i + 8 : i + 12])[0] == _masked(crc32c(header)), (
                "bad length CRC"
            )
            event = data[i + 12 : i + 12 + length]
            assert struct.unpack("<I", data[i + 12 + length : i + 16 + length])[0] == _masked(
                crc32c(event)
            ), "bad CRC"
            i += 16 + length
            fields = dict(_fields(event))
            step = int(fields.get(2, 0))
            if 3 in fields:
                versions.append(fields[3].decode())
            for number, value in _fields(fields.get(5, b"")):
                if number == 1:
                    parts = dict(_fields(value))
                    scalars.setdefault(parts[1].decode(), []).append(
                        (step, struct.unpack("<f", parts[2])[0])
                    )
    return versions, scalars


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)], by TensorBoard's EventAccumulator if installed, else our reader."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        versions, scalars = read_scalars_raw(folder)
        assert versions == ["brain.Event:2"]
        return scalars
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


# ----------------------------------------------------------------------------- tests


def test_crc32c_matches_the_castagnoli_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(b"") == 0


def test_event_writer_round_trips_scalars(tmp_path: Path) -> None:
    writer = EventFileWriter(tmp_path)
    writer.add_scalar("train/success", 0.25, 1)
    writer.add_scalar("train/success", 0.75, 2)
    writer.add_scalar("timing/train_s", 1.5, 3_000_000_000)  # steps past 2**31 are int64 varints
    writer.close()
    versions, scalars = read_scalars_raw(tmp_path)
    assert versions == ["brain.Event:2"]
    assert scalars == {
        "train/success": [(1, 0.25), (2, 0.75)],
        "timing/train_s": [(3_000_000_000, 1.5)],
    }


def test_tensorboard_event_files_hold_the_run_metrics(tmp_path: Path) -> None:
    rows = train(tmp_path / "run", "logging.tensorboard=true")
    folder = tmp_path / "run" / "tensorboard"
    assert list(folder.glob("events.out.tfevents.*")), "no event file written"
    scalars = read_scalars(folder)
    for key in ("train/success", "eval/success", "actor/pg_loss", "timing/train_s"):
        expected = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
        assert [step for step, _ in scalars[key]] == [step for step, _ in expected], key
        assert [value for _, value in scalars[key]] == pytest.approx(
            [value for _, value in expected], rel=1e-6
        ), key
    assert [step for step, _ in scalars["eval/success"]] == [0, 1, 2]


def test_wandb_offline_run_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is optional: pip install wandb to test the W&B sink")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(tmp_path / "run", "logging.wandb=true", "logging.wandb_project=envhub-test")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), "no offline W&B run file"
