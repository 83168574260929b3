"""The trainer config tree: defaults, YAML + overrides, and the errors users meet first."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from trainer.config import TrainerConfig, load_config, parse_overrides
from trainer.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(path: Path | None, overrides: list[str] = ()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return [str(p) for p in info.value.problems]


# --------------------------------------------------------------------------- loading


def test_defaults_load_and_derive_values() -> None:
    cfg = load_config(None)
    assert cfg.batch_size == cfg.env.group_size * cfg.env.num_groups == 32
    assert cfg.active_roles == ["actor_train", "actor_infer"]
    assert cfg.roles.actor_infer.strategy == "hf"  # from rollout.engine
    assert cfg.device_plan.colocated("actor_train", "actor_infer")
    assert cfg.checkpoint_dir == Path("runs/latest/checkpoints")


def test_yaml_and_overrides_with_yaml_typed_values(tmp_path: Path) -> None:
    path = write(tmp_path, "env:\n  id: games/sokoban-v0\n  group_size: 4\ntrain:\n  lr: 0.001\n")
    cfg = load_config(
        path,
        [
            "train.lr=3e-4",
            "roles.actor_train.strategy=fsdp2",
            "roles.actor_train.device_mapping=[0,1]",
            "algorithm.loss.kl_coef=0.05",
            "algorithm.advantage_estimator=gae",
            "rollout.temperature=0.5",
            "checkpoint.dir=null",
        ],
    )
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.env.id == "games/sokoban-v0" and cfg.env.group_size == 4
    assert cfg.roles.actor_train.device_mapping == [0, 1] and cfg.roles.actor_train.world_size == 2
    assert cfg.active_roles == ["actor_train", "actor_infer", "reference", "critic"]
    assert cfg.rollout.temperature == 0.5


def test_override_into_a_scalar_from_the_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "env:\n  id: games/sokoban-v0\n")
    [problem] = problems_of(path, ["env.id.name=x"])
    assert problem.startswith("env.id: is 'games/sokoban-v0' in the file, not a section")


def test_parse_overrides_shapes_a_tree() -> None:
    assert parse_overrides(["a.b=1", "a.c=[0, 1]", "d=hello", "e=true"]) == {
        "a": {"b": 1, "c": [0, 1]},
        "d": "hello",
        "e": True,
    }
    with pytest.raises(ConfigError, match=r"override 'a\.b' is not of the form a\.b\.c=value"):
        parse_overrides(["a.b"])


# --------------------------------------------------------------------------- errors


def test_unknown_key_names_path_suggestion_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  max_turns: 4\n  max_new_tokns: 8\n")
    assert problems_of(path) == [
        f"rollout.max_new_tokns: unknown key; did you mean max_new_tokens? (at {path}:3)"
    ]


def test_unknown_key_suggests_the_right_section(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  group_sise: 8\n")
    assert problems_of(path) == [
        f"rollout.group_sise: unknown key; did you mean env.group_size? (at {path}:2)"
    ]


def test_a_typo_in_an_env_mix_entry_is_one_problem_with_a_suggestion(tmp_path: Path) -> None:
    """``env.id`` is ``str | list[str | EnvEntry]``: the branches the entry is not (a string) are
    not reported beside the one it is, and the suggestion comes from the entry's own keys."""
    path = write(tmp_path, "env:\n  - id: games/frozen-lake-v0\n    wieght: 2\n")
    assert problems_of(path) == [f"env[0].wieght: unknown key; did you mean weight? (at {path}:3)"]
    lake = "games/frozen-lake-v0"
    override = f"env.id=[{lake}, {{id: {lake}, group_sise: 3}}]"
    assert problems_of(None, [override]) == [
        f"env.id[1].group_sise: unknown key; did you mean group_size? (at override {override!r})"
    ]
    [problem] = problems_of(None, [f"env.id=[{{id: {lake}, eval: {{bogus: 1}}}}]"])
    assert problem.startswith("env.id[0].eval.bogus: unknown key; valid keys here: episodes,")
    [problem] = problems_of(None, [f"env.id=[{{id: {lake}, eval: {{episodes: -1}}}}]"])
    assert problem.startswith("env.id[0].eval.episodes: Input should be greater than or equal")


