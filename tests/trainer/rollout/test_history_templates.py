"""Chat templates that do not simply append (``rollout.sample_unit``): a Qwen3-style template
that drops earlier turns' thinking, and one that renders the last assistant turn differently.
Each policy turn becomes its own sample whose prompt is exactly what the engine was given."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

import envhub

pytest.importorskip("transformers")

from tests.trainer.rollout.test_native_tools import CALC, ScriptedEngine, expert_turns
from tests.trainer.test_cli import QUICKSTART, TINY
from tests.trainer.test_pipeline import VARIED
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.models import CHATML_TEMPLATE, build_tokenizer, env_corpus
from trainer.pipeline import AgenticPipeline
from trainer.rollout.collate import collate
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling, prompt_context
from trainer.rollout.trajectory import ChatRenderer
from trainer.sft import expert_trajectories, from_messages

_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{{- '</tools><|im_end|>\\n' }}"
    "{%- endif %}"
)
_CALLS = (
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set arguments = call['function']['arguments'] %}"
    "{{- '\\n<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (arguments if arguments is string else arguments | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
)
STRIPS_THINKING = (
    _TOOLS + "{%- for message in messages %}"
    "{%- set content = message['content'] or '' %}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content }}" + _CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Like Qwen3: an assistant turn keeps its ``<think>`` block only while it is the last message."""
