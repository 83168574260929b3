"""The numbers a run reports say what happened: every PPO epoch and optimiser step, every env of
a mix on every step, a "no learning signal" warning only when nothing was learnt (and when a
step trained nothing), the returns drawn where they are, the real SFT step count, the eval
value's step, and a NaN that reaches TensorBoard as NaN.

Unit-level: the metric functions, one tiny actor worker, the CLI's progress lines with a
stand-in pipeline.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from trainer.config import RoleConfig
from trainer.controller.batch import Batch
from trainer.controller.worker import WorkerContext
from trainer.metrics import MetricsLog, SignalWatch, learning_signal, plot_curves, summarise
from trainer.rollout.trajectory import Trajectory
from trainer.workers.actor import ActorWorker

LAKE, GUESS = "games/frozen-lake-v0", "games/guess-number-v0"


def episode(env_id: str = LAKE, group: int = 0, reward: float = 1.0, **flags: Any) -> Trajectory:
    """A one-turn episode of ``env_id`` in ``group`` with return ``reward``."""
    trajectory = Trajectory(env_id, 0, group, **flags)
    trajectory.append_context([1, 2, 3])
    trajectory.append_policy([4, 5], [0.0, 0.0])
    trajectory.end_turn(reward)
    trajectory.success = reward > 0
    return trajectory


def steps_of(rows: list[dict[str, Any]], watch: SignalWatch) -> list[str | None]:
    return [watch.observe(row) for row in rows]


# ----------------------------------------------------------------------------- 4: env mixes


def test_every_env_of_a_mix_has_its_keys_on_a_step_that_played_one_env() -> None:
    batch = [episode(LAKE, g, reward=float(g % 2)) for g in range(4)]  # frozen lake only
    metrics = summarise(batch, "train", env_ids=[LAKE, GUESS])
    assert metrics[f"train/{LAKE}/success"] == 0.5
    assert metrics[f"train/{LAKE}/reward"] == 0.5
    assert metrics[f"train/{LAKE}/episodes"] == 4.0
    assert metrics[f"train/{GUESS}/episodes"] == 0.0  # there, but no rate of no episodes
    assert f"train/{GUESS}/success" not in metrics
    assert f"train/{GUESS}/reward" not in metrics


def test_a_single_env_run_has_only_the_pooled_keys() -> None:
    metrics = summarise([episode(LAKE, 0), episode(LAKE, 1)], "train", env_ids=[LAKE])
    assert not [key for key in metrics if key.count("/") > 1], metrics


# ----------------------------------------------------------------------------- 5, 8: the warning


def test_no_warning_for_reinforce_pp_with_singleton_groups_that_train() -> None:
    """Reinforce++ has no group baseline: a group of one episode is no "zero variance" group,
    and a step whose gradient moved the policy is no silent step."""
    watch = SignalWatch(Path("run"), max_new_tokens=8)
    rows = []
    for step in range(1, 6):
        batch = [episode(group=g, reward=r) for g, r in enumerate([0.0, 1.0, 0.5, 0.0])]
        signal = learning_signal(batch, 8, estimator="reinforce_pp")
        assert "train/zero_variance_groups" not in signal
        actor = {"actor/grad_norm": 0.76, "actor/optimizer_steps": 2.0}
        rows.append({"step": step, **summarise(batch, "train"), **signal, **actor})
    assert steps_of(rows, watch) == [None] * 5


def test_gae_reports_no_zero_variance_groups_but_a_zero_gradient_still_warns() -> None:
    watch = SignalWatch(Path("run"), max_new_tokens=8)
    batch = [episode(group=g, reward=0.0) for g in range(4)]
    signal = learning_signal(batch, 8, estimator="gae")
    assert "train/zero_variance_groups" not in signal
    row = {**summarise(batch, "train"), **signal, "actor/grad_norm": 0.0}
    warnings = steps_of([{"step": s, **row} for s in (1, 2, 3)], watch)
    assert warnings[:2] == [None, None]
    assert warnings[2] is not None and "gradient was exactly 0" in warnings[2]


def test_group_estimators_still_count_groups_whose_episodes_tied() -> None:
    batch = [episode(group=g // 2, reward=float(g == 0)) for g in range(4)]  # 2 groups of 2
    assert learning_signal(batch, 8, estimator="grpo")["train/zero_variance_groups"] == 0.5
    assert learning_signal(batch, 8)["train/zero_variance_groups"] == 0.5  # grpo, the default


def test_steps_that_take_no_optimiser_step_are_silent_and_say_why() -> None:
    """``algorithm.mask_truncated`` with every episode truncated: nothing is trained, although
    the groups' returns differ."""
    watch = SignalWatch(Path("run"), max_new_tokens=8)
    rows = []
    for step in (1, 2, 3):
        batch = [episode(group=g // 2, reward=float(g % 2), truncated=True) for g in range(4)]
        signal = learning_signal(batch, 8)
        assert signal["train/zero_variance_groups"] == 0.0
        rows.append({"step": step, **summarise(batch, "train"), **signal})
        rows[-1]["actor/optimizer_steps"] = 0.0  # what the pipeline logs for a masked batch
    warnings = steps_of(rows, watch)
    assert warnings[:2] == [None, None]
    assert warnings[2] is not None
    assert "no learning signal for 3 steps" in warnings[2]
    assert "truncated" in warnings[2] and "algorithm.mask_truncated" in warnings[2]
    assert "same reward" not in warnings[2]


# ----------------------------------------------------------------------------- 6: the PNG


def test_reward_curve_draws_returns_outside_zero_one_on_their_own_axis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    original = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    rows = [
        {"step": s, "time_s": 60.0 * s, "train/success": 0.1 * s, "train/reward": -0.6 - s}
        for s in range(1, 4)
    ] + [{"step": 3, "time_s": 200.0, "eval/success": 1.0}]
    plot_curves(rows, tmp_path / "reward_curve.png")
    [figure] = saved
    lines = {line.get_label(): line for ax in figure.axes for line in ax.get_lines()}
    assert {"train/success", "train/reward", "eval/success"} <= set(lines)
    for label, line in lines.items():
        low, high = line.axes.get_ylim()
        assert all(low <= y <= high for y in line.get_ydata()), (label, (low, high))
    rates = lines["train/success"].axes
    assert lines["eval/success"].axes is rates
    assert rates.get_ylim()[0] <= 0.0 and 1.0 <= rates.get_ylim()[1] <= 1.1


# ----------------------------------------------------------------------------- 3, 7: the actor


@pytest.fixture
def make_actor(policy_dir: Path):
    def make(**optim: Any) -> ActorWorker:
        ctx = WorkerContext(role="actor_train", rank=0, world_size=1, backend="local")
        return ActorWorker(
            ctx,
            RoleConfig(strategy="hf", device_mapping=[0]),
            model_path=str(policy_dir),
            optim={"lr": 1e-2, **optim},
        )

    return make


def counted_steps(worker: ActorWorker) -> list[int]:
    """A one-item list that counts the optimiser's real steps from now on."""
    taken = [0]
    worker.strategy.optimizer.register_step_post_hook(  # type: ignore[attr-defined]
        lambda *_: taken.__setitem__(0, taken[0] + 1)
    )
    return taken


def rl_batch(rows: int = 8, width: int = 10) -> Batch:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 40, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    response = mask.clone().float()
    response[:, :3] = 0
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "response_mask": response,
            "old_logprobs": torch.full((rows, width), -3.5) * response,
            "advantages": torch.randn(rows, width, generator=g) * response,
        }
    )


