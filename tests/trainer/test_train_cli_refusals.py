"""``envhub train`` refuses what it cannot do before it costs anything, and never loses a run.

A fresh start moves only a previous envhub run aside (never a folder of other files, never the
folder it runs from), and a start that fails before its first checkpoint puts that run back;
``--resume`` refuses a missing checkpoint or a shape-changing setting before building anything;
``--dry-run`` answers from the config as loaded; a setting refused while building is one
``error:`` line, not a traceback. Most tests stand in a recorder for the build (``_run``): they
pin what the CLI decides before it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
import yaml
from click.testing import CliRunner, Result

import trainer.cli
from envhub.cli import main
from trainer.checkpoint import CheckpointManager
from trainer.errors import TrainerError

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
Runs = list[tuple[Any, bool]]
"""The ``(config, resume)`` of each run the CLI went on to start."""
CHEAP = ["sft.epochs=0", "train.steps=0", "eval.episodes=2", "logging.progress=false"]


def train(*args: str) -> Result:
    return CliRunner().invoke(main, ["train", str(QUICKSTART), *CHEAP, *args])


def record_runs(monkeypatch: pytest.MonkeyPatch) -> Runs:
    """Stand a recorder in for ``_run`` (the build and the run): the ``(config, resume)`` of each
    run the CLI went on to start."""
    calls: Runs = []

    def run(cfg: Any, resume: bool, console: Any) -> list[dict[str, Any]]:
        calls.append((cfg, resume))
        return [{"time_s": 1.0}]

    monkeypatch.setattr(trainer.cli, "_run", run)
    return calls


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Runs:
    return record_runs(monkeypatch)


def previous_run(out: Path, step: int = 4, *overrides: str) -> Path:
    """A run folder as ``envhub train`` leaves it: run.json, metrics and a checkpoint of ``step``
    saved with the quickstart's config (LoRA off, 120 steps) and ``overrides``."""
    from trainer.config import load_config

    saved = load_config(QUICKSTART, [f"output_dir={out}", *overrides])
    out.mkdir(parents=True)
    (out / "run.json").write_text('{"run_id": "previous"}\n')
    (out / "metrics.jsonl").write_text(f'{{"step": {step}}}\n')
    manager = CheckpointManager(out / "checkpoints")
    manager.save(step, states={"actor": {}}, config=saved.model_dump(mode="json"), rng=False)
    manager.close()
    return out


def checkpoints(folder: Path) -> list[str]:
    return [p.name for p in CheckpointManager(folder, lock=False).list()]


# --------------------------------------------------------------------------- 1: what is moved


def test_a_folder_that_is_not_a_run_is_refused_not_moved(tmp_path: Path, started: Runs) -> None:
    out = tmp_path / "mydata"
    out.mkdir()
    (out / "precious.txt").write_text("years of work")
    result = train(f"output_dir={out}")
    assert result.exit_code == 1, result.output
    assert f"output_dir {out} holds files that are not an envhub run" in result.output
    assert "choose another output_dir (or empty it)" in result.output
    assert not started and not list(tmp_path.glob("mydata.old-*"))
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]  # not even a lock file


def test_a_checkpoint_dir_of_other_files_is_refused_before_the_run_is_moved(
    tmp_path: Path, started: Runs
) -> None:
    out, elsewhere = previous_run(tmp_path / "run"), tmp_path / "ck"
    elsewhere.mkdir()
    (elsewhere / "notes.md").write_text("x")
    result = train(f"output_dir={out}", f"checkpoint.dir={elsewhere}")
    assert result.exit_code == 1, result.output
    assert (
        f"checkpoint.dir {elsewhere} holds files that are not envhub checkpoints" in result.output
    )
    assert not started and checkpoints(out / "checkpoints") == ["step_00000004"]
    assert not list(tmp_path.glob("*.old-*"))


