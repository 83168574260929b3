"""Checkpoints and --resume under misuse: two runs on one folder, another run's checkpoints, a
changed config on resume, a kill between the renames of a re-save, a strategy switch, hostile or
damaged files, a cut-off metrics line. Each test asserts what the user sees."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from trainer.checkpoint import CheckpointManager
from trainer.errors import CheckpointError

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
QUICK = [  # a run that builds its tiny policy and workers, and trains nothing
    "sft.epochs=0",
    "train.steps=0",
    "eval.episodes=2",
    "eval.every=0",
    "env.num_groups=1",
    "env.group_size=2",
    "logging.progress=false",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
]


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".lock"))


# --------------------------------------------------------------------------- 1: one writer


def test_a_second_manager_on_a_live_folder_is_refused_and_the_first_commits_intact(
    tmp_path: Path,
) -> None:
    first = CheckpointManager(tmp_path, keep=2)
    first.save(10, states={"actor": torch.ones(3), "engine": {"v": 1}})
    first.save(20, states={"actor": torch.ones(3) * 2, "engine": {"v": 2}})
    with first.writing(30) as writer:
        writer.save_state("actor", torch.ones(3) * 3)
        # a second run (`envhub train --resume` while this one lives) opens the same folder
        with pytest.raises(
            CheckpointError, match=rf"in use by another training run \(pid {os.getpid()} "
        ):
            CheckpointManager(tmp_path, keep=2)
        writer.save_state("engine", {"v": 3})
    assert [p.name for p in first.list()] == ["step_00000020", "step_00000030"]
    assert torch.equal(first.load().load_state("actor"), torch.ones(3) * 3)
    first.close()
    assert CheckpointManager(tmp_path).load().step == 30  # released: the next run may open it


def test_a_checkpoint_whose_state_file_vanished_is_never_marked_complete(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, states={"actor": torch.zeros(2)})
    lost = pytest.raises(CheckpointError, match=r"lost states \['actor'\] before its commit")
    with lost, manager.writing(2) as writer:
        writer.save_state("actor", torch.ones(2))
        (writer.path / "states" / "actor.pt").unlink()  # what a cleaner elsewhere did
    assert manager.load().step == 1 and names(tmp_path) == ["latest", "step_00000001"]


def quick_config(tmp_path: Path, *extra: str) -> Any:
    from trainer.config import load_config

    return load_config(QUICKSTART, [*QUICK, f"output_dir={tmp_path / 'run'}", *extra])


def test_a_second_training_run_on_a_live_output_dir_is_refused_naming_its_pid(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from envhub.cli import main
    from trainer.pipeline import AgenticPipeline

    out = tmp_path / "run"
    live = AgenticPipeline(quick_config(tmp_path))  # run A: started, still running
    try:
        before = names(out)
        for flags in ([], ["--resume"]):
            args = ["train", str(QUICKSTART), *QUICK, f"output_dir={out}", *flags]
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 1, (flags, result.output)
            assert f"is in use by another training run (pid {os.getpid()} " in result.output
            assert "output_dir" in result.output  # the fix: give this run its own output_dir
            # run A's folder was neither moved aside nor touched
            assert names(out) == before and not list(tmp_path.glob("run.old-*"))
    finally:
        live.close()


# --------------------------------------------------------------------------- 2: one run


def test_a_checkpoint_of_another_run_is_refused_and_latest_follows_the_pointer(
    tmp_path: Path,
) -> None:
    old = CheckpointManager(tmp_path, run_id="run-a")
    old.save(4, states={"actor": torch.ones(1)})
    old.close()
    mine = CheckpointManager(tmp_path, run_id="run-b")
    with pytest.raises(CheckpointError, match="belongs to run run-a, not to this run .run-b."):
        mine.load()
    mine.close()
    both = CheckpointManager(tmp_path, keep=3)
    both.save(2, states={"actor": torch.zeros(1)}, rng=False)
    (tmp_path / "latest").write_text("step_00000002\n")  # the pointer names a complete one
    assert both.latest() == tmp_path / "step_00000002" and both.load().step == 2


def test_a_fresh_start_refuses_a_checkpoint_dir_that_holds_checkpoints(tmp_path: Path) -> None:
    from trainer.pipeline import AgenticPipeline

    elsewhere = tmp_path / "ck"
    CheckpointManager(elsewhere).save(4, states={"actor": {}}, rng=False)
    with pytest.raises(CheckpointError, match=f"checkpoint.dir {elsewhere} already holds"):
        AgenticPipeline(quick_config(tmp_path, f"checkpoint.dir={elsewhere}"))
    assert [p.name for p in CheckpointManager(elsewhere, lock=False).list()] == ["step_00000004"]


def test_a_fresh_cli_start_moves_an_outside_checkpoint_dir_aside_with_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    import trainer.cli
    from envhub.cli import main

    out, elsewhere = tmp_path / "run", tmp_path / "ck"
    CheckpointManager(elsewhere).save(4, states={"actor": {}}, rng=False)
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 4}\n')
    started: list[Any] = []
    monkeypatch.setattr(
        trainer.cli, "_run", lambda cfg, resume, console: started.append(cfg) or [{"time_s": 1.0}]
    )
    args = ["train", str(QUICKSTART), *QUICK, f"output_dir={out}", f"checkpoint.dir={elsewhere}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert started and not elsewhere.exists() and not out.exists()
    (aside,) = tmp_path.glob("ck.old-*")
    assert f"moved its checkpoints in {elsewhere} to {aside}" in result.output
    assert [p.name for p in CheckpointManager(aside, lock=False).list()] == ["step_00000004"]


# --------------------------------------------------------------------------- 3: config settings


def test_a_resumed_optimizer_takes_lr_and_weight_decay_from_the_config() -> None:
    from tests.trainer.strategies.dist_workers import nll_loss, tiny_batch, tiny_qwen2
    from trainer.strategies.hf import HFTrainStrategy

    saved_run = HFTrainStrategy(tiny_qwen2(), lr=1e-3, weight_decay=0.0, device="cpu")
    saved_run.train_step(tiny_batch(), nll_loss)
    state = saved_run.state_dict()
    resumed = HFTrainStrategy(tiny_qwen2(), lr=0.05, weight_decay=0.1, device="cpu")
    resumed.load_state_dict(state)
    assert {(g["lr"], g["weight_decay"]) for g in resumed.optimizer.param_groups} == {(0.05, 0.1)}
    moments = resumed.optimizer.state_dict()["state"]
    assert moments and all(int(s["step"]) == 1 for s in moments.values())  # state did come back


@pytest.mark.parametrize(
    ("lr_key", "extra"),
    [("train.lr", []), ("model.lora.lr", ["model.lora.rank=4"])],
    ids=["full", "lora"],
)
def test_resume_trains_with_the_lr_and_weight_decay_given_now(
    tmp_path: Path, lr_key: str, extra: list[str]
) -> None:
    from trainer.pipeline import AgenticPipeline

    AgenticPipeline(quick_config(tmp_path, *extra, f"{lr_key}=0.001")).fit()
    now = quick_config(tmp_path, *extra, f"{lr_key}=0.05", "train.weight_decay=0.1")
    resumed = AgenticPipeline(now, resume=True)
    try:
        resumed.restore()
        optimizer = resumed.roles.actor._workers[0].strategy.optimizer
        assert {(g["lr"], g["weight_decay"]) for g in optimizer.param_groups} == {(0.05, 0.1)}
    finally:
        resumed.close()


def sharded_resume_rank(rank: int, world: int, port: int, out: Any) -> None:
    """One rank: fsdp2 and megatron each resumed under other settings, and each given an ``hf``
    state (another strategy's)."""
    from tests.trainer.strategies.dist_workers import join, nll_loss, tiny_batch, tiny_qwen2

    join(rank, world, port)
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.fsdp2 import FSDP2TrainStrategy
    from trainer.strategies.hf import HFTrainStrategy
    from trainer.strategies.megatron import MegatronTrainStrategy

    hf_state = HFTrainStrategy(tiny_qwen2(), device="cpu")
    hf_state.train_step(tiny_batch(), nll_loss)
    foreign = hf_state.state_dict()
    for cls in (FSDP2TrainStrategy, MegatronTrainStrategy):
        saved_run = cls(tiny_qwen2(), lr=1e-3, weight_decay=0.0, device="cpu")
        saved_run.train_step(tiny_batch(), nll_loss)
        state = saved_run.state_dict()
        resumed = cls(tiny_qwen2(), lr=0.05, weight_decay=0.1, device="cpu")
        resumed.load_state_dict(state)
        groups = resumed.optimizer.param_groups
        out[cls.name] = {(g["lr"], g["weight_decay"]) for g in groups}
        try:
            resumed.load_state_dict(foreign)
            out[cls.name, "hf"] = "loaded"
        except CheckpointError as error:
            out[cls.name, "hf"] = str(error)
    shutdown_process_group()


@pytest.mark.timeout(300)
def test_sharded_strategies_resume_with_the_config_and_refuse_another_strategys_state() -> None:
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    from tests.trainer.strategies.test_fsdp2 import run_ranks

    out = run_ranks(sharded_resume_rank, 1)
    assert out["fsdp2"] == out["megatron"] == {(0.05, 0.1)}
    for name in ("fsdp2", "megatron"):
        assert "saved by the 'hf' strategy" in out[name, "hf"]
        assert ".strategy=hf" in out[name, "hf"]


# --------------------------------------------------------------------------- 4: kill mid-commit


def test_a_kill_between_the_renames_of_a_resave_restores_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(5, states={"w": torch.ones(1)})
    real_rename = os.rename

    class Killed(BaseException):
        pass

    def rename_then_die(src: Any, dst: Any) -> None:
        real_rename(src, dst)
        if ".trash-" in str(dst):  # the old step_5 is aside, the new one not yet in place
            raise Killed

    monkeypatch.setattr(os, "rename", rename_then_die)
    with pytest.raises(Killed):
        manager.save(5, states={"w": torch.ones(1) * 2})
    monkeypatch.setattr(os, "rename", real_rename)
    manager.close()
    assert "step_00000005" not in names(tmp_path)  # what the kill left

    after = CheckpointManager(tmp_path, keep=1)
    assert [p.name for p in after.list()] == ["step_00000005"]
    assert float(after.load().load_state("w")) == 2.0  # the newer, complete save
    assert names(tmp_path) == ["latest", "step_00000005"]


def test_a_kill_after_moving_the_old_copy_aside_with_no_new_one_restores_the_old(
    tmp_path: Path,
) -> None:
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(5, states={"w": torch.ones(1)})
    manager.close()
    os.rename(tmp_path / "step_00000005", tmp_path / ".trash-step_00000005-deadbeef")
    assert float(CheckpointManager(tmp_path).load().load_state("w")) == 1.0


def test_a_kill_while_meta_json_was_written_is_not_put_back(tmp_path: Path) -> None:
    """A folder whose meta.json a kill cut short is not a checkpoint (CI's kill -9 loop once
    had a re-save's .tmp- folder restored with an empty meta.json, and resume then refused it)."""
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(5, states={"w": torch.ones(1)})
    manager.close()
    cut = tmp_path / ".tmp-step_00000006-123-deadbeef"
    (cut / "states").mkdir(parents=True)
    torch.save(torch.ones(1) * 2, cut / "states" / "w.pt")
    (cut / "meta.json").write_text("")  # created, nothing written yet
    after = CheckpointManager(tmp_path, keep=2)
    assert [p.name for p in after.list()] == ["step_00000005"]
    assert float(after.load().load_state("w")) == 1.0
    assert names(tmp_path) == ["latest", "step_00000005"]


# --------------------------------------------------------------------------- 5: strategy switch


def test_a_state_saved_by_another_strategy_is_refused_naming_the_setting() -> None:
    from tests.trainer.strategies.dist_workers import tiny_qwen2
    from trainer.strategies.hf import HFTrainStrategy

    strategy = HFTrainStrategy(tiny_qwen2(), device="cpu")
    state = strategy.state_dict()
    assert state["strategy"] == "hf"
    megatron_state = {"model": state["model"], "optimizer_ranks": [{"state": {}}]}  # (unstamped)
    with pytest.raises(
        CheckpointError, match=r"saved by the 'megatron' strategy.*\.strategy=megatron"
    ):
        strategy.load_state_dict(megatron_state)


def test_a_megatron_state_passes_the_workers_check_and_only_its_layout_check_refuses() -> None:
    """The actor worker checks the strategy's name (it knows no layout); megatron then checks its
    layout. Checking the layout against none refused every megatron resume ("ranks 2 (now
    None)")."""
    from trainer.resume import check_saved_strategy, strategy_stamp

    layout = {"ranks": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 1}
    state = {"model": {}, **strategy_stamp("megatron", layout)}
    check_saved_strategy(state, "megatron", role="actor_train")
    check_saved_strategy(state, "megatron", layout)
    with pytest.raises(CheckpointError, match=r"tensor_parallel_size 2 \(now 1\)"):
        check_saved_strategy(state, "megatron", {**layout, "tensor_parallel_size": 1})


# --------------------------------------------------------------------------- 6: no code on load


class RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("where", ["extra.pt", "rng.pt", "states/actor.pt"])
def test_a_checkpoint_file_that_would_run_code_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    monkeypatch.chdir(tmp_path)
    manager = CheckpointManager(tmp_path / "ck")
    manager.save(7, states={"actor": {"model": {}}})
    target = tmp_path / "ck" / "step_00000007" / where
    with open(target, "wb") as f:
        pickle.dump(RunsCode(), f)
    ckpt = manager.load()
    with pytest.raises(
        CheckpointError, match=f"{target} holds .*, not only tensors and plain data; refused"
    ):
        {"extra.pt": lambda: ckpt.extra, "rng.pt": lambda: ckpt.rng}.get(
            where, lambda: ckpt.load_state("actor")
        )()
    assert not (tmp_path / "pwned").exists()
    manager.save(8, states={"actor": {"model": {"w": torch.ones(2)}}})  # numpy RNG state too
    assert manager.load().rng["numpy"][0] == "MT19937"


# --------------------------------------------------------------------------- 7: damaged files


def test_a_damaged_checkpoint_names_the_file_and_the_older_one_to_use(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, states={"actor": {"w": torch.ones(64)}})
    manager.save(2, states={"actor": {"w": torch.ones(64)}})
    state = tmp_path / "step_00000002" / "states" / "actor.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with pytest.raises(CheckpointError) as error:
        manager.load().load_state("actor")
    assert f"{state} cannot be read" in str(error.value)
    assert "older complete checkpoint step_00000001" in str(error.value)
    assert f"mv {tmp_path / 'step_00000002'} " in str(error.value)

    meta = tmp_path / "step_00000002" / "meta.json"
    meta.write_text(
        json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "step"})
    )
    with pytest.raises(CheckpointError, match=rf"{meta} lacks step \(int\).*step_00000001"):
        manager.load()


