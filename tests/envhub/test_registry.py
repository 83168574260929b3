"""register / make / spec / list_envs, variants, hints, plugin failures, Gymnasium mirror."""

from __future__ import annotations

import importlib.metadata
import json

import gymnasium
import pytest
from click.testing import CliRunner

import envhub
from envhub.cli import main
from envhub.errors import EnvKwargsError, RegistrationError, UnknownEnvError
from envhub.registry import Registry

COUNTDOWN = "tests.helpers:CountdownEnv"


def test_register_make_spec_and_list(fresh_registry):
    fresh_registry.register("acme/countdown-v0", COUNTDOWN, max_turns=5, description="Say go.")
    env = fresh_registry.make("acme/countdown-v0", goal="stop")
    assert env.goal == "stop" and env.max_turns == 5
    spec = fresh_registry.spec("acme/countdown-v0")
    assert (spec.namespace, spec.name, spec.version) == ("acme", "countdown", 0)
    assert [s.id for s in fresh_registry.list_envs()] == ["acme/countdown-v0"]


def test_variants_layer_kwargs_on_the_family(fresh_registry):
    fresh_registry.register(
        "acme/countdown-v1",
        COUNTDOWN,
        kwargs={"goal": "go"},
        variants={"stop": {"goal": "stop", "max_turns": 9}},
    )
    variant = fresh_registry.spec("acme/countdown-stop-v1")
    assert (variant.family, variant.variant) == ("acme/countdown-v1", "stop")
    env = fresh_registry.make("acme/countdown-stop-v1")
    assert (env.goal, env.max_turns) == ("stop", 9)
    assert [s.id for s in fresh_registry.list_envs(variants=False)] == ["acme/countdown-v1"]


def test_a_variant_reports_the_max_turns_and_description_it_is_made_with(fresh_registry):
    """Rollouts are sized from the spec (as from Gymnasium's ``max_episode_steps``): a variant
    that sets ``max_turns`` says so in its spec, and its description says what it changes."""
    fresh_registry.register(
        "acme/countdown-v2",
        COUNTDOWN,
        kwargs={"goal": "go"},
        max_turns=5,
        description="Say go (in 5 turns by default).",
        variants={"long": {"max_turns": 9}, "stop": {"goal": "stop"}},
    )
    fresh_registry.register("acme/countdown-v3", COUNTDOWN, kwargs={"max_turns": 7}, max_turns=5)
    for id, turns in (("countdown-long-v2", 9), ("countdown-stop-v2", 5), ("countdown-v3", 7)):
        spec = fresh_registry.spec(f"acme/{id}")
        assert (spec.max_turns, fresh_registry.make(spec.id).max_turns) == (turns, turns), id
    long = fresh_registry.spec("acme/countdown-long-v2").description
    assert long == "Say go (in 5 turns by default). Variant long: max_turns=9."


def test_max_turns_in_kwargs_may_be_any_integral_number_and_nothing_else(fresh_registry):
    """A plugin that computes ``max_turns`` with numpy registers, and its spec holds an int; a
    turn limit that is not a positive whole number is refused at registration."""
    np = pytest.importorskip("numpy")
    fresh_registry.register("acme/countdown-v4", COUNTDOWN, kwargs={"max_turns": np.int64(5)})
    spec = fresh_registry.spec("acme/countdown-v4")
    assert spec.max_turns == 5 and type(spec.max_turns) is int
    assert fresh_registry.make(spec.id).max_turns == 5
    for n, bad in enumerate([0, -1, np.int64(0), 2.0, 2.5, True, "5"]):
        with pytest.raises(RegistrationError, match="max_turns must be a positive int, got"):
            fresh_registry.register(f"acme/bad{n}-v0", COUNTDOWN, kwargs={"max_turns": bad})