@pytest.mark.parametrize("output_dir", ["", "."])
def test_the_current_folder_is_never_moved_aside(
    output_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = previous_run(tmp_path / "here")
    monkeypatch.chdir(here)
    before = sorted(p.name for p in here.iterdir())
    with pytest.raises(TrainerError, match="is the folder this command runs in") as refused:
        trainer.cli._move_previous_run_aside(Path(output_dir), Path(output_dir) / "checkpoints")
    assert "choose another output_dir" in str(refused.value)
    assert sorted(p.name for p in here.iterdir()) == before  # no stray .run.lock either
    assert not list(tmp_path.glob("*.old-*"))


def test_output_dir_dot_on_the_command_line_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: Runs
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.txt").write_text("x")
    result = train("output_dir=.")
    assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.output
    assert "output_dir" in result.output and not started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


# --------------------------------------------------------------------------- 2: a failed start


def test_a_start_refused_while_building_puts_the_previous_run_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer.pipeline

    def refused(cfg: Any, model_path: Path) -> Any:  # after the start wrote its first files
        assert (Path(cfg.output_dir) / "initial_policy" / "config.json").is_file()
        raise ValueError("unknown training strategy 'fsdp'; use one of hf, fsdp2, megatron")

    monkeypatch.setattr(trainer.pipeline, "start_roles", refused)
    out = previous_run(tmp_path / "run")
    result = train(f"output_dir={out}")
    assert result.exit_code == 1, result.output
    assert "error: unknown training strategy 'fsdp'" in result.output
    assert f"put the previous run back in {out}" in result.output
    assert checkpoints(out / "checkpoints") == ["step_00000004"]
    assert (out / "run.json").read_text() == '{"run_id": "previous"}\n'
    assert not (out / "initial_policy").exists()  # what the failed start wrote is gone
    assert not list(tmp_path.glob("run.old-*"))
    resumes = record_runs(monkeypatch)
    resumed = train(f"output_dir={out}", "train.steps=8", "--resume")  # finds the run in place
    assert resumed.exit_code == 0 and [r for _, r in resumes] == [True], resumed.output


def test_a_start_that_saved_a_checkpoint_keeps_the_previous_run_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = previous_run(tmp_path / "run")

    def saves_then_fails(cfg: Any, resume: bool, console: Any) -> list[dict[str, Any]]:
        manager = CheckpointManager(cfg.checkpoint_dir)
        manager.save(0, states={"actor": {}}, rng=False)
        manager.close()
        raise TrainerError("step 1: the loss became nan")

    monkeypatch.setattr(trainer.cli, "_run", saves_then_fails)
    result = train(f"output_dir={out}")
    assert result.exit_code == 1 and "the loss became nan" in result.output, result.output
    (aside,) = tmp_path.glob("run.old-*")
    assert checkpoints(aside / "checkpoints") == ["step_00000004"]
    assert checkpoints(out / "checkpoints") == ["step_00000000"]  # the new run, resumable


def test_resume_without_a_checkpoint_names_the_run_moved_aside(
    tmp_path: Path, started: Runs
) -> None:
    out = tmp_path / "run"
    previous_run(tmp_path / "run.old-20261201-090000", step=2)
    newest = previous_run(tmp_path / "run.old-20261205-170000")
    result = train(f"output_dir={out}", "--resume")
    assert result.exit_code == 1, result.output
    assert f"no checkpoint in {out / 'checkpoints'}" in result.output
    assert (
        f"the previous run was moved to {newest}; pass output_dir={newest} --resume to continue it"
        in result.output
    )
    assert not started and not out.exists()


# --------------------------------------------------------------------------- 3: --resume up front


def test_resume_without_a_checkpoint_is_refused_before_building(
    tmp_path: Path, started: Runs
) -> None:
    out = tmp_path / "nosuchrun"  # a typo of the run's folder
    result = train(f"output_dir={out}", "--resume")
    assert result.exit_code == 1, result.output
    assert f"no checkpoint in {out / 'checkpoints'}; run without --resume" in result.output
    assert "moved to" not in result.output  # no run of that name was moved aside
    assert not started and not out.exists()  # nothing built, no folder made


def test_resume_with_lora_on_a_run_saved_without_it_is_refused_before_building(
    tmp_path: Path, started: Runs
) -> None:
    out = previous_run(tmp_path / "run")
    result = train(f"output_dir={out}", "model.lora.rank=8", "--resume")
    assert result.exit_code == 1, result.output
    assert f"cannot resume from {out / 'checkpoints' / 'step_00000004'}" in result.output
    assert "model.lora: the run was saved with LoRA off, it is on now" in result.output
    assert "resume without model.lora" in result.output and "(None)" not in result.output
    assert not started


def test_resume_of_a_run_goes_on_to_build_it(tmp_path: Path, started: Runs) -> None:
    out = previous_run(tmp_path / "run")
    result = train(f"output_dir={out}", "train.steps=8", "--resume")
    assert result.exit_code == 0, result.output
    assert len(started) == 1 and "train.steps: 120 in step_00000004 -> 8 now" in result.output
    step_4 = out / "checkpoints" / "step_00000004"
    assert f"resume: from {step_4} (step 4): steps 5-8 of train.steps=8" in result.output


def final_policy(out: Path) -> None:
    """The final policy a run writes once its last step is checkpointed (``finish``)."""
    (out / "final_policy").mkdir()
    (out / "final_policy" / "config.json").write_text("{}")


def test_resume_with_fewer_steps_than_the_run_did_is_refused_before_building(
    tmp_path: Path, started: Runs
) -> None:
    """train.steps counts every step of the run: 2 after 4 done cannot be trained, and a run
    that says "done" having trained nothing would hide that (train.steps=2 meant "2 more")."""
    out = previous_run(tmp_path / "run")
    result = train(f"output_dir={out}", "train.steps=2", "--resume")
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        f"error: cannot resume from {out / 'checkpoints' / 'step_00000004'}: train.steps=2 is "
        "below the 4 steps the run already did; raise train.steps above 4 to train further (it "
        "counts every step of the run, not the steps left)"
    )
    assert not started


