"""Values of the wrong shape (a mapping where a string or list goes, a list where a section goes,
nested junk): each is refused promptly with one problem at the key the user wrote.

These once sent the loader into an endless loop (``envhub train cfg.yaml --dry-run`` spun at
100% CPU), so each test has a timeout of its own: a regression fails instead of hanging CI."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError


def problems_of(path: Path | None, overrides: list[str] = ()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return [str(p) for p in info.value.problems]


@pytest.mark.timeout(20)
def test_one_env_entry_written_as_a_mapping_under_env_id_is_one_problem_with_the_fix(
    tmp_path: Path,
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("env:\n  id:\n    id: games/frozen-lake-v0\n    weight: 2\n")
    [problem] = problems_of(config)
    assert problem.startswith("env.id: takes an env id or a list of env ids and/or entries")
    assert "write the entry as a list item" in problem
    assert problem.endswith(f"(at {config}:2)")


@pytest.mark.timeout(20)
def test_an_env_id_mapping_from_an_override_is_one_problem_naming_the_override() -> None:
    override = "env.id={id: games/frozen-lake-v0}"
    [problem] = problems_of(None, [override])
    assert problem.startswith("env.id: takes an env id or a list of env ids and/or entries")
    assert problem.endswith(f"(at override {override!r})")


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("model.lora.target_modules={a: 1}", "model.lora.target_modules"),
        ("model.lora.target_modules={a: {b: [1, {c: 2}]}}", "model.lora.target_modules"),
        ("env.rewards={kind: exact}", "env.rewards"),
        ("roles.actor_train.device_mapping={a: 1}", "roles.actor_train.device_mapping"),
        ("env.kwargs=[1, 2]", "env.kwargs"),
        ("rollout=[1]", "rollout"),
        ("roles={actor_train: [1, {x: 2}]}", "roles.actor_train"),
        ("env.id=[[[{a: [1]}]]]", "env.id[0]"),
        ("env.id=[{id: {id: {id: x}}}]", "env.id[0].id"),
        ("env.id=[{id: games/frozen-lake-v0, eval: [1, {a: 2}]}]", "env.id[0].eval"),
        (
            "env.id=[{id: games/frozen-lake-v0, eval: {episodes: {a: 1}}}]",
            "env.id[0].eval.episodes",
        ),
    ],
)
def test_a_value_of_the_wrong_shape_is_one_problem_at_its_key(override: str, path: str) -> None:
    model = ["model.lora.rank=8"] if override.startswith("model.lora") else []
    [problem] = problems_of(None, [*model, override])
    assert problem.startswith(f"{path}: "), problem
    assert problem.endswith(f"(at override {override!r})"), problem
    assert "[" not in problem.partition(":")[0].replace(path, ""), problem  # no pydantic type tags


@pytest.mark.timeout(20)
def test_an_empty_env_list_is_a_problem_at_env_id_naming_the_fix() -> None:
    [problem] = problems_of(None, ["env.id=[]"])
    assert problem.startswith("env.id: is an empty list; give at least one env id")
    assert problem.endswith("(at override 'env.id=[]')")
