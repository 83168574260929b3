"""The TextEnv contract, guarantee by guarantee (see envhub/core.py)."""

from __future__ import annotations

import json
import math
import pickle

import pytest

import envhub
from envhub.core import ChatSpace, TextSpace, as_messages, messages_to_text
from envhub.errors import EpisodeOverError, ResetNeededError
from tests.helpers import CountdownEnv


def test_reset_returns_chat_messages_and_contract_info(countdown):
    messages, info = countdown.reset(seed=7)
    assert messages == [{"role": "user", "content": f"Say go. Secret {info['secret']}."}]
    assert info["turn"] == 0 and info["success"] is False and info["invalid_action"] is False
    assert info["tools"][0]["function"]["name"] == "shout"
    assert countdown.observation_space.contains(messages)


def test_system_prompt_comes_first():
    env = CountdownEnv(system_prompt="You are terse.")
    messages, _ = env.reset(seed=0)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == "You are terse."


def test_same_seed_same_episode_different_seed_differs(countdown):
    first = countdown.reset(seed=3)[1]["secret"]
    assert countdown.reset(seed=3)[1]["secret"] == first
    assert len({countdown.reset(seed=s)[1]["secret"] for s in range(10)}) > 1


def test_step_returns_only_new_messages_and_keeps_transcript(countdown):
    countdown.reset(seed=0)
    messages, reward, terminated, truncated, info = countdown.step("nope")
    assert messages == [{"role": "user", "content": "'nope' is not 'go'."}]
    assert reward == pytest.approx(-0.1) and info["invalid_action"] is True
    assert (terminated, truncated, info["turn"]) == (False, False, 1)
    messages, reward, terminated, truncated, info = countdown.step("go")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert [m["role"] for m in countdown.messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert countdown.done


def test_turn_limit_truncates_and_never_both_flags():
    env = CountdownEnv(max_turns=2)
    env.reset(seed=0)
    assert env.step("a")[3] is False
    _, _, terminated, truncated, info = env.step("b")
    assert (terminated, truncated, info["turn"], info["success"]) == (False, True, 2, False)


def test_a_turn_budget_that_is_a_rule_of_the_task_terminates():
    class Lost(CountdownEnv):
        out_of_turns = "terminated"  # e.g. Wordle: out of guesses = lost, not cut short

    env = Lost(max_turns=2)
    env.reset(seed=0)
    assert env.step("a")[2:4] == (False, False)
    _, _, terminated, truncated, info = env.step("b")
    assert (terminated, truncated, info["success"]) == (True, False, False)
    with pytest.raises(EpisodeOverError, match="terminated after max_turns=2"):
        env.step("go")


def test_terminating_on_the_last_turn_is_not_truncation():
    env = CountdownEnv(max_turns=1)
    env.reset(seed=0)
    _, _, terminated, truncated, _ = env.step("go")
    assert (terminated, truncated) == (True, False)


def test_step_before_reset_names_the_fix(countdown):
    with pytest.raises(ResetNeededError, match=r"before reset\(\); call env.reset\(seed=...\)"):
        countdown.step("go")


def test_step_after_end_names_the_fix(countdown):
    countdown.reset(seed=0)
    countdown.step("go")
    with pytest.raises(
        EpisodeOverError, match=r"after the episode ended \(terminated\); call env.reset\(\)"
    ):
        countdown.step("go")
    env = CountdownEnv(max_turns=1)
    env.reset(seed=0)
    env.step("x")
    with pytest.raises(EpisodeOverError, match="truncated after max_turns=1"):
        env.step("go")


def test_an_action_that_is_neither_text_nor_an_assistant_message_is_a_type_error(countdown):
    countdown.reset(seed=0)
    fix = r"takes the model's text \(a str\) or an assistant message"
    with pytest.raises(TypeError, match=fix + ".*got int"):
        countdown.step(3)
    for bad in ({"role": "user", "content": "go"}, {"content": 3}, {"tool_calls": "x"}):
        with pytest.raises(TypeError, match=fix):
            countdown.step(bad)
    assert countdown.turn == 0  # nothing was applied


def test_a_text_env_reads_an_assistant_message_as_its_text(countdown):
    countdown.reset(seed=0)
    by_message = countdown.step({"role": "assistant", "content": "go"})
    countdown.reset(seed=0)
    assert countdown.step("go") == by_message


def test_action_text_with_no_utf8_form_is_an_invalid_action(countdown):
    """A lone surrogate (JSON can carry ``"\\udcff"``) reaches no env: every env would fail
    to send it on (a shell, a URL, a browser)."""
    for action in ("go \udcff", {"role": "assistant", "content": "go \udcff"}):
        countdown.reset(seed=0)
        reply, reward, _, _, info = countdown.step(action)
        assert info["invalid_action"] and reward < 0 and countdown.turn == 1
        assert "\\udcff" in reply[0]["content"] and "UTF-8" in reply[0]["content"]


def test_action_text_over_the_spaces_max_length_is_an_invalid_action():
    """``action_space.max_length`` is a promise, not a hint: a longer action never reaches the
    env's parser (a regex over a megabyte of text can cost an env minutes)."""
    seen: list[str] = []

    class Recording(CountdownEnv):
        def on_step(self, action):
            seen.append(action)
            return super().on_step(action)

    env = Recording()
    env.action_space.max_length = 100
    for action in ("go" + " " * 200, {"role": "assistant", "content": "go" + " " * 200}):
        env.reset(seed=0)
        reply, reward, _, _, info = env.step(action)
        assert info["invalid_action"] and reward < 0 and env.turn == 1 and not seen
        assert "202 characters" in reply[0]["content"] and "100" in reply[0]["content"]
    env.reset(seed=0)
    assert env.step("go" + " " * 98)[4]["success"] and len(seen) == 1


def test_close_twice_is_safe_and_on_close_runs_once():
    calls = []

    class Closing(CountdownEnv):
        def on_close(self):
            calls.append(1)

    env = Closing()
    env.close()
    env.close()
    assert calls == [1]


def test_pickled_env_plays_the_same_episode(countdown):
    countdown.reset(seed=5)
    copy = pickle.loads(pickle.dumps(countdown))
    assert copy.reset(seed=5) == countdown.reset(seed=5)
    assert copy.step("go")[:4] == countdown.step("go")[:4]


def test_observations_and_info_are_json(countdown):
    messages, info = countdown.reset(seed=1)
    json.dumps([messages, info])
    json.dumps(countdown.step("x"))


def test_non_finite_reward_is_refused():
    class NaNEnv(CountdownEnv):
        def on_step(self, action):
            return envhub.Turn("?", reward=math.nan)

    env = NaNEnv()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="non-finite reward"):
        env.step("go")


