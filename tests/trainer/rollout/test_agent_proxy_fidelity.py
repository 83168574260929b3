"""What the agent proxy trains is what the agent received, and it answers as OpenAI would.

What a user relies on: a reply the agent never got (its client timed out or went away, then the
``openai`` SDK retried) is not trained and does not use a turn; a step's reward goes to the
reply the agent acted on; ``stop`` ends the turn where OpenAI would, and nothing after it is
trained; options the proxy cannot honour faithfully (``tool_choice: required``,
``response_format``, ``top_logprobs``) are refused by name instead of ignored; the SDK does not
retry an error a retry cannot fix; tool-call ids are unique in an episode; log-probs list
the returned text's tokens as text; and a step whose reward training cannot hold (NaN, beyond
float32) fails the episode instead of being trained.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.trainer.rollout.test_agent_proxy_input import CALC, QUESTION, Engine, error_of, serving
from trainer.models import build_tokenizer, env_corpus
from trainer.rollout.trajectory import ChatRenderer
from trainer.strategies.base import GenerationRequest, GenerationResult


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The quickstart's tokenizer kind, learnt on the calculator env (ChatML with tools)."""
    return build_tokenizer(env_corpus(CALC, episodes=12), kind="bpe")


CALL = '<tool_call>{"arguments": {"expression": "%s"}, "name": "calculate"}</tool_call>'


class Scripted(Engine):
    """Answers call ``i`` with ``texts[i]`` (the last one again after the end) and EOS; with
    ``slow`` set, the first generation takes ``slow`` seconds (``cancelled`` says whether it
    was given up)."""

    def __init__(self, tokenizer: Any, texts: list[str], slow: float = 0.0) -> None:
        super().__init__(tokenizer)
        self.tokenizer, self.texts, self.slow = tokenizer, texts, slow
        self.cancelled: list[str] = []
        self.abort_seen = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.prompts.append(list(request.prompt_ids))
        self.started.set()
        call = len(self.prompts) - 1
        try:
            if call == 0 and self.slow:
                await asyncio.sleep(self.slow)
            if self.gate is not None:
                await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        text = self.texts[min(call, len(self.texts) - 1)]
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        ids = ids[: request.max_new_tokens]
        return GenerationResult(request.request_id, ids, [-0.5] * len(ids), "stop")

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self.abort_seen.set()


def generated(renderer: ChatRenderer, row: Any) -> str:
    """The text of a row's policy tokens (what is trained as the policy's)."""
    ids = [i for i, m in zip(row.token_ids, row.response_mask, strict=True) if m]
    return renderer.decode(ids, skip_special_tokens=False)


# --------------------------------------------------------------------------- 1: abandoned calls


def test_a_reply_the_sdk_gave_up_on_is_not_trained_and_its_retry_is(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer)

    async def main() -> None:
        engine = Scripted(tokenizer, ["<answer>99</answer>", "<answer>13</answer>"], slow=1.5)
        async with serving(engine, renderer) as (proxy, episode, _):

            def agent() -> str:
                client = openai.OpenAI(
                    base_url=proxy.base_url, api_key=episode.api_key, timeout=0.5, max_retries=1
                )
                reply = client.chat.completions.create(model="policy", messages=QUESTION)
                return str(reply.choices[0].message.content)

            assert await asyncio.to_thread(agent) == "<answer>13</answer>"
            # the abandoned generation was given up (it cannot come back to be recorded)
            assert len(engine.prompts) == 2 and engine.cancelled == ["g0e0a0/0"]
            assert [generated(renderer, row) for row in episode.rows] == [
                "<answer>13</answer>" + tokenizer.eos_token
            ]
            assert episode.calls == 1  # the abandoned call used no turn of rollout.max_turns

    asyncio.run(main())


