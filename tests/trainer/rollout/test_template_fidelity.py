"""What a multi-turn conversation becomes as training tokens, under chat templates and tokenizers
unlike the default ChatML one: a parser that raises, tool tags that are special tokens, an
end-of-turn token that is not EOS, dict tool arguments, sentencepiece-style tokenizers, templates
that move the system prompt and answers the template rewrites. Each test builds its own tiny
tokenizer (no downloads) and compares with the template's own rendering tokenised whole."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

pytest.importorskip("transformers")

from tokenizers import AddedToken

from trainer.models import build_tokenizer, env_corpus
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.trajectory import ChatRenderer
from trainer.strategies.base import GenerationRequest, GenerationResult

CALC = "tools/calculator-v0"
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 2"}}</tool_call>'


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return env_corpus(CALC, episodes=4)


def with_specials(corpus: list[str], specials: list[str], template: str | None = None) -> Any:
    """A tiny BPE tokenizer with ``specials`` added as special tokens (and ``template``)."""
    tokenizer = build_tokenizer(corpus, kind="bpe")
    if specials:
        added = [AddedToken(t, special=True) for t in specials]
        tokenizer.add_tokens(added, special_tokens=True)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


class Engine:
    """Answers every turn with ``ids(request)``; records the requests."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        return GenerationResult(request.request_id, self.ids, [-0.5] * len(self.ids), "stop")

    async def abort(self, request_id: str) -> None: ...


def play(renderer: ChatRenderer, ids: list[int], turns: int = 1, **options: Any) -> Any:
    engine = Engine(ids)
    manager = EnvManager(engine, renderer, max_turns=turns, max_context_tokens=8192, **options)

    async def one() -> Any:
        session = await LocalEnvSource().session(CALC)
        return await manager.run(session, CALC, 0, Sampling(64))

    return asyncio.run(one()), engine


class RaisingParser:
    """A parser that fails the way a model's odd text made the real ones fail."""

    def parse(self, text: str) -> Any:
        raise TypeError("unhashable type: 'list'")


# ---------------------------------------------------------------- 1: a parser that raises
def test_a_parser_that_raises_is_an_invalid_turn_not_a_crashed_episode(corpus) -> None:
    tokenizer = build_tokenizer(corpus, kind="bpe")
    renderer = ChatRenderer(tokenizer)
    renderer._parser = RaisingParser()  # type: ignore[assignment]
    ids = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    episode, _ = play(renderer, ids)
    assert not episode.failed, episode.failure
    assert episode.num_turns == 1  # the env got the raw text (its own parser reads it)
    assert {"role": "assistant", "content": CALL} in episode.messages


def test_a_parser_that_raises_in_the_proxy_answers_the_text(corpus) -> None:
    from trainer.rollout.proxy import AgentProxy
    from trainer.rollout.proxy_request import ChatRequest
    from trainer.rollout.trajectory import Trajectory

    tokenizer = build_tokenizer(corpus, kind="bpe")
    renderer = ChatRenderer(tokenizer)
    renderer._parser = RaisingParser()  # type: ignore[assignment]
    ids = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    proxy = AgentProxy(Engine(ids), renderer, max_turns=4, max_context_tokens=8192)  # type: ignore[arg-type]

    async def one() -> dict[str, Any]:
        session = await LocalEnvSource().session(CALC)
        messages, info = await session.reset(0)
        episode = proxy.open("k", Trajectory(CALC, 0), session, Sampling(64), messages, info)
        request = ChatRequest(messages=messages, tools=info.get("tools"))
        return await proxy.complete(episode, request)

    reply = asyncio.run(one())
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": CALL}