# --------------------------------------------------------------------------- 8: metrics


def test_a_cut_off_metrics_line_does_not_block_resume(tmp_path: Path) -> None:
    from trainer.metrics import MetricsLog

    log = MetricsLog(tmp_path)
    for step in range(4):
        log.write({"step": step, "train/reward": 0.1 * step})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "train/rew')  # a kill (or a full disk) mid-append
    assert [row["step"] for row in log.truncate_after(2)] == [0, 1, 2]
    assert [row["step"] for row in log.read()] == [0, 1, 2]
    assert names(tmp_path) == ["metrics.jsonl"]


def test_a_checkpoint_comes_after_the_episodes_of_its_steps_are_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store writes off the run's thread; a kill right after checkpoint N must not lose
    step N's episodes (a resume plays only the steps after N, and nothing writes them again)."""
    import time

    import envhub.runs.store
    from trainer.pipeline import AgenticPipeline

    write_part = envhub.runs.store.write_part

    def slow_disk(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)  # (a disk slower than the run: the writer lags behind it)
        return write_part(*args, **kwargs)

    monkeypatch.setattr(envhub.runs.store, "write_part", slow_disk)
    run = AgenticPipeline(quick_config(tmp_path, "train.steps=1", "checkpoint.every=1"))
    stored_at_save: dict[int, list[str]] = {}
    save = run.checkpoints.save

    def saved_with(step: int, **kwargs: Any) -> Path:
        stored_at_save[step] = sorted(p.name for p in run.store.folder.glob("*.parquet"))
        return save(step, **kwargs)

    run.checkpoints.save = saved_with  # type: ignore[method-assign]
    run.fit()
    parts = [envhub.runs.store.PART.match(name) for name in stored_at_save[1]]
    assert ("train", 1) in {(part["kind"], int(part["step"])) for part in parts if part}