def test_an_sdk_retry_of_a_delivered_call_replaces_it(tokenizer: Any) -> None:
    """The reply went out as the client gave up (too late to see the disconnect): the SDK's
    retry, ``x-stainless-retry-count`` > 0 on the same messages, replaces it; a second call
    that is not a retry is a sample of its own."""
    renderer = ChatRenderer(tokenizer)

    async def main() -> None:
        engine = Scripted(tokenizer, ["first", "retried", "again"])
        async with serving(engine, renderer) as (_, episode, client):
            body = {"messages": QUESTION}
            assert (await client.post("/chat/completions", json=body)).is_success
            retry = {"x-stainless-retry-count": "1"}
            answer = await client.post("/chat/completions", json=body, headers=retry)
            assert answer.json()["choices"][0]["message"]["content"] == "retried"
            assert [generated(renderer, r) for r in episode.rows] == ["retried<|im_end|>"]
            assert episode.calls == 1
            assert (await client.post("/chat/completions", json=body)).is_success
            assert len(episode.rows) == 2 and episode.calls == 2

    asyncio.run(main())


def test_a_retried_call_that_a_weight_update_split_leaves_no_version_behind(
    tokenizer: Any,
) -> None:
    """A call whose generation a weight update preempted records each part's version (0 and
    1); the SDK's retry that replaces it takes all of them back, so the episode's versions are
    the retry's alone."""
    renderer = ChatRenderer(tokenizer)

    class Preempted(Scripted):
        async def generate(self, request: GenerationRequest) -> GenerationResult:
            result = await super().generate(request)
            if len(self.prompts) == 1:  # the first call: tokens of versions 0 and then 1
                half = len(result.token_ids) // 2
                versions = [0] * half + [1] * (len(result.token_ids) - half)
                result.extra["token_versions"], result.policy_version = versions, 1
            else:
                result.policy_version = 2
            return result

    async def main() -> None:
        engine = Preempted(tokenizer, ["first answer", "retried"])
        async with serving(engine, renderer) as (_, episode, client):
            body = {"messages": QUESTION}
            assert (await client.post("/chat/completions", json=body)).is_success
            assert episode.trajectory.policy_versions == [0, 1]
            retry = {"x-stainless-retry-count": "1"}
            assert (await client.post("/chat/completions", json=body, headers=retry)).is_success
            assert episode.trajectory.policy_versions == [2]

    asyncio.run(main())


def test_an_sdk_retry_of_an_abandoned_call_takes_back_no_reply_the_agent_received(
    tokenizer: Any,
) -> None:
    """Best-of-n by n calls on the same messages: A is delivered, B's client gives up while it
    generates and the SDK retries it. The retry takes nothing back: A, which the agent holds
    and acts on, stays trained and gets the step's reward."""
    renderer = ChatRenderer(tokenizer)
    texts = ["<answer>A</answer>", "<answer>B</answer>", "<answer>C</answer>"]

    async def main() -> None:
        engine = Scripted(tokenizer, texts)
        async with serving(engine, renderer) as (_, episode, client):
            body = {"messages": QUESTION}
            a = (await client.post("/chat/completions", json=body)).json()["choices"][0]
            engine.gate, engine.started = asyncio.Event(), asyncio.Event()
            b = asyncio.ensure_future(client.post("/chat/completions", json=body))
            await engine.started.wait()  # B is generating
            b.cancel()  # the SDK's timeout: the connection closes
            await asyncio.gather(b, return_exceptions=True)
            await engine.abort_seen.wait()  # the proxy saw the client go and gave B up
            engine.gate = None
            retry = {"x-stainless-retry-count": "1"}
            answer = await client.post("/chat/completions", json=body, headers=retry)
            assert answer.json()["choices"][0]["message"]["content"] == "<answer>C</answer>"
            assert [generated(renderer, r) for r in episode.rows] == [
                "<answer>A</answer><|im_end|>",
                "<answer>C</answer><|im_end|>",
            ]
            step = await client.post("/envhub/step", json={"action": a["message"]})
            assert step.is_success, step.text
            assert [len(row.turn_rewards) for row in episode.rows] == [1, 0]

    asyncio.run(main())


# --------------------------------------------------------------------------- 2: credit