def test_actor_metrics_cover_every_ppo_epoch(make_actor) -> None:
    worker = make_actor(micro_batch_size=2, grad_accumulation=2)  # 8 rows: 2 steps per epoch
    taken = counted_steps(worker)
    per_epoch: list[dict[str, float]] = []
    train_step = worker.strategy.train_step

    def recorded(*args: Any, **kwargs: Any) -> dict[str, float]:
        per_epoch.append(train_step(*args, **kwargs))
        return per_epoch[-1]

    worker.strategy.train_step = recorded  # type: ignore[method-assign]
    metrics = worker.train_step(rl_batch(), epochs=3)
    assert taken[0] == 6
    assert metrics["actor/optimizer_steps"] == 6.0
    assert len(per_epoch) == 3
    for key in ("pg_loss", "clipfrac", "approx_kl_old", "entropy", "grad_norm"):
        want = sum(e.get(f"actor/{key}", e.get(key, 0.0)) for e in per_epoch) / 3
        assert metrics[f"actor/{key}"] == pytest.approx(want), key
    assert per_epoch[0]["actor/approx_kl_old"] != per_epoch[-1]["actor/approx_kl_old"]


def test_sft_steps_count_the_optimiser_steps_of_grad_accumulation(make_actor) -> None:
    """``sft.batch_size=16`` with ``train.micro_batch_size=4 train.grad_accumulation=2``: each
    batch takes 2 optimiser steps, and ``sft/steps`` says so (the warm start's callback hands
    ``clone`` the worker's metrics, as ``AgenticPipeline.warm_start`` does)."""
    from trainer.sft import clone

    worker = make_actor(micro_batch_size=4, grad_accumulation=2)
    taken = counted_steps(worker)
    batch = rl_batch(rows=32)
    columns = ("input_ids", "attention_mask", "response_mask")

    def train(chunk: list[int], step: int, total: int) -> dict[str, float]:
        return worker.sft_step(Batch({k: batch[k][chunk] for k in columns}))

    seen: list[tuple[int, int, float]] = []

    def report(done: int, total: int, nll: float) -> None:
        seen.append((done, total, nll))

    stats = clone(list(range(32)), train, epochs=1, batch_size=16, seed=0, on_step=report)
    assert taken[0] == 4
    assert stats["sft/steps"] == 4.0
    assert [(done, total) for done, total, _ in seen] == [(1, 2), (2, 2)]  # batches, for the bar
    assert math.isfinite(stats["sft/nll"])


