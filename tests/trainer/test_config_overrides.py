"""``a.b.c=value`` overrides over a YAML file: a dotted key sets one value, a mapping value
replaces the whole mapping (``env.kwargs={}`` clears the file's kwargs), and the refusals that
follow name the override that fixes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
FILE_KWARGS = {"action_format": "raw", "size": 3, "hole_fraction": 0.4, "max_turns": 6}


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, overrides)
    return [str(p) for p in info.value.problems]


def test_an_empty_mapping_override_clears_the_files_mapping() -> None:
    assert load_config(QUICKSTART).env.kwargs == FILE_KWARGS
    assert load_config(QUICKSTART, ["env.kwargs={}"]).env.kwargs == {}


def test_a_mapping_override_replaces_the_files_mapping_whole() -> None:
    assert load_config(QUICKSTART, ["env.kwargs={size: 4}"]).env.kwargs == {"size": 4}


def test_a_dotted_override_still_sets_one_key() -> None:
    assert load_config(QUICKSTART, ["env.kwargs.size=4"]).env.kwargs == {**FILE_KWARGS, "size": 4}


def test_later_overrides_apply_in_order() -> None:
    assert load_config(QUICKSTART, ["env.kwargs={}", "env.kwargs.size=4"]).env.kwargs == {"size": 4}
    assert load_config(QUICKSTART, ["env.kwargs.size=4", "env.kwargs={}"]).env.kwargs == {}


def test_another_env_with_the_files_kwargs_is_told_how_to_clear_them() -> None:
    problems = problems_of(["env.id=games/guess-number-v0"])
    size = next(p for p in problems if p.startswith("env.kwargs.size:"))
    # no hint: no dangling "; " before the accepted list
    assert "takes no keyword argument 'size' (it accepts: low, high" in size
    assert "env.kwargs={}" in size  # the override that clears the file's kwargs
    assert "quickstart.yaml:" in size


def test_env_kwargs_with_a_hub_name_the_serve_command_that_takes_them() -> None:
    [problem] = problems_of(["env.hub=ws://127.0.0.1:9"])
    assert problem.startswith("env.kwargs: env kwargs cannot be sent to the remote hub")
    assert (
        "envhub serve --env games/frozen-lake-v0 -k action_format=raw -k size=3 "
        "-k hole_fraction=0.4 -k max_turns=6" in problem
    )
    assert "env.kwargs={}" in problem
    assert load_config(QUICKSTART, ["env.hub=ws://127.0.0.1:9", "env.kwargs={}"]).env.kwargs == {}