MARKS_EARLIER_TURNS = (
    _TOOLS + "{%- for message in messages %}"
    "{%- set earlier = message['role'] == 'assistant' and not loop.last %}"
    "{{- '<|im_start|>' + message['role'] + ('|past' if earlier else '') + '\\n' }}"
    "{{- message['content'] or '' }}" + _CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""The last assistant turn renders as ``assistant``, earlier ones as ``assistant|past``."""


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return env_corpus(CALC, episodes=12)


def tokenizer_with(corpus: list[str], template: str) -> Any:
    tokenizer = build_tokenizer(corpus, kind="bpe")
    tokenizer.chat_template = template
    return tokenizer


def thinking_turns(seed: int) -> list[str]:
    return [
        f"<think>\nstep {k} of my plan\n</think>\n\n{a}" for k, a in enumerate(expert_turns(seed))
    ]


def play(tokenizer: Any, turns: list[str], sample_unit: str = "auto"):
    engine = ScriptedEngine(tokenizer, turns)
    manager = EnvManager(
        engine,  # type: ignore[arg-type]
        ChatRenderer(tokenizer),
        max_turns=len(turns),
        max_context_tokens=8192,
        sample_unit=sample_unit,  # type: ignore[arg-type]
    )

    async def one():
        return await manager.run(await LocalEnvSource().session(CALC), CALC, 0, Sampling(64))

    return asyncio.run(one()), engine, manager


@pytest.mark.parametrize("template", [STRIPS_THINKING, MARKS_EARLIER_TURNS], ids=["qwen3", "last"])
def test_each_turn_is_a_sample_with_the_engines_exact_tokens(corpus, template, caplog) -> None:
    tokenizer = tokenizer_with(corpus, template)
    turns = thinking_turns(seed=0)
    with caplog.at_level(logging.WARNING):
        trajectory, engine, manager = play(tokenizer, turns)
    assert manager.sample_unit == "turn" and "sample_unit auto" in caplog.text
    assert trajectory.success and not trajectory.failed
    assert len(trajectory.samples) == trajectory.num_turns == len(turns)
    for sample, prompt, output in zip(
        trajectory.samples, engine.prompts, engine.outputs, strict=True
    ):
        assert sample.token_ids == prompt + output  # what the engine saw and wrote, unchanged
        assert sample.response_mask == [0] * len(prompt) + [1] * len(output)
        assert sample.logprobs[len(prompt) :] == [-0.5] * len(output)
    results = [m for m in trajectory.messages if m["role"] == "tool"]
    for k, result in enumerate(results):  # each tool result is a tool turn of the next prompt
        later = tokenizer.decode(engine.prompts[k + 1])
        assert f"<|im_start|>tool\n{result['content']}<|im_end|>" in later
    last_prompt = tokenizer.decode(engine.prompts[-1])
    if template is STRIPS_THINKING:  # history rewritten: earlier thinking is gone
        assert "step 0 of my plan" not in last_prompt and "<think>" not in last_prompt
    else:
        assert last_prompt.count("<|im_start|>assistant|past\n") == len(turns) - 1
    # one row per turn, each credited with the episode's return, counted once per episode
    batch = collate([trajectory], tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == len(turns)
    assert batch["episode_ids"].tolist() == [0] * len(turns)
    assert batch["scores"].tolist() == [pytest.approx(trajectory.episode_reward)] * len(turns)


def test_an_append_only_template_keeps_one_sequence_per_episode(corpus) -> None:
    tokenizer = tokenizer_with(corpus, CHATML_TEMPLATE)
    trajectory, engine, manager = play(tokenizer, thinking_turns(seed=0))
    assert manager.sample_unit == "episode" and not trajectory.samples
    assert trajectory.token_ids[: len(engine.prompts[-1])] == engine.prompts[-1]


def test_per_turn_prompts_show_the_policys_earlier_calls_as_it_wrote_them(corpus) -> None:
    """With per-turn samples each prompt is rendered from the structured messages, so an
    earlier call comes back as the template writes it; it must be the policy's own text, or
    the turn after a call learns from a history the policy never writes."""
    tokenizer = tokenizer_with(corpus, CHATML_TEMPLATE)
    turns = expert_turns(seed=0)
    trajectory, engine, _ = play(tokenizer, turns, sample_unit="turn")
    assert trajectory.success and len(engine.prompts) == len(turns) > 2
    for k, (prompt, output) in enumerate(zip(engine.prompts[1:], engine.outputs, strict=False)):
        assert f"<|im_start|>assistant\n{turns[k]}<|im_end|>" in tokenizer.decode(prompt)
        written = output[:-1]  # the policy's tokens without the end of turn
        assert any(prompt[i : i + len(written)] == written for i in range(len(prompt)))


def test_episode_mode_with_a_rewriting_template_appends_or_names_the_setting(corpus) -> None:
    # thinking dropped from history: the delta of a think-free turn still appends, so an
    # explicit `episode` plays one sequence of the engine's own tokens (not the template's
    # rewritten history)
    tokenizer = tokenizer_with(corpus, STRIPS_THINKING)
    trajectory, engine, _ = play(tokenizer, thinking_turns(seed=0), sample_unit="episode")
    assert not trajectory.samples and trajectory.success
    assert trajectory.token_ids[: len(engine.prompts[-1])] == engine.prompts[-1]
    # a template whose every earlier turn changes cannot be appended to: the episode fails (it
    # is not trained on) and its reason says what to set
    tokenizer = tokenizer_with(corpus, MARKS_EARLIER_TURNS)
    trajectory, _, _ = play(tokenizer, thinking_turns(seed=0), sample_unit="episode")
    assert trajectory.failed and "rollout.sample_unit: turn" in (trajectory.failure or "")


def test_group_baselines_count_episodes_not_turns() -> None:
    import torch

    from trainer.algos.advantages import grpo

    # two episodes of one group: a 3-turn failure (0) and a 1-turn success (1)
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0])
    mask = torch.ones(4, 2)
    group, episodes = torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 0, 1])
    per_episode = grpo(scores, group, mask, episode_ids=episodes)
    assert per_episode[:, 0].tolist() == pytest.approx([-1.0, -1.0, -1.0, 1.0], abs=1e-4)
    per_row = grpo(scores, group, mask)  # rows counted as episodes: the success over-weighted
    assert per_row[3, 0] > 1.5


def test_warm_start_demos_follow_the_template_per_turn(corpus) -> None:
    tokenizer = tokenizer_with(corpus, STRIPS_THINKING)
    renderer = ChatRenderer(tokenizer)
    demo = expert_trajectories([CALC], {}, renderer, episodes=1, max_turns=6)[0]
    assert len(demo.samples) == demo.num_turns >= 2 and not demo.token_ids
    tools = envhub.make(CALC).tools
    turns = [i for i, m in enumerate(demo.messages) if m["role"] == "assistant"]
    for sample, at in zip(demo.samples, turns, strict=True):
        # the prompt is the template's rendering of the transcript before this turn
        assert sample.token_ids[: sample.prompt_length] == renderer.prompt(
            demo.messages[:at], tools
        )
        assert sample.response_mask[sample.prompt_length :] == [1] * (
            len(sample.token_ids) - sample.prompt_length
        )


def train_two_steps(tmp_path: Path, *overrides: str) -> list[dict[str, Any]]:
    """Two RL steps of the tiny quickstart with ``overrides``; every step must have trained."""
    cfg = load_config(
        QUICKSTART,
        [
            *TINY,
            *overrides,
            "train.steps=2",
            "sft.epochs=1",
            "eval.episodes=4",
            f"output_dir={tmp_path / 'run'}",
            VARIED,
        ],
    )
    rows = AgenticPipeline(cfg).fit()
    trained = [row for row in rows if "actor/grad_norm" in row]
    assert len(trained) == 2 and all(row["actor/grad_norm"] > 0 for row in trained)
    return rows


def test_a_qwen3_style_template_trains_two_steps_with_sample_unit_auto(tmp_path: Path) -> None:
    rows = train_two_steps(
        tmp_path, f"model.chat_template={json.dumps(STRIPS_THINKING)}", "rollout.sample_unit=auto"
    )
    assert "eval/success" in rows[-1]


def test_context_windows_bound_each_turns_prompt(corpus) -> None:
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "task"},
        *[
            m
            for k in range(5)
            for m in (
                {"role": "assistant", "content": f"<think>\nidea {k}\n</think>\n\nmove {k}"},
                {"role": "tool", "content": f"result {k}", "tool_call_id": "call_0"},
            )
        ],
    ]
    window = prompt_context(messages, "last_k_turns", 2)
    assert [m["content"] for m in window] == [
        "rules",
        "task",
        *[c for k in (3, 4) for c in (f"<think>\nidea {k}\n</think>\n\nmove {k}", f"result {k}")],
    ]
    stripped = prompt_context(messages, "strip_thinking")
    assert [m["content"] for m in stripped if m["role"] == "assistant"] == [
        f"move {k}" for k in range(5)
    ]
    assert prompt_context(messages) == messages
    # in an episode: every prompt keeps the task and at most the last turn
    tokenizer = tokenizer_with(corpus, CHATML_TEMPLATE)
    engine = ScriptedEngine(tokenizer, thinking_turns(seed=0))
    manager = EnvManager(
        engine,  # type: ignore[arg-type]
        ChatRenderer(tokenizer),
        max_turns=len(engine.turns),
        max_context_tokens=8192,
        context="last_k_turns",
        context_turns=1,
    )

    async def one():
        return await manager.run(await LocalEnvSource().session(CALC), CALC, 0, Sampling(64))

    trajectory = asyncio.run(one())
    assert manager.sample_unit == "turn" and trajectory.success  # auto: a window needs turns
    for prompt in engine.prompts[1:]:
        shown = tokenizer.decode(prompt)
        assert "Solve the maths word problem" in shown and shown.count("<think>") == 1


def test_a_window_with_episode_samples_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="rollout.sample_unit: turn"):
        load_config(QUICKSTART, ["rollout.context=last_k_turns", "rollout.sample_unit=episode"])


def test_sft_files_under_a_rewriting_template_train_per_turn(corpus) -> None:
    tokenizer = tokenizer_with(corpus, MARKS_EARLIER_TURNS)  # every earlier turn re-rendered
    renderer = ChatRenderer(tokenizer)
    demo = expert_trajectories([CALC], {}, renderer, episodes=1, max_turns=6)[0]
    record = from_messages(demo.messages, renderer, tools=envhub.make(CALC).tools)
    assert [s.token_ids for s in record.samples] == [s.token_ids for s in demo.samples]
    assert len(record.samples) == record.num_turns == demo.num_turns


def test_gigpo_anchors_each_turn_on_the_state_it_answered() -> None:
    """``turn_states``: turns that answered the same env messages share a state id (across
    episodes), and each turn's return is the discounted sum of its and the later turns' rewards
    (the final reward on the last)."""
    from trainer.rollout.collate import turn_states
    from trainer.rollout.trajectory import Trajectory

    def episode(replies: list[str], rewards: list[float], final: float = 0.0) -> Trajectory:
        t = Trajectory("test/env", seed=0, group_id=1, final_reward=final)
        t.messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "start"}]
        for i, reward in enumerate(rewards):
            t.messages.append({"role": "assistant", "content": f"move {i}"})
            t.messages.append({"role": "user", "content": replies[i]})
            sample = t.turn_sample([1, 2])
            sample.append_policy([3], [-0.1])
            sample.end_turn(reward)
            t.samples.append(sample)
        return t

    left = episode(["at A", "at B"], [0.0, 1.0], final=0.5)
    right = episode(["at A", "at C"], [0.0, 0.0])
    states, returns = turn_states([left, right], gamma=0.5)
    # turn 0 of both answered the opening; turn 1 of both answered "at A"
    assert states[0] == states[2] and states[1] == states[3] and states[0] != states[1]
    # left: r = [0, 1 + 0.5] -> to go [0 + 0.5 * 1.5, 1.5]; right: [0, 0]
    assert returns == [0.75, 1.5, 0.0, 0.0]


def test_gigpo_needs_turn_samples_and_trains_two_steps(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rollout.sample_unit: turn"):
        load_config(QUICKSTART, [*TINY, "algorithm.advantage_estimator=gigpo"])
    train_two_steps(tmp_path, "algorithm.advantage_estimator=gigpo", "rollout.sample_unit=turn")
