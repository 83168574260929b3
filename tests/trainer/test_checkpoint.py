"""Atomic checkpoints: round trip, RNG restore, pruning, and kill -9 in the middle of a write."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer.checkpoint import CheckpointManager, capture_rng, restore_rng
from trainer.errors import CheckpointError

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install torch==2.13.0, then -e '.[train]')"
)

REPO = Path(__file__).resolve().parents[2]


def tiny_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_round_trip_restores_model_optimizer_seeds_extra_and_rng(tmp_path: Path) -> None:
    model, optimizer = tiny_model_and_optimizer()
    manager = CheckpointManager(tmp_path, keep=2)
    path = manager.save(
        3,
        states={"actor": model.state_dict(), "actor_optim": optimizer.state_dict()},
        seeds={"data": 11, "env": [5, 6]},
        extra={"episodes_seen": 96, "history": [0.1, 0.2]},
        config={"train": {"lr": 0.1}},
    )
    after_save = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    fresh, fresh_optimizer = torch.nn.Linear(4, 2), None
    ckpt = manager.load()
    assert ckpt.path == path == tmp_path / "step_00000003" and ckpt.step == 3
    fresh.load_state_dict(ckpt.load_state("actor"))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_optimizer.load_state_dict(ckpt.load_state("actor_optim"))
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )
    exp_avg = fresh_optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, optimizer.state_dict()["state"][0]["exp_avg"])
    assert ckpt.seeds == {"data": 11, "env": [5, 6]}
    assert ckpt.extra == {"episodes_seen": 96, "history": [0.1, 0.2]}
    assert ckpt.config == {"train": {"lr": 0.1}}

    random.random(), np.random.rand(), torch.rand(1)  # move every generator on
    restore_rng(ckpt.rng)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == after_save


def test_keep_prunes_old_checkpoints_and_latest_follows(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 6):
        manager.save(step, states={"w": torch.tensor([float(step)])}, rng=False)
    assert [p.name for p in manager.list()] == ["step_00000004", "step_00000005"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"
    manager.save(5, states={"w": torch.tensor([50.0])})  # re-saving a step replaces it
    assert float(manager.load().load_state("w")) == 50.0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        "latest",
        "step_00000004",
        "step_00000005",
    ]


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"w": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="disk on fire"), manager.writing(2) as writer:
        writer.save_state("w", torch.ones(2))
        raise RuntimeError("disk on fire")
    assert manager.latest() == tmp_path / "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step_00000001"]


def test_files_written_by_callables_and_a_bad_pointer(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(7, files={"hf_model": lambda folder: (folder / "config.json").write_text("{}")})
    assert (tmp_path / "step_00000007" / "hf_model" / "config.json").read_text() == "{}"
    (tmp_path / "latest").write_text("step_99999999\n")  # a stale pointer: the newest commit wins
    assert manager.load().step == 7
    manager.close()
    CheckpointManager(tmp_path)  # and the next manager repairs the pointer
    assert (tmp_path / "latest").read_text() == "step_00000007\n"


def test_errors_name_the_fix(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "empty")
    with pytest.raises(
        CheckpointError, match="no checkpoint in .*empty; run without --resume to start fresh"
    ):
        manager.load()
    manager.save(1, states={"actor": {}}, rng=False)
    with pytest.raises(CheckpointError, match=r"has no state 'critic'; it has \['actor'\]"):
        manager.load().load_state("critic")
    with pytest.raises(CheckpointError, match="state name 'a/b' must use only"):
        manager.save(2, states={"a/b": 1})
    with pytest.raises(CheckpointError, match="keep=0: must keep at least 1"):
        CheckpointManager(tmp_path, keep=0)


def test_rng_capture_covers_python_numpy_torch() -> None:
    state = capture_rng()
    assert {"python", "numpy", "torch"} <= set(state)


# --------------------------------------------------------------------------- kill -9

CHILD_MID_WRITE = """
import sys, time, torch
from trainer.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1], keep=2)
manager.save(1, states={"model": {"w": torch.ones(4)}}, seeds={"env": 1})
with manager.writing(2) as writer:
    writer.save_state("model", {"w": torch.full((4,), 2.0)})
    print("MID-WRITE", flush=True)
    time.sleep(120)
"""

CHILD_LOOP = """
import sys, torch
from trainer.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1], keep=2)
step = 0
while True:
    step += 1
    manager.save(
        step, states={"model": {"w": torch.full((1 << 18,), float(step))}}, seeds={"step": step}
    )
    print(step, flush=True)
