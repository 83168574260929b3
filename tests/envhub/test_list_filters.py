"""``envhub list -n NAMESPACE`` and ``-s SOURCE`` refuse a name that matches nothing alike: exit 2
and a "did you mean" naming what there is (an empty listing would read as "no envs there")."""

from __future__ import annotations

from click.testing import CliRunner

from envhub.cli import main


def listing(*args: str):
    return CliRunner().invoke(main, ["list", *args])


def test_a_misspelt_namespace_is_refused_with_did_you_mean_like_a_source() -> None:
    for flag, typo in (("-n", "gmaes"), ("-s", "envhub.game")):
        result = listing(flag, typo)
        assert result.exit_code == 2, (flag, result.output)
        assert "Did you mean" in result.stderr and result.stdout == "", result.output
    result = listing("-n", "gmaes")
    assert "no namespace named 'gmaes'. Did you mean 'games'?" in result.stderr
    assert "Namespaces: " in result.stderr and "tools" in result.stderr


def test_a_namespace_that_exists_still_lists_and_json_is_refused_alike() -> None:
    assert "games/sokoban-v0" in listing("-n", "games").stdout
    assert listing("-n", "gmaes", "--json").exit_code == 2