def test_resume_of_a_finished_run_says_so_and_builds_nothing(tmp_path: Path, started: Runs) -> None:
    out = previous_run(tmp_path / "run")
    final_policy(out)
    result = train(f"output_dir={out}", "train.steps=4", "--resume")
    assert result.exit_code == 0, result.output  # nothing was asked that it has not done
    assert result.output.strip() == (
        f"nothing to resume: the run in {out} already did all its train.steps=4 steps "
        "(step_00000004) and wrote its final policy; raise train.steps above 4 to train further"
    )
    assert not started


def test_resume_of_a_run_killed_before_its_final_policy_goes_on_to_write_it(
    tmp_path: Path, started: Runs
) -> None:
    """Killed between its last checkpoint and its final policy (or with the final policy of an
    earlier end, before train.steps was raised): the resume builds the run to write it."""
    out = previous_run(tmp_path / "run")
    final_policy(out)
    meta = (out / "checkpoints" / "step_00000004" / "meta.json").stat()
    os.utime(out / "final_policy" / "config.json", ns=(meta.st_atime_ns, meta.st_mtime_ns - 10**9))
    result = train(f"output_dir={out}", "train.steps=4", "--resume")
    assert result.exit_code == 0, result.output
    assert [resume for _, resume in started] == [True]
    assert (
        f"resume: the run in {out} already did all its train.steps=4 steps (step_00000004); it "
        "only writes its final policy (it stopped before that)" in result.output
    )


# --------------------------------------------------------------------------- 4: --dry-run


def test_dry_run_exit_code_follows_the_loaded_check_memory(tmp_path: Path) -> None:
    tiny = ["cluster.device_memory_gib=0.0001", f"output_dir={tmp_path / 'run'}", "--dry-run"]
    off = train(*tiny, "cluster.check_memory=False")  # False is false, whatever its spelling
    assert off.exit_code == 0, off.output
    assert "does not fit (cluster.check_memory is off: it would start)" in off.output
    config = yaml.safe_load(QUICKSTART.read_text())
    config["cluster"]["check_memory"] = False
    nocheck = tmp_path / "nocheck.yaml"
    nocheck.write_text(yaml.safe_dump(config))
    on = CliRunner().invoke(main, ["train", str(nocheck), *tiny, "cluster.check_memory=true"])
    assert on.exit_code == 1, on.output  # the override turns the check on: the run is refused
    assert "does not fit:" in on.output


def test_dry_run_with_resume_names_the_checkpoint_it_would_continue(tmp_path: Path) -> None:
    out = previous_run(tmp_path / "run")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    result = train(f"output_dir={out}", "train.steps=8", "--resume", "--dry-run")
    assert result.exit_code == 0, result.output
    step_4 = out / "checkpoints" / "step_00000004"
    assert f"resume: from {step_4} (step 4): steps 5-8 of train.steps=8" in result.output
    assert "train.steps: 120 in step_00000004 -> 8 now" in result.output  # what the run warns
    assert "check_memory" not in result.output  # the dry run's own setting is no drift
    assert "fits: nothing started (--dry-run)" in result.output
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