"""


def run_child(code: str, root: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True, env=env
    )


def test_kill_9_mid_write_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    child = run_child(CHILD_MID_WRITE, tmp_path)
    try:
        assert child.stdout.readline().strip() == "MID-WRITE"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    # the torn write
    assert any(p.name.startswith(".tmp-step_00000002") for p in tmp_path.iterdir())

    manager = CheckpointManager(tmp_path)
    assert [p.name for p in manager.removed_partial] and not any(
        p.name.startswith(".") and p.name != ".lock" for p in tmp_path.iterdir()
    )
    ckpt = manager.load()
    assert ckpt.step == 1 and ckpt.seeds == {"env": 1}
    assert torch.equal(ckpt.load_state("model")["w"], torch.ones(4))


def test_kill_9_at_an_arbitrary_moment_of_a_save_loop(tmp_path: Path) -> None:
    child = run_child(CHILD_LOOP, tmp_path)
    try:
        while int(child.stdout.readline()) < 3:
            pass
        time.sleep(random.uniform(0.0, 0.2))  # somewhere inside a later save
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    manager = CheckpointManager(tmp_path)
    complete = manager.list()
    assert complete, "the completed checkpoints were lost"
    ckpt = manager.load()
    assert ckpt.path == complete[-1] and ckpt.step >= 3
    assert (tmp_path / "latest").read_text().strip() == ckpt.path.name
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != ".lock"]
    assert float(ckpt.load_state("model")["w"][0]) == float(ckpt.step) and ckpt.seeds == {
        "step": ckpt.step
    }


# --------------------------------------------------------------------------- damaged or odd folders


class Killed(BaseException):
    """Stands in for SIGKILL in the middle of a deletion (nothing after it runs)."""


def test_a_kill_while_pruning_never_brings_the_pruned_checkpoint_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import trainer.checkpoint

    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, states={"actor": torch.ones(1)}, config={"seed": 1})
    real_rmtree = shutil.rmtree

    def killed_mid_delete(path: Any, ignore_errors: bool = False) -> None:
        if "step_00000001" in str(path):  # the pruned one: its small files go first
            for name in ("rng.pt", "extra.pt", "config.json"):
                (Path(path) / name).unlink(missing_ok=True)
            raise Killed
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(trainer.checkpoint.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(Killed):
        manager.save(2, states={"actor": torch.zeros(1)}, config={"seed": 1})
    manager.close()
    monkeypatch.setattr(trainer.checkpoint.shutil, "rmtree", real_rmtree)
    after = CheckpointManager(tmp_path, keep=1)
    assert after.restored == []
    assert [p.name for p in after.list()] == ["step_00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step_00000002"]


@pytest.mark.parametrize("name", ["rng.pt", "extra.pt", "config.json"])
def test_a_checkpoint_missing_a_file_it_was_saved_with_is_refused_naming_it(
    tmp_path: Path, name: str
) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"actor": torch.ones(1)}, config={"seed": 1})
    manager.save(2, states={"actor": torch.ones(1)}, config={"seed": 1})
    (tmp_path / "step_00000002" / name).unlink()
    with pytest.raises(CheckpointError) as error:
        manager.load()
    assert f"{tmp_path / 'step_00000002'} lacks {name}" in str(error.value)
    assert "older complete checkpoint step_00000001" in str(error.value)


def test_a_checkpoint_saved_without_rng_or_config_loads_without_them(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"actor": torch.ones(1)}, rng=False)
    checkpoint = manager.load()
    assert checkpoint.rng == {} and checkpoint.config is None and checkpoint.warnings == []


def test_an_older_checkpoint_without_its_rng_file_loads_with_a_warning(tmp_path: Path) -> None:
    import json

    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"actor": torch.ones(1)})
    meta = json.loads((tmp_path / "step_00000001" / "meta.json").read_text())
    meta.pop("files", None)  # written before meta.json listed its files
    (tmp_path / "step_00000001" / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "step_00000001" / "rng.pt").unlink()
    checkpoint = manager.load()
    assert checkpoint.rng == {}
    assert any("rng.pt" in line for line in checkpoint.warnings), checkpoint.warnings


def test_a_disk_full_during_a_save_names_the_checkpoint_to_continue_from(tmp_path: Path) -> None:
    import errno

    def disk_full(folder: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.bin"))

    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"actor": torch.ones(1)})
    with pytest.raises(CheckpointError) as error:
        manager.save(2, states={"actor": torch.ones(1)}, files={"hf": disk_full})
    message = str(error.value)
    assert message.startswith("saving the checkpoint of step 2 failed: No space left on device")
    assert f"continue from {tmp_path / 'step_00000001'} with --resume" in message
    assert "Free space in" in message
    assert [p.name for p in manager.list()] == ["step_00000001"]


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("rng.pt", {"python": "n"}),
        ("rng.pt", {"numpy": [1, 2]}),
        ("rng.pt", {"torch": torch.zeros(3)}),
        ("rng.pt", [1, 2]),
        ("extra.pt", [1, 2]),
    ],
)
def test_rng_or_extra_of_the_wrong_type_is_refused_naming_the_file(
    tmp_path: Path, name: str, data: Any
) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"actor": torch.ones(1)})
    torch.save(data, tmp_path / "step_00000001" / name)
    checkpoint = manager.load()
    with pytest.raises(CheckpointError, match=f"step_00000001/{name} holds"):
        restore_rng(checkpoint.rng)
        checkpoint.extra.get("time_s")


def test_a_symlinked_step_folder_is_not_a_checkpoint(tmp_path: Path) -> None:
    outside = CheckpointManager(tmp_path / "outside")
    outside.save(9, states={"actor": torch.ones(1)})
    outside.close()
    manager = CheckpointManager(tmp_path / "run")
    manager.save(1, states={"actor": torch.ones(1)})
    link = tmp_path / "run" / "step_00000009"
    link.symlink_to(tmp_path / "outside" / "step_00000009")
    assert manager.list() == [tmp_path / "run" / "step_00000001"]
    assert manager.latest() == tmp_path / "run" / "step_00000001"
    assert manager.symlinked() == [link]
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        manager.load(link)


def test_rng_states_saved_on_a_gpu_machine_pass_the_check(tmp_path: Path) -> None:
    """CUDA generator states are not CPU ones (16 bytes): checked by type, not by a CPU
    generator, so a GPU run's checkpoint is not refused."""
    manager = CheckpointManager(tmp_path)
    cuda_states = [torch.zeros(16, dtype=torch.uint8)]
    manager.save(
        1, states={"actor": torch.ones(1)}, rng={**capture_rng(), "torch_cuda": cuda_states}
    )
    assert torch.equal(manager.load().rng["torch_cuda"][0], cuda_states[0])