def test_sft_callbacks_returning_the_nll_alone_count_one_step_a_batch() -> None:
    from trainer.sft import clone

    stats = clone(list(range(10)), lambda chunk, step, total: 2.0, epochs=2, batch_size=4, seed=0)
    assert stats == {"sft/nll": 2.0, "sft/nll_first_epoch": 2.0, "sft/steps": 6.0}


# ----------------------------------------------------------------------------- 11: presentation


def test_progress_lines_name_the_step_of_the_eval_they_show(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rich.console import Console

    import trainer.pipeline
    from trainer import cli

    class Pipeline:
        step = 0

        def __init__(self, cfg: Any, *, resume: bool, on_step: Any, on_sft_step: Any) -> None:
            self.on_step = on_step

        def describe_eval(self) -> str:
            return "4 episodes"

        def fit(self) -> list[dict[str, Any]]:
            for step in range(4):
                row = {"step": step, "train/success": 0.5}
                if step in (0, 2):
                    row["eval/success"] = 0.25 * (step + 1)
                self.on_step(row)
            return []

    monkeypatch.setattr(trainer.pipeline, "AgenticPipeline", Pipeline)
    cfg = SimpleNamespace(
        logging=SimpleNamespace(progress=False),
        train=SimpleNamespace(steps=3),
        sft=SimpleNamespace(epochs=0),
    )
    out = io.StringIO()
    cli._run(cfg, False, Console(file=out, width=200))
    lines = {int(line.split(":")[0][5:]): line for line in out.getvalue().splitlines()[1:]}
    assert "eval success 0.25 (step 0)" in lines[0]
    assert "eval success 0.25 (step 0)" in lines[1]
    assert "eval success 0.75 (step 2)" in lines[2]
    assert "eval success 0.75 (step 2)" in lines[3]


def test_a_nan_reaches_tensorboard_as_nan(tmp_path: Path) -> None:
    from tests.trainer.test_metric_sinks import read_scalars

    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 1, "actor/pg_loss": float("nan"), "train/success": 0.5})
    log.write({"step": 2, "actor/pg_loss": 0.25, "train/success": float("inf")})
    log.close()
    assert '"actor/pg_loss": null' in (tmp_path / "metrics.jsonl").read_text()
    scalars = read_scalars(tmp_path / "tensorboard")
    [(step, value), later] = scalars["actor/pg_loss"]
    assert step == 1 and math.isnan(value)
    assert later == (2, 0.25)
    assert [s for s, _ in scalars["train/success"]] == [1, 2]
    assert math.isinf(scalars["train/success"][1][1])
