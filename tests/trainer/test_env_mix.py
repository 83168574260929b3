"""Multi-env mixes: ``env:`` as a list of ``{id, kwargs, weight}``, groups partitioned by weight,
per-env kwargs reaching the envs, per-env metrics beside the pooled ones."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.test_cli import QUICKSTART, TINY
from trainer.config import TrainerConfig, load_config
from trainer.errors import ConfigError
from trainer.pipeline import AgenticPipeline
from trainer.rollout.env_manager import LocalEnvSource
from trainer.rollout.groups import env_for_group, plan_groups

LAKE, GUESS = "games/frozen-lake-v0", "games/guess-number-v0"
TOOL = "tools/lookup-v0"


def test_a_list_under_env_is_a_mix_with_its_own_kwargs_and_weights() -> None:
    cfg = TrainerConfig.model_validate(
        {
            "env": {
                "id": [{"id": LAKE, "kwargs": {"size": 2}, "weight": 3}, GUESS],
                "kwargs": {"max_turns": 4},
            }
        }
    )
    assert cfg.env.ids == [LAKE, GUESS] and cfg.env.weights == [3.0, 1.0]
    assert cfg.env.kwargs_for(LAKE) == {"size": 2, "max_turns": 4}  # its own over the shared
    assert cfg.env.kwargs_for(GUESS) == {"max_turns": 4}
    # in a YAML file the list may stand for the whole env section
    shorthand = TrainerConfig.model_validate({"env": [{"id": LAKE, "weight": 2}, GUESS]})
    assert shorthand.env.ids == [LAKE, GUESS] and shorthand.env.weights == [2.0, 1.0]


def test_mix_mistakes_are_config_errors_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(QUICKSTART, [f"env.id=[{LAKE}, {LAKE}]"])
    with pytest.raises(ConfigError, match=r"env.id\[1\].*frozen-lake-v0"):
        load_config(QUICKSTART, [f"env.id=[{LAKE}, games/frozen-lak-v0]"])
    with pytest.raises(ConfigError, match="weight"):
        load_config(QUICKSTART, [f"env.id=[{{id: {LAKE}, weight: 0}}]"])


def test_groups_follow_the_weights_and_equal_weights_alternate() -> None:
    ids = [LAKE, GUESS]
    shares = Counter(env_for_group(n, ids, [3.0, 1.0]) for n in range(400))
    assert shares[LAKE] == pytest.approx(300, abs=4) and shares[GUESS] == pytest.approx(100, abs=4)
    # every window of 16 consecutive groups (one step of the quickstart) is close to 3:1
    for start in range(0, 400, 16):
        window = Counter(env_for_group(n, ids, [3.0, 1.0]) for n in range(start, start + 16))
        assert 10 <= window[LAKE] <= 14
    assert [env_for_group(n, ids, [1.0, 1.0]) for n in range(4)] == [LAKE, GUESS, LAKE, GUESS]
    step = plan_groups(2, num_groups=4, group_size=2, env_ids=ids, seed=0, weights=[3.0, 1.0])
    assert step == plan_groups(2, num_groups=4, group_size=2, env_ids=ids, seed=0, weights=[3, 1])


def test_a_mixed_run_logs_each_env_and_passes_each_its_kwargs(tmp_path: Path) -> None:
    # the quickstart with a two-env mix: a game and a tool env
    base = yaml.safe_load(QUICKSTART.read_text())
    base["env"]["id"] = [TOOL, {"id": LAKE, "kwargs": {"size": 2, "hole_fraction": 0.0}}]
    base["env"]["kwargs"] = {"max_turns": 6}
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump(base))
    cfg = load_config(
        config,
        [
            *TINY,
            "env.num_groups=2",
            "train.steps=1",
            "sft.epochs=0",
            "eval.episodes=4",
            "rollout.max_new_tokens=6",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    assert cfg.env.kwargs == {"max_turns": 6} and cfg.env.kwargs_for(LAKE)["size"] == 2
    rows = AgenticPipeline(cfg).fit()
    step = rows[-1]
    for prefix in ("train", "eval"):
        assert {f"{prefix}/{LAKE}/success", f"{prefix}/{TOOL}/success"} <= set(step)
        assert f"{prefix}/success" in step
    assert step["train/episodes"] == 8  # one group of 4 per env
    logged = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert f"train/{TOOL}/reward" in logged and f"eval/{LAKE}/success" in logged


def test_each_env_of_a_mix_is_made_with_its_own_kwargs() -> None:
    source = LocalEnvSource({"max_turns": 3}, kwargs_by_env={LAKE: {"size": 2}})

    async def sessions():
        return await source.session(LAKE), await source.session(GUESS)

    lake, other = asyncio.run(sessions())
    assert lake.env.size == 2 and lake.env.max_turns == 3  # its own kwargs over the shared ones
    assert other.env.max_turns == 3


def test_each_env_of_a_mix_has_its_own_group_size_and_held_out_eval(tmp_path: Path) -> None:
    """``{id, group_size, eval: {episodes, kwargs}}``: the lake plays groups of 2 on 2x2 maps and
    is evaluated on 8 held-out 3x3 maps; guess-number plays groups of 4 and is not evaluated."""
    base = yaml.safe_load(QUICKSTART.read_text())
    lake = {
        "id": LAKE,
        "kwargs": {"size": 2, "hole_fraction": 0.0},
        "group_size": 2,
        "eval": {"episodes": 8, "kwargs": {"size": 3}},
    }
    base["env"]["id"] = [lake, {"id": GUESS, "eval": False}]
    base["env"]["kwargs"] = {"max_turns": 6}
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump(base))
    cfg = load_config(
        config,
        [
            *TINY,
            "env.num_groups=2",
            "env.group_size=4",
            "train.steps=1",
            "sft.epochs=0",
            "eval.episodes=100",  # shared by envs without a count of their own: none here
            "rollout.max_new_tokens=6",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    assert cfg.env.group_sizes == [2, 4] and cfg.env.eval_counts() == {LAKE: 8, GUESS: 0}
    pipeline = AgenticPipeline(cfg)
    plan = pipeline.eval_plan()
    assert {spec.env_id for spec in plan} == {LAKE} and len(plan) == 8
    assert "'size': 3}" in pipeline.describe_eval()
    seen: list[dict] = []
    pipeline.store.write = lambda kind, step, records: seen.extend(  # type: ignore[method-assign]
        {"kind": kind, **r} for r in records
    )
    step = pipeline.fit()[-1]
    assert step["train/episodes"] == 6  # a group of 2 (lake) and a group of 4 (guess)
    assert step["eval/episodes"] == 8 and f"eval/{GUESS}/success" not in step
    evaluated = [r for r in seen if r["kind"] == "eval"]
    assert evaluated and all(r["env_id"] == LAKE for r in evaluated)
    first = json.loads(evaluated[0]["messages"])[0]["content"]
    assert "3x3" in first  # the held-out maps are 3x3; training plays 2x2


def mix_with_held_out(tmp_path: Path, held_out: dict) -> TrainerConfig:
    """Guess-number and a lake evaluated with ``held_out`` (its eval kwargs)."""
    base = yaml.safe_load(QUICKSTART.read_text())
    lake = {"id": LAKE, "eval": {"episodes": 2, "kwargs": held_out}}
    base["env"]["id"] = [{"id": GUESS, "eval": {"episodes": 2}}, lake]
    base["env"]["kwargs"] = {"max_turns": 4}
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump(base))
    return load_config(
        config, [*TINY, "train.steps=0", "sft.epochs=0", f"output_dir={tmp_path / 'run'}"]
    )


def test_eval_kwargs_an_env_cannot_be_built_with_stop_the_run_before_it_starts(
    tmp_path: Path,
) -> None:
    """The run found out at its first evaluation (after the warm start) and then left the env
    out of its evaluation in silence."""
    with pytest.raises(ConfigError) as refused:
        AgenticPipeline(mix_with_held_out(tmp_path, {"size": 1}))  # no lake is 1x1
    message = str(refused.value)
    assert f"env.id[1].eval.kwargs: {LAKE} cannot be built with {{'max_turns': 4, 'size': 1}}" in (
        message
    )
    assert "size must be an int >= 2, got 1" in message


def test_an_env_of_a_mix_none_of_whose_eval_episodes_finish_stops_the_run_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its evaluation was dropped in silence: the run reported the other env's only."""
    from envs.games.frozen_lake import FrozenLakeEnv
    from trainer.errors import RolloutError

    def failing_reset(self: FrozenLakeEnv, options: dict) -> None:
        raise RuntimeError("the held-out maps are missing")

    pipeline = AgenticPipeline(mix_with_held_out(tmp_path, {"size": 3}))
    monkeypatch.setattr(FrozenLakeEnv, "on_reset", failing_reset)
    try:
        with pytest.raises(RolloutError) as refused:
            pipeline.evaluate()
    finally:
        pipeline.close()
    message = str(refused.value)
    assert message.startswith(f"evaluation of {LAKE}: all 2 episodes failed")
    assert "the held-out maps are missing" in message and "eval kwargs" in message


def test_eval_episodes_that_fail_every_retry_are_counted_and_named(caplog) -> None:
    from trainer.rollout.groups import EpisodeSpec, eval_failures
    from trainer.rollout.trajectory import Trajectory

    specs = [EpisodeSpec(env_id, seed, seed) for env_id in (LAKE, GUESS) for seed in range(3)]
    finished = [Trajectory(LAKE, 0), Trajectory(LAKE, 1), *(Trajectory(GUESS, s) for s in range(3))]
    failed = [Trajectory(LAKE, 2, failed=True, failure="the env's server went away")]
    with caplog.at_level("WARNING"):
        metrics = eval_failures(specs, finished, failed)
    assert metrics == {
        "eval/failed_episodes": 1.0,
        f"eval/{LAKE}/failed_episodes": 1.0,
        f"eval/{GUESS}/failed_episodes": 0.0,
    }
    assert "1 of 6 episodes failed every retry" in caplog.text
    assert "the env's server went away" in caplog.text