def test_a_value_no_branch_of_a_union_takes_names_every_branch() -> None:
    [problem] = problems_of(None, ["env.id=[5]"])
    assert problem.startswith(
        "env.id[0]: Input should be a valid string; or Input should be a valid dictionary"
    )


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        (
            "rollout:\n  max_turns: -1\n  enigne: vllm\n"
            "train:\n  lr: fast\n"
            "roles:\n  actor_train:\n    device_mapping: [0, 1, 2]\n    num_devices_per_worker: 2\n"
            "bogus: 1\n"
        ),
    )
    problems = problems_of(path, ["algorithm.advantage_estimator=ppo"])
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert f"rollout.max_turns: Input should be greater than 0 (got -1) (at {path}:2)" in text
    assert f"rollout.enigne: unknown key; did you mean engine? (at {path}:3)" in text
    assert (
        "train.lr: Input should be a valid number, unable to parse string as a number (got 'fast')"
        in text
    )
    assert (
        "roles.actor_train.device_mapping: 3 devices do not split into workers of 2 devices "
        "(num_devices_per_worker=2)"
    ) in text
    assert "bogus: unknown key" in text
    assert (
        "algorithm.advantage_estimator: Input should be 'gae', 'gigpo', 'grpo', 'reinforce_pp' or "
        "'rloo' (got 'ppo') (at override 'algorithm.advantage_estimator=ppo')"
    ) in text


def test_broken_yaml_reports_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "env:\n  id: games/sokoban-v0\n  group_size: [4\nrollout: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    [problem] = info.value.problems
    assert problem.message.startswith("broken YAML:")
    assert problem.where is not None and problem.where.startswith(f"{path}:4:")


def test_missing_file_and_non_mapping_top_level(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert problems_of(missing) == [f"config file {str(missing)!r} does not exist; check the path"]
    [problem] = problems_of(write(tmp_path, "- a\n- b\n"))
    assert "the top level must be a mapping of sections" in problem


def test_duplicate_yaml_keys_are_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: 0.1\n  lr: 0.2\n")
    assert problems_of(path) == [
        f"train.lr: duplicate key; the later value would silently win, keep one (at {path}:3)"
    ]


def test_section_level_rules(tmp_path: Path) -> None:
    assert problems_of(None, [f"model.path={tmp_path}", "model.tiny={}", "sft.source=file"]) == [
        (
            "model: set model.path (a local checkpoint) or model.tiny (build one), not both (at "
            f"override 'model.path={tmp_path}', override 'model.tiny={{}}')"
        ),
        "sft: source 'file' needs path: a JSONL of trajectories (at override 'sft.source=file')",
    ]
    assert problems_of(None, ["model.tiny.num_heads=3"]) == [
        "model.tiny: num_heads=3 must divide hidden_size=64 (at override 'model.tiny.num_heads=3')"
    ]


def test_cross_section_problems_are_reported_together() -> None:
    problems = problems_of(
        None,
        [
            "env.id=games/sokobn-v0",
            "roles.actor_train.strategy=fsdp2",
            "roles.actor_train.device_mapping=[0,1,2]",
            "env.group_size=1",
            "env.num_groups=1",
            "rollout.engine=vllm",
            "roles.actor_infer.strategy=hf",
        ],
    )
    text = "\n".join(problems)
    assert len(problems) == 4, problems
    assert "env.group_size: algorithm.advantage_estimator=grpo compares episodes" in text
    assert (
        "env.id: no environment registered under 'games/sokobn-v0'. Did you mean 'games/sokoban-v0'"
        in text
    )
    assert (
        "env.num_groups: the batch of 1 episodes (env.group_size * env.num_groups) does not split "
        "evenly over the 3 actor_train workers; make it a multiple of 3"
    ) in text
    assert (
        "roles.actor_infer.strategy: 'hf' disagrees with rollout.engine='vllm'; "
        "set only rollout.engine"
    ) in text


def test_colocated_role_that_cannot_offload_is_refused() -> None:
    cfg = load_config(None)
    mapping = cfg.device_mapping(can_offload=lambda strategy: strategy != "hf")
    text = "\n".join(str(p) for p in mapping.problems())
    assert (
        "roles.actor_train.device_mapping: shares devices with actor_infer, but strategy 'hf' "
        "cannot offload"
    ) in text


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["rollout.agent.timeout_s=5"], "rollout.agent: rollout.agent needs exactly one of"),
        (
            ["rollout.agent.callable=a:b", "rollout.agent.command=python x.py"],
            "rollout.agent needs exactly one of callable",
        ),
        (
            ["rollout.agent.callable=my_agents"],
            "names no function; write 'package.module:function'",
        ),
        (
            ["rollout.agent.callable=no_such_agents:run"],
            "rollout.agent.callable: cannot import 'no_such_agents' (ModuleNotFoundError",
        ),
        (["rollout.agent.callable=json:no_such"], "'json' has no function 'no_such'"),
        (
            ["rollout.agent.command=no-such-program --flag"],
            "rollout.agent.command: 'no-such-program' is not an executable on PATH",
        ),
        (
            ["rollout.agent.callable=json:dumps", "rollout.agent.limits.max_body_bytes=0"],
            "rollout.agent.limits.max_body_bytes: Input should be greater than 0",
        ),
        (
            ["rollout.agent.callable=json:dumps", "rollout.agent.limits.max_body=1024"],
            "rollout.agent.limits.max_body: unknown key; did you mean max_body_bytes?",
        ),
        (["rollout.pause_timeout_s=0"], "rollout.pause_timeout_s: Input should be greater than 0"),
    ],
)
def test_an_agent_that_cannot_run_is_a_config_problem(overrides: list[str], problem: str) -> None:
    text = "\n".join(problems_of(None, overrides))
    assert problem in text, text


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            ["rollout.route_in_workers=true"],
            (
                "rollout: rollout.route_in_workers routes each env worker's turns in that "
                "worker; set rollout.env_workers >= 1"
            ),
        ),
        (
            ["rollout.route_in_workers=true", "rollout.env_workers=2", "cluster.backend=local"],
            (
                "rollout.route_in_workers: env workers route their turns to the actor_infer "
                "workers' Ray actors, and with cluster.backend: local those live in the driver; "
                "set cluster.backend: ray"
            ),
        ),
    ],
)
def test_routing_in_env_workers_needs_workers_and_ray(overrides: list[str], problem: str) -> None:
    text = "\n".join(problems_of(None, overrides))
    assert problem in text, text


