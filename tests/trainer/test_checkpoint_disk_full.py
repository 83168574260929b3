"""A save on a full disk is the ``CheckpointError`` the checkpoint module promises, with the
checkpoint to continue from, wherever the save fails: before anything is written (the disk
filled up between saves), or after the commit (the ``latest`` pointer, the pruning), where
the step was saved. The last good checkpoint is always left loadable."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import trainer.checkpoint
from trainer.checkpoint import CheckpointManager
from trainer.errors import CheckpointError


def disk_full(path: Any) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("failing", ["mkdir", "rename"])
def test_a_disk_full_before_the_commit_names_the_checkpoint_to_continue_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """``mkdir``: the save's temporary folder (the disk filled up since the last save);
    ``rename``: its commit (a new directory entry needs a block too)."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"actor": torch.ones(1)})
    real = getattr(os, failing)

    def full(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name.startswith(".tmp-step_"):  # the save's temporary folder
            raise disk_full(path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, failing, full)
    with pytest.raises(CheckpointError) as error:
        manager.save(2, states={"actor": torch.ones(1)})
    monkeypatch.undo()
    message = str(error.value)
    assert message.startswith("saving the checkpoint of step 2 failed: No space left on device")
    assert f"Free space in {tmp_path}, then continue from {tmp_path / 'step_00000001'}" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step_00000001"]
    manager.close()
    assert CheckpointManager(tmp_path).load().step == 1


def test_a_disk_full_after_the_commit_says_the_step_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is complete once renamed in; a failing ``latest`` rewrite is repaired by
    the next start, so the message names the new checkpoint, not the older one."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"actor": torch.ones(1)})

    def full_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name.startswith(".tmp-latest"):
            raise disk_full(path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(trainer.checkpoint, "open", full_open, raising=False)
    with pytest.raises(CheckpointError) as error:
        manager.save(2, states={"actor": torch.full((1,), 2.0)})
    monkeypatch.undo()
    message = str(error.value)
    assert message.startswith(f"the checkpoint of step 2 was saved ({tmp_path / 'step_00000002'})")
    assert "No space left on device" in message and f"Free space in {tmp_path}" in message
    assert f"continue from {tmp_path / 'step_00000002'} with --resume" in message
    manager.close()
    assert CheckpointManager(tmp_path).load().load_state("actor").item() == 2.0


def test_a_prune_failing_after_the_commit_says_the_step_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, states={"actor": torch.ones(1)})
    real_rename = os.rename

    def rename(source: Any, target: Any) -> None:
        if Path(target).name.startswith(".pruned-"):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(source))
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="the checkpoint of step 2 was saved") as error:
        manager.save(2, states={"actor": torch.full((1,), 2.0)})
    monkeypatch.undo()
    assert "Permission denied" in str(error.value) and "Fix that, then" in str(error.value)
    manager.close()
    assert CheckpointManager(tmp_path, keep=1).load().step == 2