def test_spec_and_list_json_give_each_builtin_id_the_max_turns_make_builds():
    from envhub.registry import BUILTIN_PLUGINS

    result = CliRunner().invoke(main, ["list", "--json"])
    listed = {row["id"]: row for row in json.loads(result.stdout)["envs"]}
    builtin = [s for s in envhub.list_envs() if s.source in BUILTIN_PLUGINS]
    assert sum(s.variant is not None for s in builtin) >= 10
    for spec in builtin:
        assert listed[spec.id]["max_turns"] == spec.max_turns, spec.id
        if spec.max_turns is not None:  # None: the env picks its own (see EnvSpec.max_turns)
            env = envhub.make(spec.id)
            assert env.max_turns == spec.max_turns, spec.id
            env.close()
    hard = envhub.spec("games/guess-number-hard-v0").description
    assert "high=1000" in hard and "max_turns=12" in hard, hard
    assert "target=256" in envhub.spec("games/2048-256-v0").description


def test_namespace_may_be_omitted_when_unambiguous(fresh_registry):
    fresh_registry.register("acme/countdown-v0", COUNTDOWN)
    assert fresh_registry.spec("countdown-v0").id == "acme/countdown-v0"
    fresh_registry.register("other/countdown-v0", COUNTDOWN)
    with pytest.raises(UnknownEnvError):
        fresh_registry.spec("countdown-v0")


def test_unknown_id_suggests_close_ids():
    with pytest.raises(UnknownEnvError) as caught:
        envhub.make("games/sokobn-v0")
    message = str(caught.value)
    assert message.startswith(
        "no environment registered under 'games/sokobn-v0'. Did you mean 'games/sokoban-v0'"
    )
    assert message.endswith("Run `envhub list` to see every id.")
    with pytest.raises(UnknownEnvError, match="Did you mean 'games/wordle-v0'"):
        envhub.spec("wordle-v1")
    with pytest.raises(KeyError):  # still a KeyError for dict-minded callers
        envhub.spec("nothing/like-this-v0")


def test_bad_kwargs_name_the_accepted_ones():
    with pytest.raises(EnvKwargsError) as caught:
        envhub.make("games/guess-number-v0", hihg=5)
    assert str(caught.value) == (
        "games/guess-number-v0 got unexpected keyword argument(s) 'hihg' ('hihg' -> did you mean "
        "'high'?); it accepts: low, high, max_turns, action_format, action_tag, "
        "invalid_action_penalty, render_mode (read from the signatures of its __init__ and of "
        "the parents it passes **kwargs to; if it takes other keywords, register a function "
        "that takes **kwargs and builds the env as its entry point)"
    )
    assert isinstance(caught.value, TypeError)


def test_an_env_that_keeps_its_own_config_kwargs_accepts_them(fresh_registry):
    """``__init__(self, max_turns=None, **config)`` that keeps ``config`` (passes none of it to
    ``TextEnv``) is configured as its author wrote it, not refused."""
    fresh_registry.register("acme/config-v0", "tests.envhub.author_bugs:KeepsConfig")
    env = fresh_registry.make("acme/config-v0", difficulty=3, max_turns=2)
    assert env.config == {"difficulty": 3} and env.max_turns == 2
    assert fresh_registry.spec("acme/config-v0").accepted_kwargs() is None


def test_an_env_that_passes_kwargs_on_still_has_typos_refused_saying_how_it_knows(fresh_registry):
    fresh_registry.register("acme/forwards-v0", "tests.envhub.author_bugs:ForwardsConfig")
    assert fresh_registry.make("acme/forwards-v0", level=2, max_turns=4).level == 2
    with pytest.raises(EnvKwargsError) as caught:
        fresh_registry.make("acme/forwards-v0", levle=2)
    message = str(caught.value)
    assert "'levle' -> did you mean 'level'?" in message
    assert "read from the signatures of its __init__" in message
    assert "register a function that takes **kwargs" in message


def test_an_env_without_kwargs_gets_no_note_about_inference(fresh_registry):
    fresh_registry.register("acme/countdown-v0", COUNTDOWN)
    with pytest.raises(EnvKwargsError) as caught:
        fresh_registry.make("acme/countdown-v0", gaol="x")
    assert str(caught.value).endswith("it accepts: goal, max_turns, system_prompt")