def test_a_steps_reward_goes_to_the_reply_the_agent_acted_on(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer)

    async def main() -> None:
        engine = Scripted(tokenizer, [CALL % "32 * 7 * 9", CALL % "2 * 2", "<answer>4</answer>"])
        async with serving(engine, renderer) as (_, episode, client):
            body = {"messages": QUESTION, "tools": episode.tools}
            kept, dropped = [
                (await client.post("/chat/completions", json=body)).json()["choices"][0]["message"]
                for _ in range(2)
            ]
            step = await client.post("/envhub/step", json={"action": kept})
            assert step.is_success, step.text
            assert [row.turn_rewards for row in episode.rows] == [[0.0], []]
            # the next call extends the conversation the agent kept: the credited row grows
            grown = {**body, "messages": [*QUESTION, kept, *step.json()["messages"]]}
            before = len(episode.rows[0].token_ids)
            assert (await client.post("/chat/completions", json=grown)).is_success
            assert len(episode.rows) == 2 and len(episode.rows[0].token_ids) > before
            assert (
                dropped["tool_calls"][0]["function"]["arguments"]
                != (kept["tool_calls"][0]["function"]["arguments"])
            )

    asyncio.run(main())


def test_a_step_that_is_none_of_several_replies_credits_none_of_them(tokenizer: Any) -> None:
    async def main() -> None:
        engine = Scripted(tokenizer, ["<answer>3</answer>", "<answer>5</answer>"])
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            for _ in range(2):
                assert (
                    await client.post("/chat/completions", json={"messages": QUESTION})
                ).is_success
            step = await client.post("/envhub/step", json={"action": "<answer>4</answer>"})
            assert step.is_success, step.text
            assert [row.turn_rewards for row in episode.rows] == [[], []]
            assert len(episode.trajectory.turn_rewards) == 1  # the return still counts it

    asyncio.run(main())


# --------------------------------------------------------------------------- 3: stop


@pytest.mark.parametrize("stop", ["</answer>", ["\nObservation:", "</answer>"]])
def test_a_stop_string_ends_the_turn_and_nothing_after_it_is_trained(
    tokenizer: Any, stop: Any
) -> None:
    renderer = ChatRenderer(tokenizer)

    async def main() -> None:
        engine = Scripted(tokenizer, ["<answer>13</answer> and then more text after it"])
        async with serving(engine, renderer) as (_, episode, client):
            body = {"messages": QUESTION, "stop": stop, "logprobs": True}
            answer = (await client.post("/chat/completions", json=body)).json()
            choice = answer["choices"][0]
            assert choice["message"]["content"] == "<answer>13"
            assert choice["finish_reason"] == "stop"
            trained = generated(renderer, episode.rows[0])
            assert trained.startswith("<answer>13</answer>") and "then" not in trained
            assert len(choice["token_ids"]) == sum(episode.rows[0].response_mask)
            assert answer["usage"]["completion_tokens"] == len(choice["token_ids"])
            bad = await client.post("/chat/completions", json={**body, "stop": 5})
            assert error_of(bad)[0] == 400 and "stop must be" in error_of(bad)[2]

    asyncio.run(main())


# --------------------------------------------------------------------------- 6: options


def test_tool_choice_none_returns_text_and_unsupported_options_are_refused_by_name(
    tokenizer: Any,
) -> None:
    async def main() -> None:
        engine = Scripted(tokenizer, [CALL % "2 * 2"])
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            body = {"messages": QUESTION, "tools": episode.tools}
            none = await client.post("/chat/completions", json={**body, "tool_choice": "none"})
            message = none.json()["choices"][0]
            assert message["finish_reason"] == "stop" and "tool_calls" not in message["message"]
            assert message["message"]["content"] == CALL % "2 * 2"
            auto = await client.post("/chat/completions", json={**body, "tool_choice": "auto"})
            assert auto.json()["choices"][0]["finish_reason"] == "tool_calls"
            calls = len(engine.prompts)
            for field, value in [
                ("tool_choice", "required"),
                ("tool_choice", {"type": "function", "function": {"name": "calculate"}}),
                ("response_format", {"type": "json_object"}),
                ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
                ("top_logprobs", 2),
            ]:
                refused = await client.post("/chat/completions", json={**body, field: value})
                status, _, text = error_of(refused)
                assert status == 400 and field in text, (field, value, text)
            assert len(engine.prompts) == calls  # refused before the engine ran
            text = {"type": "text"}
            plain = await client.post("/chat/completions", json={**body, "response_format": text})
            assert plain.is_success

    asyncio.run(main())