def test_missing_methods_say_what_to_implement():
    env = envhub.TextEnv()
    with pytest.raises(NotImplementedError, match="must implement on_reset"):
        env.reset()


def test_render_ansi_shows_the_transcript():
    env = CountdownEnv()
    env.render_mode = "ansi"
    env.reset(seed=0)
    env.step("go")
    text = env.render()
    assert "[assistant] go" in text and "[user] Done." in text


def test_bad_constructor_arguments_are_refused():
    with pytest.raises(ValueError, match="max_turns must be a positive int"):
        CountdownEnv(max_turns=0)
    with pytest.raises(ValueError, match="render_mode='rgb_array' is not supported"):
        envhub.TextEnv(render_mode="rgb_array")


def test_spaces():
    chat, text = ChatSpace(), TextSpace(max_length=5)
    assert chat.contains([{"role": "tool", "content": "4", "name": "calc"}])
    assert not chat.contains([{"role": "robot", "content": "x"}])
    assert not chat.contains([{"role": "user", "content": 3}])
    assert not chat.contains("plain text")
    assert chat.contains(chat.sample())
    assert text.contains("abc") and not text.contains("abcdef") and not text.contains(b"abc")
    assert text.contains(text.sample()[:5])
    sampled = TextSpace(
        sampler=lambda rng: f"<answer>{int(rng.integers(3))}</answer>", seed=0
    ).sample()
    assert sampled.startswith("<answer>")


def test_message_helpers():
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    assert as_messages({"role": "tool", "content": "1"}) == [{"role": "tool", "content": "1"}]
    assert (
        messages_to_text([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
        == "a\n\nb"
    )
    tool = envhub.function_tool("add", "Add two numbers.", {"type": "object", "properties": {}})
    assert tool == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