def test_malformed_ids_and_entry_points_are_refused(fresh_registry):
    for bad in ("countdown", "acme/countdown", "Acme/countdown-v0", "acme/countdown-vX"):
        with pytest.raises(
            RegistrationError, match="malformed environment id .* use 'namespace/name-vN'"
        ):
            fresh_registry.register(bad, COUNTDOWN)
    with pytest.raises(RegistrationError, match="entry_point must be 'module:ClassName'"):
        fresh_registry.register("acme/x-v0", "tests.helpers.CountdownEnv")
    fresh_registry.register("acme/missing-v0", "tests.helpers:NoSuchEnv")
    with pytest.raises(
        RegistrationError, match="cannot load entry point 'tests.helpers:NoSuchEnv'"
    ):
        fresh_registry.make("acme/missing-v0")


def test_conflicting_registration_needs_override(fresh_registry):
    fresh_registry.register("acme/countdown-v0", COUNTDOWN)
    fresh_registry.register("acme/countdown-v0", COUNTDOWN)  # identical: a no-op
    with pytest.raises(RegistrationError, match="already registered .* pass override=True"):
        fresh_registry.register("acme/countdown-v0", COUNTDOWN, max_turns=2)
    fresh_registry.register("acme/countdown-v0", COUNTDOWN, max_turns=2, override=True)
    assert fresh_registry.spec("acme/countdown-v0").max_turns == 2


def test_callable_entry_points_accept_any_kwargs_they_declare(fresh_registry):
    from tests.helpers import CountdownEnv

    fresh_registry.register("acme/factory-v0", lambda **kw: CountdownEnv(**kw))
    assert fresh_registry.make("acme/factory-v0", goal="x").goal == "x"


def test_ids_work_through_gymnasium_make():
    envhub.load_plugins()
    env = gymnasium.make("games/guess-number-easy-v0")
    messages, _info = env.reset(seed=0)
    assert "between 1 and 20" in messages[0]["content"]
    assert env.unwrapped.spec.id == "games/guess-number-easy-v0"
    made = envhub.make("games/guess-number-v0", high=50)
    rebuilt = gymnasium.make(made.spec)
    assert rebuilt.unwrapped.high == 50


class _EntryPoint:
    def __init__(self, name: str, value: str) -> None:
        self.name, self.value = name, value


def test_broken_plugin_is_reported_and_others_still_load(monkeypatch):
    plugins = [
        _EntryPoint("broken", "tests.no_such_module:register"),
        _EntryPoint("good", "tests.helpers:register_countdown"),
    ]
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group: plugins if group == "envhub.envs" else []
    )
    registry = Registry()
    with pytest.warns(
        RuntimeWarning, match=r"plugin 'broken' \(tests.no_such_module:register\) failed to load"
    ):
        specs = registry.list_envs("helpers")
    assert [s.id for s in specs] == ["helpers/countdown-v0"]
    assert specs[0].source == "good"
    [failure] = registry.plugin_errors()
    assert (failure.name, failure.error.split(":")[0]) == ("broken", "ModuleNotFoundError")
    assert len(registry.list_envs("games")) >= 4  # the built-ins loaded too
    with pytest.raises(UnknownEnvError, match=r"1 plugin\(s\) failed to load"):
        registry.spec("helpers/nothing-v0")


def test_making_an_env_again_reads_its_classes_source_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which keywords an env takes is read from its source (``envhub.signatures``) once per
    class, not per ``make``: rollouts build an env per episode, and the parse runs under a
    process-wide lock (``envhub.safe_ast``)."""
    import inspect

    from envhub import signatures

    read: list[object] = []
    real = inspect.getsource
    monkeypatch.setattr(signatures.inspect, "getsource", lambda o: read.append(o) or real(o))
    envhub.make("games/frozen-lake-v0").close()
    first = len(read)
    for _ in range(3):
        envhub.make("games/frozen-lake-v0").close()
    assert len(read) == first