# --------------------------------------------------------------------------- 7, 8: errors


def test_the_sdk_sees_the_proxys_error_instead_of_retrying_it(tokenizer: Any) -> None:
    class Failing(Engine):
        async def generate(self, request: GenerationRequest) -> GenerationResult:
            self.prompts.append(list(request.prompt_ids))
            raise RuntimeError("CUDA OOM in the engine")

    async def main() -> None:
        engine = Failing(tokenizer)
        async with serving(engine, ChatRenderer(tokenizer)) as (proxy, episode, _):

            def agent() -> tuple[int, str]:
                client = openai.OpenAI(
                    base_url=proxy.base_url, api_key=episode.api_key, max_retries=2
                )
                try:
                    client.chat.completions.create(model="policy", messages=QUESTION)
                except openai.APIStatusError as error:
                    return error.status_code, error.message
                return 200, ""

            status, message = await asyncio.to_thread(agent)
            assert status == 502 and "CUDA OOM" in message, message
            assert len(engine.prompts) == 1

    asyncio.run(main())


def test_deeply_nested_json_is_a_400(tokenizer: Any) -> None:
    async def main() -> None:
        async with serving(Engine(tokenizer), ChatRenderer(tokenizer)) as (_, episode, client):
            deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            answer = await client.post("/chat/completions", content=deep)
            status, _, message = error_of(answer)
            assert status == 400 and "not JSON" in message
            assert answer.headers.get("x-should-retry") == "false"
            assert episode.rows == []

    asyncio.run(main())


# --------------------------------------------------------------------------- 9: ids, log-probs


def test_tool_call_ids_are_unique_and_logprobs_list_the_returned_texts_tokens(
    tokenizer: Any,
) -> None:
    async def main() -> None:
        engine = Scripted(tokenizer, [CALL % "2 * 2", CALL % "3 * 3", "hello world"])
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            body = {"messages": QUESTION, "tools": episode.tools}
            ids = [
                (await client.post("/chat/completions", json=body)).json()["choices"][0]["message"][
                    "tool_calls"
                ][0]["id"]
                for _ in range(2)
            ]
            assert len(set(ids)) == 2, ids
            answer = await client.post("/chat/completions", json={**body, "logprobs": True})
            choice = answer.json()["choices"][0]
            tokens = choice["logprobs"]["content"]
            assert "".join(t["token"] for t in tokens) == choice["message"]["content"]
            assert all(bytes(t["bytes"]).decode() == t["token"] for t in tokens)
            assert all(t["top_logprobs"] == [] for t in tokens)
            # the trained sequence keeps the end-of-turn token the agent is not told about
            assert choice["token_ids"][-1] == tokenizer.eos_token_id
            assert len(tokens) == len(choice["token_ids"]) - 1
            assert json.loads(json.dumps(tokens))  # plain JSON

    asyncio.run(main())


# --------------------------------------------------------------------------- env output


@pytest.mark.parametrize("reward", [float("nan"), 1e39])
def test_an_env_step_with_a_reward_training_cannot_hold_fails_the_episode(
    tokenizer: Any, reward: float
) -> None:
    """A step the agent takes through the proxy is checked like a policy-played one: a reward
    that is not a finite float32 ends the episode as an env failure, never reaching training."""
    from trainer.rollout.proxy_http import ProxyError

    async def main() -> None:
        async with serving(Engine(tokenizer), ChatRenderer(tokenizer)) as (proxy, episode, client):
            assert (await client.post("/chat/completions", json={"messages": QUESTION})).is_success

            async def step(action: str) -> Any:
                return [{"role": "user", "content": "ok"}], reward, False, False, {}

            episode.session.step = step  # type: ignore[method-assign]
            with pytest.raises(ProxyError) as refused:
                await proxy.step(episode, "the answer")
            assert refused.value.status == 502
            t = episode.trajectory
            assert t.failed and "reward" in (t.failure or "") and reward not in t.turn_rewards

    asyncio.run(main())