# ---------------------------------------------------------------- 3: special-token tool tags
def chatml(tag: str) -> str:
    """ChatML that lists tools (so native tools are on) and names the family's ``tag``."""
    return (
        "{%- if tools %}{{- '<|im_start|>system\\n" + tag + " tools: ' }}"
        "{%- for t in tools %}{{- t | tojson }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- for m in messages %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def test_a_tool_call_whose_tags_are_special_tokens_reaches_the_env(corpus) -> None:
    """Hermes-3 marks ``<tool_call>`` special (Mistral ``[TOOL_CALLS]``, Llama ``<|python_tag|>``):
    the call is read from the text with its tags, not from a decode that drops them."""
    tokenizer = with_specials(corpus, ["<tool_call>", "</tool_call>"], chatml("<tool_call>"))
    renderer = ChatRenderer(tokenizer, tool_parser="hermes")
    ids = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "<tool_call>"
    episode, _ = play(renderer, ids)
    assistant = next(m for m in episode.messages if m["role"] == "assistant")
    assert [c["function"]["name"] for c in assistant.get("tool_calls", [])] == ["calculate"]
    assert episode.invalid_actions == 0
    # transcripts for display still skip special tokens
    assert renderer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- 2: end-of-turn is not EOS
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
"""Gemma's turn format: ``eos_token`` is ``<eos>``, a turn ends with ``<end_of_turn>``."""


def whole(tokenizer: Any, messages: list[dict[str, Any]], prompt: bool = True) -> list[int]:
    """The template's own rendering of ``messages``, tokenised in one go."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def gemma(corpus: list[str]) -> Any:
    tokenizer = with_specials(corpus, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], GEMMA)
    tokenizer.eos_token, tokenizer.bos_token = "<eos>", "<bos>"
    return tokenizer


def test_turns_that_end_with_the_templates_end_of_turn_token_are_stopped(corpus) -> None:
    tokenizer = gemma(corpus)
    renderer = ChatRenderer(tokenizer)
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    ids = [*tokenizer.encode("down", add_special_tokens=False), end_of_turn]
    episode, engine = play(renderer, ids, turns=2)
    assert episode.truncated and not episode.failed
    assert episode.token_ids == whole(tokenizer, episode.messages)  # no stray <eos>
    assert all(end_of_turn in request.stop_token_ids for request in engine.requests)
    assert renderer.answer("down") == ids  # SFT teaches the stop the template writes


def test_a_turn_that_stops_on_eos_is_closed_with_the_end_of_turn_token(corpus) -> None:
    """Gemma may stop on ``<eos>`` (a stop token too), which is not how the template closes a
    turn: ``<end_of_turn>`` still follows it, so the sequence is the template's rendering with
    only the sampled ``<eos>`` added, never a turn left without its end-of-turn token."""
    tokenizer = gemma(corpus)
    renderer = ChatRenderer(tokenizer)
    eos = tokenizer.eos_token_id
    episode, _ = play(renderer, [*tokenizer.encode("down", add_special_tokens=False), eos], turns=2)
    policy = zip(episode.token_ids, episode.response_mask, strict=True)
    sampled_eos = {i for i, (t, sampled) in enumerate(policy) if t == eos and sampled}
    shown = [t for i, t in enumerate(episode.token_ids) if i not in sampled_eos]
    assert shown == whole(tokenizer, episode.messages)
    assert len(sampled_eos) == 2 and not renderer.ended([eos])


LLAMA31_IPYTHON = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{%- if message['role'] == 'assistant' and builtin_tools is defined %}{{- '<|eom_id|>' }}"
    "{%- else %}{{- '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3.1's turn format (abridged): with ``builtin_tools`` (ipython mode) an assistant turn
that calls a tool ends with ``<|eom_id|>`` (end of message: a tool result follows), not
``<|eot_id|>``; its generation config lists both, and ``<|end_of_text|>``, as EOS."""


def test_a_llama_turn_that_ends_with_eom_is_stopped_and_not_closed_again(corpus) -> None:
    specials = [*LLAMA_SPECIALS, "<|end_of_text|>", "<|eom_id|>", "<|python_tag|>"]
    tokenizer = with_specials(corpus, specials, LLAMA31_IPYTHON)
    tokenizer.eos_token, tokenizer.bos_token = "<|eot_id|>", "<|begin_of_text|>"
    renderer = ChatRenderer(tokenizer)
    eom = tokenizer.convert_tokens_to_ids("<|eom_id|>")
    call = '<|python_tag|>calculate.call(expression="2 + 2")'
    episode, engine = play(renderer, [*tokenizer.encode(call, add_special_tokens=False), eom], 2)
    text = tokenizer.apply_chat_template(
        episode.messages, add_generation_prompt=True, tokenize=False, builtin_tools=["x"]
    )  # the template's ipython-mode rendering: <|eom_id|>, then the next header
    assert tokenizer.decode(episode.token_ids) == text
    assert episode.token_ids == tokenizer.encode(text, add_special_tokens=False)
    assistant = next(m for m in episode.messages if m["role"] == "assistant")
    assert assistant["content"] == call  # read without its stop token
    assert all(eom in request.stop_token_ids for request in engine.requests)
    assert renderer.ended([eom])


# ---------------------------------------------------------------- 6: tool arguments as a dict
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{{- '</tools><|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's way with tool calls: ``arguments | tojson`` (a dict, as vLLM and HF pass it)."""


def test_earlier_tool_calls_are_shown_as_the_model_wrote_them(corpus) -> None:
    tokenizer = build_tokenizer(corpus, kind="bpe")
    tokenizer.chat_template = QWEN25
    renderer = ChatRenderer(tokenizer, tool_parser="hermes")
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    ids = [*tokenizer.encode(call, add_special_tokens=False), tokenizer.eos_token_id]
    episode, engine = play(renderer, ids, turns=2, context="last_k_turns")
    assert episode.samples  # one sample per turn
    shown = tokenizer.decode(engine.requests[1].prompt_ids)
    assert '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 2"}}\n' in shown
    arguments = episode.messages[2]["tool_calls"][0]["function"]["arguments"]
    assert arguments == '{"expression": "2 + 2"}'  # the transcript is not rewritten


# ---------------------------------------------------------------- 8: thinking strip, linear
@pytest.mark.timeout(20)
def test_stripping_thinking_is_linear_in_a_degenerate_turn() -> None:
    """A turn repeating ``<think>`` with no closing tag: the old regex took minutes on this."""
    from trainer.rollout.env_manager import prompt_context

    degenerate = "<think>" * 100_000 + "no close"
    turns = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": degenerate},
        {"role": "assistant", "content": "<think>a</think>\n\n<think> b <x> </think> c"},
    ]
    shown = prompt_context(turns, "strip_thinking")
    assert shown[1]["content"] == degenerate  # nothing to strip without a closing tag
    assert shown[2]["content"] == "c"
    assert turns[2]["content"].startswith("<think>")  # the transcript is untouched


@pytest.mark.parametrize(
    ("content", "shown"),
    [  # the generation prompt pre-filled <think> (DeepSeek-R1, Qwen3-Thinking-2507)
        ("plan <tool_call>{}</tool_call>\n</think>\n\nIt is 4.", "It is 4."),
        ("plan </think> It is 4. <think>again</think>\nDone.", "It is 4. Done."),
        ("It is 4.", "It is 4."),  # no </think>: unchanged
        ("It is 4. <think>unclosed", "It is 4. <think>unclosed"),
        ("<think>a</think>\n\nIt is 4, not </think>.", "It is 4, not </think>."),  # stray
    ],
    ids=["prefilled", "prefilled-then-block", "plain", "unclosed", "stray-close-later"],
)
def test_stripping_thinking_drops_reasoning_the_generation_prompt_opened(content, shown) -> None:
    from trainer.rollout.env_manager import prompt_context

    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": content}]
    assert prompt_context(turns, "strip_thinking")[1]["content"] == shown


def test_a_call_in_reasoning_the_generation_prompt_opened_is_not_read(corpus) -> None:
    tokenizer = build_tokenizer(corpus, kind="bpe")
    tokenizer.chat_template = QWEN25
    renderer = ChatRenderer(tokenizer, tool_parser="hermes")
    tools = [{"type": "function", "function": {"name": "calculate", "parameters": {}}}]
    thought = f"Maybe {CALL}? No.\n</think>\n\nIt is 4."
    turn = renderer.read_turn(tokenizer.encode(thought, add_special_tokens=False), tools)
    assert not turn.tool_calls and turn.error is None
    called = f"plan</think>\n{CALL}"
    turn = renderer.read_turn(tokenizer.encode(called, add_special_tokens=False), tools)
    assert [call["function"]["name"] for call in turn.message()["tool_calls"]] == ["calculate"]


# ---------------------------------------------------------------- 5: system prompt moves
MISTRAL_ID_CHECK = (
    '{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}'
)
MISTRAL = (
    '{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}'
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    '{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}'
    "{{- bos_token }}{%- for message in loop_messages %}"
    '{%- if message["role"] == "user" %}'
    "{%- if tools is not none and (message == user_messages[-1]) %}"
    '{{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}'
    '{{- "][/AVAILABLE_TOOLS]" }}{%- endif %}'
    "{%- if loop.last and system_message is defined %}"
    '{{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}'
    '{%- else %}{{- "[INST] " + message["content"] + "[/INST]" }}{%- endif %}'
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}"
    '{{- "[TOOL_CALLS] [" }}{%- for c in message.tool_calls %}'
    "{%- if not c.id is defined or c.id|length != 9 %}" + MISTRAL_ID_CHECK + "{%- endif %}"
    '{{- c.function | tojson }}{%- endfor %}{{- "]" + eos_token }}'
    '{%- elif message["role"] == "assistant" %}{{- " " + message["content"]|trim + eos_token}}'
    '{%- elif message["role"] == "tool" %}'
    "{%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}"
    + MISTRAL_ID_CHECK
    + "{%- endif %}"
    '{{- \'[TOOL_RESULTS] {"content": \' + message.content|string + "}[/TOOL_RESULTS]" }}'
    "{%- endif %}{%- endfor %}"
)
"""Mistral v0.3's way (abridged): the system prompt and the tools go with the *last* user turn,
and a tool call's id, or a tool answer's ``tool_call_id``, that is not 9 characters long is
refused (as Mistral's API refuses one that is not 9 letters and digits)."""
MISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"]
MISTRAL_SPECIALS += ["[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


def mistral(corpus: list[str]) -> Any:
    tokenizer = with_specials(corpus, MISTRAL_SPECIALS, MISTRAL)
    tokenizer.eos_token, tokenizer.bos_token = "</s>", "<s>"
    return tokenizer


def test_a_template_that_moves_the_system_prompt_trains_each_turn_on_its_own(corpus) -> None:
    tokenizer = mistral(corpus)
    renderer = ChatRenderer(tokenizer, tool_parser="mistral")
    assert not renderer.append_only
    ids = [*tokenizer.encode(" I think it is 4", add_special_tokens=False), tokenizer.eos_token_id]
    episode, engine = play(renderer, ids, turns=2)
    assert not episode.failed and len(episode.samples) == 2
    tools = episode.info["tools"]
    text = tokenizer.apply_chat_template(
        episode.messages[:4], tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert engine.requests[1].prompt_ids == tokenizer.encode(text, add_special_tokens=False)


def test_a_mistral_tool_call_and_its_answer_render_back_through_its_template(corpus) -> None:
    """The calls the parser reads and the env answers carry ids Mistral's template takes (9
    letters and digits), so the turn after a tool call renders."""
    tokenizer = mistral(corpus)
    renderer = ChatRenderer(tokenizer, tool_parser="mistral")
    call = '[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "2 + 2"}}]'
    ids = [*tokenizer.encode(call, add_special_tokens=False), tokenizer.eos_token_id]
    episode, engine = play(renderer, ids, turns=2)
    assert not episode.failed, episode.failure
    assert len(engine.requests) == 2
    calls = [c for m in episode.messages for c in m.get("tool_calls") or []]
    answers = [m["tool_call_id"] for m in episode.messages if m["role"] == "tool"]
    assert calls and [c["id"] for c in calls] == answers
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in answers)


def test_a_template_that_cannot_grow_fails_the_episode_instead_of_raising(corpus) -> None:
    tokenizer = mistral(corpus)
    renderer = ChatRenderer(tokenizer, tool_parser="mistral")
    ids = [*tokenizer.encode(" I think it is 4", add_special_tokens=False), tokenizer.eos_token_id]
    episode, _ = play(renderer, ids, turns=2, sample_unit="episode")
    assert episode.failed and "rollout.sample_unit: turn" in (episode.failure or "")


# ---------------------------------------------------------------- 4: sentencepiece Metaspace
def metaspace_tokenizer() -> Any:
    """A Mistral-v0.3 / Llama-2-style tokenizer.json: ``Metaspace(prepend_scheme="first")``
    puts ``▁`` before the first piece of every encode call."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trainer.models import CHATML_TEMPLATE

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = ["user assistant Your first move? You moved down. Next? down right \n"] * 50
    backend.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<s>", unk_token="<unk>"
    )
    tokenizer.pad_token = "<unk>"
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def test_appended_turns_equal_the_whole_rendering_on_a_metaspace_tokenizer() -> None:
    tokenizer = metaspace_tokenizer()
    renderer = ChatRenderer(tokenizer)
    conversation = [
        {"role": "user", "content": "Your first move?"},
        {"role": "assistant", "content": "down"},
        {"role": "user", "content": "You moved down. Next?"},
    ]
    ids = renderer.prompt(conversation[:1]) + renderer.answer("down")
    ids += renderer.continuation(conversation[2:], stopped_on_eos=True)
    assert ids == whole(tokenizer, conversation)


# ---------------------------------------------------------------- 7: answers as the template
LLAMA31 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN3 = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.last %}{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') }}"
    "{{- '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.mark.parametrize(
    ("family", "specials", "eos", "bos", "content"),
    [
        ("mistral", MISTRAL_SPECIALS, "</s>", "<s>", "down"),
        ("llama31", LLAMA_SPECIALS, "<|eot_id|>", "<|begin_of_text|>", "down\n"),
        ("qwen3", [], "<|im_end|>", None, "down"),
    ],
)
def test_an_sft_answer_is_the_assistant_turn_the_template_writes(
    corpus, family: str, specials: list[str], eos: str, bos: str | None, content: str
) -> None:
    template = {"mistral": MISTRAL, "llama31": LLAMA31, "qwen3": QWEN3}[family]
    tokenizer = with_specials(corpus, specials, template)
    tokenizer.eos_token = eos
    if bos:
        tokenizer.bos_token = bos
    renderer = ChatRenderer(tokenizer)
    conversation = [
        {"role": "user", "content": "Which move?"},
        {"role": "assistant", "content": content},
    ]
    trained = renderer.prompt(conversation[:1]) + renderer.answer(content)
    rendered = whole(tokenizer, conversation, prompt=False)
    end = rendered.index(renderer.end_of_turn_id, len(renderer.prompt(conversation[:1])))
    assert trained == rendered[: end + 1]


def test_a_renderer_whose_appended_turns_differ_says_so_when_built(
    corpus, caplog, monkeypatch
) -> None:
    """Appending that does not give the whole rendering's tokens (here: answers with the
    sentencepiece ``▁`` the old encoding added) is said when the renderer is built."""
    tokenizer = build_tokenizer(corpus, kind="bpe")
    with caplog.at_level("WARNING", logger="trainer.rollout.trajectory"):
        ChatRenderer(tokenizer)
        assert not caplog.records
        monkeypatch.setattr(ChatRenderer, "answer", lambda self, c: self.encode(" " + c))
        ChatRenderer(tokenizer)
    assert "tokenised whole" in caplog.text