@pytest.mark.parametrize(
    ("setting", "refusal"),
    [
        ("output_dir={tmp}/nosuchrun", "no checkpoint in {tmp}/nosuchrun/checkpoints"),
        ("model.lora.rank=8", "model.lora: the run was saved with LoRA off, it is on now"),
        ("train.steps=2", "train.steps=2 is below the 4 steps the run already did"),
    ],
)
def test_dry_run_with_resume_refuses_what_resume_refuses(
    setting: str, refusal: str, tmp_path: Path
) -> None:
    out = previous_run(tmp_path / "run")
    args = [f"output_dir={out}", setting.format(tmp=tmp_path), "--resume", "--dry-run"]
    result = train(*args)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: ") and refusal.format(tmp=tmp_path) in result.output
    assert "fits" not in result.output and not (tmp_path / "nosuchrun").exists()


# --------------------------------------------------------------------------- 5: refused late


def test_a_setting_refused_while_building_is_an_error_line_not_a_traceback(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    result = train(f"output_dir={out}", "env.kwargs.hole_fraction='4e-1'")  # a str: the env refuses
    assert isinstance(result.exception, SystemExit) and result.exit_code in (1, 2), result.output
    assert "error: hole_fraction must be in [0, 1), got '4e-1'" in result.output


def test_a_bug_while_building_keeps_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer.pipeline

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug, not a setting")

    monkeypatch.setattr(trainer.pipeline, "AgenticPipeline", broken)
    result = train(f"output_dir={tmp_path / 'run'}")
    assert isinstance(result.exception, ZeroDivisionError), result.output


def test_a_malformed_sft_file_is_an_error_line_naming_the_record(tmp_path: Path) -> None:
    demos = tmp_path / "demos.jsonl"
    demos.write_text('{"seed": "abc", "messages": [{"role": "user", "content": "x"}]}\n')
    result = train(
        f"output_dir={tmp_path / 'run'}", "sft.epochs=1", "sft.source=file", f"sft.path={demos}"
    )
    assert result.exit_code == 1, result.output
    assert f'error: {demos}:1: "seed" must be an integer' in result.output
    assert not isinstance(result.exception, ValueError)  # SystemExit: no traceback


def test_a_ray_cluster_that_cannot_be_joined_is_an_error_line_naming_the_address(
    tmp_path: Path,
) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    result = train(
        f"output_dir={tmp_path / 'run'}", "cluster.backend=ray", "cluster.address=127.0.0.1:1"
    )
    assert result.exit_code == 1, result.output
    assert "error: cluster.address '127.0.0.1:1': cannot join the Ray cluster" in result.output
    assert "ray status" in result.output
    assert isinstance(result.exception, SystemExit)  # no traceback


@pytest.mark.parametrize("damage", ["truncated", "missing_shard"])
def test_a_damaged_checkpoint_is_refused_at_load_naming_the_file(
    policy_dir: Path, tmp_path: Path, started: Runs, damage: str
) -> None:
    """A half-copied or half-downloaded model.path is an error line before any worker starts (a
    worker found it while building the model: a raw traceback, or Ray's with colour codes)."""
    import json
    import shutil

    damaged = tmp_path / "policy"
    shutil.copytree(policy_dir, damaged)
    weights = damaged / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
        expected = "model.safetensors is not a readable safetensors file"
    else:
        weights.rename(damaged / "model-00001-of-00002.safetensors")
        shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (damaged / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
        expected = "lacks (model-00002-of-00002.safetensors)"
    for extra in ([], ["--dry-run"]):
        result = train("model.tiny=null", f"model.path={damaged}", *extra)
        assert result.exit_code != 0 and not started
        assert "model.path" in result.output and expected in result.output, result.output
        assert "copy or download it again" in result.output
        assert "Traceback" not in result.output


# --------------------------------------------------------------------------- 5: which checkpoint


def test_resume_with_another_tiny_model_size_is_refused_naming_the_setting(
    tmp_path: Path, started: Runs
) -> None:
    """The run would go on training the saved 64-wide model (its initial_policy is reused) while
    saying it resumes with hidden_size 32, and its next checkpoint would record 32."""
    out = previous_run(tmp_path / "run")
    result = train(f"output_dir={out}", "train.steps=8", "model.tiny.hidden_size=32", "--resume")
    assert result.exit_code == 1, result.output
    assert "model.tiny.hidden_size: 64 in the checkpoint, 32 now" in result.output
    assert "resume with model.tiny.hidden_size=64" in result.output
    assert "another output_dir" in result.output
    assert not started


def test_resume_with_model_path_at_another_model_is_refused_naming_what_differs(
    policy_dir: Path, tmp_path: Path, started: Runs
) -> None:
    import json
    import shutil

    out = previous_run(tmp_path / "run", 4, "model.tiny=null", f"model.path={policy_dir}")
    other = tmp_path / "other"
    shutil.copytree(policy_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (other / "config.json").write_text(json.dumps(config))
    result = train(
        f"output_dir={out}", "train.steps=8", "model.tiny=null", f"model.path={other}", "--resume"
    )
    assert result.exit_code == 1, result.output
    assert f"model.path: {other} is another model than the one the run was saved with" in (
        result.output
    )
    assert "num_hidden_layers 2 in the saved model, 3 in this one" in result.output
    assert f"resume with model.path={policy_dir}" in result.output
    assert "size mismatch" not in result.output and not started
    moved = tmp_path / "moved"  # the same model in another folder resumes
    shutil.copytree(policy_dir, moved)
    result = train(
        f"output_dir={out}", "train.steps=8", "model.tiny=null", f"model.path={moved}", "--resume"
    )
    assert result.exit_code == 0, result.output
    assert len(started) == 1


def test_resume_names_the_checkpoint_the_run_loads_when_latest_is_stale(
    tmp_path: Path, started: Runs
) -> None:
    """A kill between committing step_5 and rewriting ``latest``: the run loads step_5."""
    out = previous_run(tmp_path / "run")
    manager = CheckpointManager(out / "checkpoints")
    manager.save(5, states={"actor": {}}, config=manager.load().config, rng=False)
    manager.close()
    (out / "checkpoints" / "latest").write_text("step_00000004\n")
    result = train(f"output_dir={out}", "train.steps=8", "--resume")
    assert result.exit_code == 0, result.output
    step_5 = out / "checkpoints" / "step_00000005"
    assert f"resume: from {step_5} (step 5): steps 6-8 of train.steps=8" in result.output


@pytest.mark.parametrize(
    ("stop", "said", "code"),
    [(trainer.cli.Terminated, "SIGTERM", 143), (KeyboardInterrupt, "Ctrl-C (SIGINT)", 130)],
)
def test_a_stopped_run_names_the_checkpoint_to_continue_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: type, said: str, code: int
) -> None:
    out = previous_run(tmp_path / "run")
    manager = CheckpointManager(out / "checkpoints")
    manager.save(5, states={"actor": {}}, config=manager.load().config, rng=False)
    manager.close()
    (out / "checkpoints" / "latest").write_text("step_00000004\n")  # stale, as after a kill

    def stopped(cfg: Any, resume: bool, console: Any) -> list[dict[str, Any]]:
        raise stop()

    monkeypatch.setattr(trainer.cli, "_run", stopped)
    result = train(f"output_dir={out}", "train.steps=8", "--resume")
    assert result.exit_code == code, result.output
    step_5 = out / "checkpoints" / "step_00000005"
    assert f"stopped by {said}: workers shut down; continue from {step_5} with --resume" in (
        result.output
    )
    assert "Aborted!" not in result.output


@pytest.mark.parametrize("listed", [True, False])
def test_resume_of_a_checkpoint_without_its_config_is_refused(
    tmp_path: Path, started: Runs, listed: bool
) -> None:
    """Without config.json the conflict checks cannot run: LoRA on a run saved without it would
    end in a raw torch state-dict dump."""
    import json

    out = previous_run(tmp_path / "run")
    step_4 = out / "checkpoints" / "step_00000004"
    (step_4 / "config.json").unlink()
    if not listed:  # a checkpoint written before meta.json listed its files
        meta = json.loads((step_4 / "meta.json").read_text())
        meta.pop("files", None)
        (step_4 / "meta.json").write_text(json.dumps(meta))
    result = train(f"output_dir={out}", "train.steps=8", "model.lora.rank=8", "--resume")
    assert result.exit_code == 1, result.output
    assert "config.json" in result.output and not started