def test_remote_hub_skips_the_local_registry() -> None:
    cfg = load_config(None, ["env.hub=ws://127.0.0.1:9", "env.id=acme/only-remote-v0"])
    assert cfg.env.ids == ["acme/only-remote-v0"]


# --------------------------------------------------------------------------- the tree itself


def _sections(model: type[BaseModel]) -> list[type[BaseModel]]:
    found = [model]
    for field in model.model_fields.values():
        for candidate in getattr(field.annotation, "__args__", (field.annotation,)):
            if (
                isinstance(candidate, type)
                and issubclass(candidate, BaseModel)
                and candidate not in found
            ):
                found += [s for s in _sections(candidate) if s not in found]
    return found


def test_every_field_is_documented_and_every_section_forbids_extras() -> None:
    sections = _sections(TrainerConfig)
    assert len(sections) >= 12
    for section in sections:
        assert section.model_config.get("extra") == "forbid", section.__name__
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no docstring"


EXAMPLES = sorted(glob.glob(str(REPO / "examples" / "*.yaml")))


@pytest.mark.skipif(not EXAMPLES, reason="no examples/*.yaml shipped yet")
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).name)
def test_every_shipped_example_config_loads(path: str, tmp_path: Path) -> None:
    # a GPU recipe names a checkpoint folder this machine may lack (the model must exist at
    # load): point it at a stand-in folder, as its first line's command does with a real one
    names_a_model = (yaml.safe_load(Path(path).read_text())["model"] or {}).get("path")
    cfg = load_config(path, [f"model.path={tmp_path}"] if names_a_model else [])
    assert isinstance(cfg, TrainerConfig)
    first = Path(path).read_text().splitlines()[0]
    assert first.startswith("#") and "envhub train" in first, (
        f"{path} must start with a comment giving the command that runs it (STYLE.md 9)"
    )


def test_greedy_training_rollouts_are_refused_naming_eval_temperature(tmp_path: Path) -> None:
    """The trainer takes its log-probs under softmax(logits / rollout.temperature): greedy
    tokens have none, so 0 is refused at load (greedy evaluation is eval.temperature's)."""
    path = write(tmp_path, "env:\n  id: games/sokoban-v0\n")
    [problem] = problems_of(path, ["rollout.temperature=0"])
    assert problem.startswith("rollout.temperature")
    assert "greedy" in problem and "eval.temperature: 0" in problem


def test_batches_in_flight_keep_hf_runs_reproducible_unless_asked() -> None:
    """With ``hf`` a rank runs one batch at a time unless ``rollout.batches_in_flight`` says
    otherwise (the same batches in every run: ``test_cli``'s kill -9 resume gives the same
    next step); vLLM's batches vary with timing anyway, so it runs several."""
    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    assert load_config(quickstart).rollout.rank_batches() == 1
    vllm = ["rollout.engine=vllm", "model.tiny.num_heads=2"]  # head size 32: vLLM on CPU takes it
    assert load_config(quickstart, vllm).rollout.rank_batches() == 16
    asked = load_config(quickstart, ["rollout.batches_in_flight=4"])
    assert asked.rollout.rank_batches() == 4