# --------------------------------------------------------------------------- 9: shapes


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ("model.lora.rank=4", "model.lora.rank: 8 in the checkpoint, 4 now"),
        ("model.lora=null", "model.lora: the run was saved with LoRA on, it is off now"),
        (
            "roles.actor_infer.device_mapping=[0,1]",
            (
                "roles.actor_infer.device_mapping: the run was saved with 1 inference rank(s) "
                "([0]), this one has 2"
            ),
        ),
    ],
)
def test_resume_refuses_a_setting_that_changes_a_saved_states_shape(
    tmp_path: Path, change: str, refusal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before any worker is built where the config alone tells (the Python API as
    ``envhub train --resume``); the number of inference ranks once the engines run."""
    import trainer.pipeline
    from trainer.pipeline import AgenticPipeline

    AgenticPipeline(quick_config(tmp_path, "model.lora.rank=8")).fit()
    engines = change.startswith("roles.actor_infer")
    if not engines:
        monkeypatch.setattr(trainer.pipeline, "start_roles", _never_built)
    with pytest.raises(CheckpointError) as error:
        resumed = AgenticPipeline(quick_config(tmp_path, "model.lora.rank=8", change), resume=True)
        try:
            resumed.restore()
        finally:
            resumed.close()
    assert str(error.value).startswith("cannot resume from ")
    assert f"  - {refusal}" in str(error.value)


def test_resuming_a_run_with_fewer_train_steps_than_it_did_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AgenticPipeline(cfg, resume=True).fit()`` with ``train.steps`` below the steps the run
    already did trained nothing and returned as if it were done (``envhub train`` refuses it
    before building; the Python API must refuse it too, naming the fix, before building)."""
    import trainer.pipeline
    from trainer.errors import CheckpointError
    from trainer.pipeline import AgenticPipeline

    run = AgenticPipeline(quick_config(tmp_path))
    try:
        run.step = 3  # as if it had trained three steps
        run.save_checkpoint()
    finally:
        run.close()
    monkeypatch.setattr(trainer.pipeline, "start_roles", _never_built)
    with pytest.raises(CheckpointError, match="train.steps=2 is below the 3 steps"):
        AgenticPipeline(quick_config(tmp_path, "train.steps=2"), resume=True).fit()


def _never_built(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a resume the checkpoint refuses built the run's workers first")


def test_after_a_resume_the_engines_report_the_version_they_serve(tmp_path: Path) -> None:
    from trainer.pipeline import AgenticPipeline

    AgenticPipeline(quick_config(tmp_path)).fit()
    resumed = AgenticPipeline(quick_config(tmp_path), resume=True)
    try:
        resumed.restore()  # loads the saved version v, then the re-sync serves v + 1
        policy = resumed.weight_sync.policy.value
        states = resumed.roles.infer.get_state()
        assert [(s["version"], s["weights_version"]) for s in states] == [(policy, policy)] * len(
            states
        )
    finally:
        resumed.close()