# --------------------------------------------------------------------------- log-probs as OpenAI's


def byte_level_tokenizer() -> Any:
    """A tiny byte-level BPE tokenizer (as Qwen, Llama 3 and GPT-2 are) with the ChatML template
    of the other tests: a character outside its merges is split over several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    ref = build_tokenizer(env_corpus(CALC, episodes=4), kind="bpe")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(ref.all_special_tokens),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(["hello world the answer is 4 " * 3, "user assistant"], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.eos_token, tokenizer.pad_token = ref.eos_token, ref.pad_token
    others = [t for t in ref.all_special_tokens if t not in (ref.eos_token, ref.pad_token)]
    tokenizer.add_special_tokens({"additional_special_tokens": others})
    tokenizer.chat_template = ref.chat_template
    return tokenizer


def test_logprobs_bytes_join_to_the_content_when_characters_span_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    text = "héllo 😀 日本"

    async def main() -> None:
        engine = Scripted(tokenizer, [text])
        async with serving(engine, ChatRenderer(tokenizer)) as (_, __, client):
            body = {"messages": QUESTION, "logprobs": True}
            choice = (await client.post("/chat/completions", json=body)).json()["choices"][0]
            tokens = choice["logprobs"]["content"]
            assert choice["message"]["content"] == text
            assert len(tokens) == len(choice["token_ids"]) - 1 > len(text)  # split characters
            assert b"".join(bytes(t["bytes"]) for t in tokens).decode() == text
            assert "".join(t["token"] for t in tokens) == text

    asyncio.run(main())


def test_with_a_stop_string_logprobs_list_the_returned_texts_tokens(tokenizer: Any) -> None:
    """OpenAI's content ends before the stop string; so do the listed tokens. The tokens that
    wrote the stop string are trained (the policy ended its turn with them) and counted in
    ``token_ids`` and ``usage``."""

    async def main() -> None:
        engine = Scripted(tokenizer, ["the answer is 4. more text"])
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            body = {"messages": QUESTION, "logprobs": True, "stop": ["is"]}
            answer = (await client.post("/chat/completions", json=body)).json()
            choice = answer["choices"][0]
            tokens = [t["token"] for t in choice["logprobs"]["content"]]
            assert choice["message"]["content"] == "the answer " == "".join(tokens)
            assert len(choice["token_ids"]) == sum(episode.rows[0].response_mask) > len(tokens)
            assert answer["usage"]["completion_tokens"] == len(choice["token_ids"])

    asyncio.run(main())


def test_a_streamed_reply_carries_the_logprobs_of_the_same_reply_unstreamed(
    tokenizer: Any,
) -> None:
    async def main() -> None:
        engine = Scripted(tokenizer, ["hello world"])
        async with serving(engine, ChatRenderer(tokenizer)) as (proxy, episode, _):
            client = openai.AsyncOpenAI(
                base_url=proxy.base_url, api_key=episode.api_key, max_retries=0
            )
            async with client:
                chat = client.chat.completions
                whole = await chat.create(model="policy", messages=QUESTION, logprobs=True)
                stream = await chat.create(
                    model="policy", messages=QUESTION, logprobs=True, stream=True
                )
                chunks = [chunk async for chunk in stream]
            expected = whole.choices[0].logprobs.content
            streamed = [
                token
                for chunk in chunks
                for choice in chunk.choices
                if choice.logprobs is not None
                for token in choice.logprobs.content or []
            ]
            assert expected and streamed == expected

    asyncio.run(main())
