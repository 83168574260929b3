"""``describe_tools``: a tool env lists its tools in its system prompt (the protocol for a model
whose chat template renders no tools), and leaves the listing out where the template lists them
(``reset(options={"describe_tools": False})``, or the constructor's default), so a prompt does
not describe every tool twice."""

from __future__ import annotations

import pytest

import envhub

CALC = "tools/calculator-v0"
LISTING = "You can call these tools"


def system_prompt(env, **options) -> str:
    messages, _ = env.reset(seed=3, options=options or None)
    assert messages[0]["role"] == "system"
    return messages[0]["content"]


@pytest.mark.parametrize("env_id", ["tools/calculator-v0", "tools/sql-v0", "tools/lookup-v0"])
def test_the_listing_is_on_by_default_and_off_per_episode(env_id) -> None:
    env = envhub.make(env_id)
    try:
        described = system_prompt(env)
        bare = system_prompt(env, describe_tools=False)
        again = system_prompt(env)
        question = env.reset(seed=3, options={"describe_tools": False})[0][1:]
        assert question == env.reset(seed=3)[0][1:]  # the same task either way
    finally:
        env.close()
    names = [tool["function"]["name"] for tool in env.tools]
    assert LISTING in described and all(f'"name": "{n}"' in described for n in names)
    assert LISTING not in bare and not any(f'"name": "{n}"' in bare for n in names)
    assert "<tool_call>" not in bare  # the template's own call format applies
    assert "<answer>...</answer>" in bare  # how to end the episode is the env's to say
    assert again == described


def test_the_constructor_sets_the_default_and_a_bad_value_names_the_fix() -> None:
    env = envhub.make(CALC, describe_tools=False)
    try:
        assert LISTING not in system_prompt(env)
        assert LISTING in system_prompt(env, describe_tools=True)
        with pytest.raises(TypeError, match=r"describe_tools must be True or False, got 'no'"):
            env.reset(seed=0, options={"describe_tools": "no"})
    finally:
        env.close()
