"""Native tool calling in rollouts: env tool schemas rendered by the chat template
(``apply_chat_template(..., tools=...)``), assistant turns kept as structured ``tool_calls``,
tool results as ``tool`` messages, and the trained tokens exactly the engine's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("transformers")

import envhub
from trainer.config import load_config
from trainer.errors import ConfigError, TrainerError
from trainer.models import build_tokenizer, env_corpus
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.trajectory import ChatRenderer
from trainer.sft import expert_trajectories, from_messages
from trainer.strategies.base import GenerationRequest, GenerationResult

CALC = "tools/calculator-v0"
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML that ignores ``tools`` (the template of many base models)."""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The quickstart's tokenizer kind, learnt on the calculator env; ChatML with tools."""
    return build_tokenizer(env_corpus(CALC, episodes=12), kind="bpe")


class ScriptedEngine:
    """Answers each turn of an episode with the next of ``turns`` (text, encoded with EOS)."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer, self.turns = tokenizer, turns
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.prompts.append(list(request.prompt_ids))
        text = self.turns[len(self.outputs) % len(self.turns)]
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        self.outputs.append(ids)
        return GenerationResult(request.request_id, ids, [-0.5] * len(ids), "stop")

    async def abort(self, request_id: str) -> None: ...

    def update_weights(self, weights: Any) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


def play(tokenizer: Any, turns: list[str], renderer: ChatRenderer | None = None, seed: int = 0):
    engine = ScriptedEngine(tokenizer, turns)
    manager = EnvManager(
        engine,  # type: ignore[arg-type]
        renderer or ChatRenderer(tokenizer),
        max_turns=len(turns),
        max_context_tokens=4096,
    )

    async def one():
        source = LocalEnvSource()
        return await manager.run(await source.session(CALC), CALC, seed, Sampling(64))

    return asyncio.run(one()), engine


def expert_turns(seed: int) -> list[str]:
    env = envhub.make(CALC)
    env.reset(seed=seed)
    turns, done = [], False
    while not done:
        action = env.expert_action()
        turns.append(action)
        _, _, terminated, truncated, _ = env.step(action)
        done = terminated or truncated
    return turns


def test_tools_reach_the_template_and_calls_become_structured_messages(tokenizer) -> None:
    turns = expert_turns(seed=0)
    trajectory, engine = play(tokenizer, turns)
    assert trajectory.success and not trajectory.failed
    prompt = tokenizer.decode(engine.prompts[0])
    assert "<tools>" in prompt and '"name": "calculate"' in prompt  # the template's tool block
    assistants = [m for m in trajectory.messages if m["role"] == "assistant"]
    tool_results = [m for m in trajectory.messages if m["role"] == "tool"]
    calls = [a["tool_calls"][0] for a in assistants if "tool_calls" in a]
    assert len(calls) == len(turns) - 1 == len(tool_results)  # every turn but the answer calls
    for call, result, text in zip(calls, tool_results, turns, strict=False):
        assert call["function"]["name"] == "calculate"
        expected = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert json.loads(call["function"]["arguments"]) == expected["arguments"]
        assert result["tool_call_id"] == call["id"]
    assert "tool_calls" not in assistants[-1] and assistants[-1]["content"] == turns[-1]


def test_trained_tokens_are_the_engine_tokens_and_tool_results_are_context(tokenizer) -> None:
    trajectory, engine = play(tokenizer, expert_turns(seed=1))
    # every prompt the engine saw is a prefix of the trained sequence, and the generated ids
    # follow it unchanged, marked as policy tokens
    for prompt, output in zip(engine.prompts, engine.outputs, strict=True):
        n = len(prompt)
        assert trajectory.token_ids[:n] == prompt
        assert trajectory.token_ids[n : n + len(output)] == output
        assert trajectory.response_mask[n : n + len(output)] == [1] * len(output)
    assert sum(trajectory.response_mask) == sum(len(o) for o in engine.outputs)
    # a tool result arrives as a `tool` turn of the template, in context (mask 0) tokens
    second = engine.prompts[1]
    after_first = len(engine.prompts[0]) + len(engine.outputs[0])
    glue = tokenizer.decode(second[after_first:])
    result = next(m for m in trajectory.messages if m["role"] == "tool")
    assert f"<|im_start|>tool\n{result['content']}<|im_end|>" in glue
    assert trajectory.response_mask[after_first : len(second)] == [0] * (len(second) - after_first)


def test_an_env_that_reads_structured_actions_gets_the_assistant_message(tokenizer) -> None:
    """The calculator sets ``structured_actions``: each call reaches it as data, with the id its
    tool message answers; a turn without calls is text."""
    received: list[Any] = []

    class Spy:
        def __init__(self, env: Any) -> None:
            self.env = env

        def __getattr__(self, name: str) -> Any:
            return getattr(self.env, name)

        def step(self, action: Any) -> Any:
            received.append(action)
            return self.env.step(action)

    turns = expert_turns(seed=2)
    engine = ScriptedEngine(tokenizer, turns)
    manager = EnvManager(
        engine, ChatRenderer(tokenizer), max_turns=len(turns), max_context_tokens=4096
    )  # type: ignore[arg-type]
    source = LocalEnvSource(make=lambda env_id, **kwargs: Spy(envhub.make(env_id, **kwargs)))

    async def one():
        return await manager.run(await source.session(CALC), CALC, 2, Sampling(64))

    trajectory = asyncio.run(one())
    assert trajectory.success and len(received) == len(turns)
    assert all(isinstance(a, dict) and a["tool_calls"] for a in received[:-1])
    assert received[-1] == turns[-1]  # the answer: plain text
    answered = [m["tool_call_id"] for m in trajectory.messages if m["role"] == "tool"]
    assert answered == [a["tool_calls"][0]["id"] for a in received[:-1]]


def test_malformed_and_unknown_calls_are_env_feedback_not_errors(tokenizer) -> None:
    bad = [
        '<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>',
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
        "<tool_call>" + json.dumps({"name": "calculate", "arguments": {"x": "1" * 1_000}}),
    ]
    trajectory, _ = play(tokenizer, bad)
    assert not trajectory.failed and trajectory.invalid_actions == 3
    feedback = [m["content"] for m in trajectory.messages if m["role"] == "user"][1:]
    assert "not valid JSON" in feedback[0] and "no tool named 'launch_rockets'" in feedback[1]
    assistants = [m for m in trajectory.messages if m["role"] == "assistant"]
    assert "tool_calls" not in assistants[0]  # unreadable: kept as text, the env got the raw text
    assert assistants[1]["tool_calls"][0]["function"]["name"] == "launch_rockets"  # as written
    assert sum(trajectory.turn_rewards) < 0  # the invalid-action penalty reached the rewards


def test_a_call_the_env_refused_is_answered_not_run_as_eval_and_the_proxy_answer_it(
    tokenizer,
) -> None:
    from envhub.model_agent import NOT_RUN

    turns = [
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
        *expert_turns(0),
    ]
    trajectory, engine = play(tokenizer, turns)
    calls = [i for i, m in enumerate(trajectory.messages) if m.get("tool_calls")]
    refused = trajectory.messages[calls[0] : calls[0] + 3]
    call_id = refused[0]["tool_calls"][0]["id"]
    assert refused[1] == {"role": "tool", "tool_call_id": call_id, "content": NOT_RUN}
    assert refused[2]["role"] == "user"
    assert "no tool named 'launch_rockets'" in refused[2]["content"]
    for i in calls:  # every call id answered right after its message, as strict APIs require
        ids = [c["id"] for c in trajectory.messages[i]["tool_calls"]]
        after = trajectory.messages[i + 1 : i + 1 + len(ids)]
        assert [m.get("tool_call_id") for m in after] == ids
    # the policy's next prompt shows the answer it was given (trained as context, as rendered)
    assert NOT_RUN in tokenizer.decode(engine.prompts[1])


def test_a_template_without_tools_keeps_the_text_protocol(tokenizer) -> None:
    tokenizer.chat_template, saved = PLAIN_TEMPLATE, tokenizer.chat_template
    try:
        renderer = ChatRenderer(tokenizer)  # auto: this template renders no tools -> none
        assert not renderer.native_tools and renderer.tool_parser_name == "none"
        trajectory, engine = play(tokenizer, expert_turns(seed=0), renderer)
        assert "<tools>" not in tokenizer.decode(engine.prompts[0])
        assert all("tool_calls" not in m for m in trajectory.messages)
        assert trajectory.success  # the env reads the raw text calls as before
        with pytest.raises(ValueError, match="model.chat_template"):
            ChatRenderer(tokenizer, tool_parser="hermes")
    finally:
        tokenizer.chat_template = saved


def test_parser_none_turns_native_tools_off(tokenizer) -> None:
    renderer = ChatRenderer(tokenizer, tool_parser="none")
    trajectory, engine = play(tokenizer, expert_turns(seed=0), renderer)
    assert "<tools>" not in tokenizer.decode(engine.prompts[0]) and trajectory.success
    assert all("tool_calls" not in m for m in trajectory.messages)


def test_an_unknown_parser_name_is_a_config_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'pythonic'"):
        load_config("examples/quickstart.yaml", ["rollout.tool_parser=pythonik"])


def test_warm_start_demos_render_tools_like_rollouts(tokenizer) -> None:
    renderer = ChatRenderer(tokenizer)
    demo = expert_trajectories([CALC], {}, renderer, episodes=1, max_turns=6)[0]
    rollout, _ = play(tokenizer, expert_turns(seed=demo.seed), renderer, seed=demo.seed)
    assert demo.token_ids[: demo.prompt_length] == rollout.token_ids[: rollout.prompt_length]
    assert [m for m in demo.messages if m["role"] == "assistant"] == [
        m for m in rollout.messages if m["role"] == "assistant"
    ]
    # a JSONL record with tools and structured tool calls trains the same tokens
    record = from_messages(demo.messages, renderer, tools=envhub.make(CALC).tools)
    assert record.token_ids == demo.token_ids


def test_a_run_of_ever_new_tool_sets_keeps_a_bounded_cache(tokenizer) -> None:
    """Each tool set's base rendering is cached; agents that describe their tools per episode
    bring a new set every time, and the cache must not grow for the whole run."""
    renderer = ChatRenderer(tokenizer)
    assert renderer.native_tools
    for episode in range(3 * ChatRenderer.max_tool_sets):
        tool = {"type": "function", "function": {"name": f"tool_{episode}", "parameters": {}}}
        renderer.prompt([{"role": "user", "content": "hi"}], tools=[tool])
    assert len(renderer._bases) <= ChatRenderer.max_tool_sets


def test_tool_demos_written_to_jsonl_load_back_as_the_same_tokens(tokenizer, tmp_path) -> None:
    """``sft_demos.jsonl`` (``write_jsonl``) keeps the tool schemas its calls were shown with."""
    from trainer.sft import load_jsonl, write_jsonl

    renderer = ChatRenderer(tokenizer)
    demos = expert_trajectories([CALC], {}, renderer, episodes=2, max_turns=6)
    again = load_jsonl(write_jsonl(demos, tmp_path / "demos.jsonl"), renderer)
    assert [t.token_ids for t in again] == [t.token_ids for t in demos]


def test_a_record_calling_a_tool_it_does_not_declare_is_refused_naming_it(
    tokenizer, tmp_path
) -> None:
    from trainer.sft import load_jsonl

    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    other = {"type": "function", "function": {"name": "multiply", "parameters": {}}}
    path = tmp_path / "calls.jsonl"
    for record in ({"messages": messages}, {"messages": messages, "tools": [other]}):
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(TrainerError) as refused:
            load_jsonl(path, ChatRenderer(tokenizer))
        assert str(refused.value).startswith(f"{path}:1: messages[1].tool_calls[0] calls 'add'")
        assert '"tools"' in str(refused.value)
