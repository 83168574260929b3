"""What the agent proxy (``trainer.rollout.proxy``) does with requests that are wrong, late,
hostile or huge.

What a user relies on: a request the proxy refuses is refused before anything happens (the
engine never ran, the episode's recorded tokens are unchanged) with an OpenAI-style 4xx that
names the fix; a model call or env step that finishes after its episode ended changes nothing
in the trajectory the scheduler already has; and no client can hold the server's memory,
connections or shutdown hostage.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from trainer.config import load_config
from trainer.models import build_tokenizer, env_corpus
from trainer.rollout.env_manager import LocalEnvSource, Sampling
from trainer.rollout.proxy import AgentProxy
from trainer.rollout.proxy_episode import ProxyEpisode
from trainer.rollout.proxy_http import ServerLimits
from trainer.rollout.rollouts import Rollouts
from trainer.rollout.trajectory import ChatRenderer, Trajectory
from trainer.strategies.base import GenerationRequest, GenerationResult

CALC = "tools/calculator-v0"
HANG_GUARD_S = 60  # only stops a hung test; nothing here asserts on time
QUESTION = [{"role": "user", "content": "what is 2+2"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The quickstart's tokenizer kind, learnt on the calculator env (ChatML with tools)."""
    return build_tokenizer(env_corpus(CALC, episodes=12), kind="bpe")


class Engine:
    """Answers every prompt with ``text`` and EOS; remembers prompts and aborts. With ``gate``
    set, each generation waits for it (``started`` says one is waiting)."""

    def __init__(self, tokenizer: Any, text: str = "the answer", eos: bool = True) -> None:
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.ids += [tokenizer.eos_token_id] if eos else []
        self.prompts: list[list[int]] = []
        self.aborted: list[str] = []
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.prompts.append(list(request.prompt_ids))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        ids = self.ids[: request.max_new_tokens]
        return GenerationResult(request.request_id, ids, [-0.5] * len(ids), "stop")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@contextlib.asynccontextmanager
async def serving(
    engine: Any, renderer: ChatRenderer, **kwargs: Any
) -> AsyncIterator[tuple[AgentProxy, ProxyEpisode, Any]]:
    """A proxy serving one open calculator episode, and an HTTP client holding its key."""
    kwargs = {"max_turns": 8, "max_context_tokens": 4096, **kwargs}
    proxy = AgentProxy(engine, renderer, **kwargs)
    await proxy.start()
    session = await LocalEnvSource().session(CALC)
    messages, info = await session.reset(1)
    episode = proxy.open("g0e0a0", Trajectory(CALC, 1), session, Sampling(32), messages, info)
    headers = {"Authorization": f"Bearer {episode.api_key}"}
    client = httpx.AsyncClient(base_url=proxy.base_url, headers=headers, timeout=HANG_GUARD_S)
    try:
        yield proxy, episode, client
    finally:
        await client.aclose()
        await session.close()
        await asyncio.wait_for(proxy.aclose(), HANG_GUARD_S)


def recorded(episode: ProxyEpisode) -> Any:
    """Everything the episode has recorded (rows and trajectory), as plain values."""
    t = episode.trajectory
    rows = [(list(r.token_ids), list(r.response_mask), list(r.turn_rewards)) for r in episode.rows]
    return rows, list(t.token_ids), list(t.turn_rewards), t.truncated, t.failed, t.failure


def error_of(response: Any) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["type"], error["message"]


# --------------------------------------------------------------------------- H1: checked first

BAD_BODIES: dict[str, tuple[Any, str]] = {
    "max_tokens text": ({"max_tokens": "abc"}, "max_tokens must be a positive integer"),
    "max_tokens NaN": (
        b'{"messages": [{"role": "user", "content": "q"}], "max_tokens": NaN}',
        "max_tokens must be a positive integer",
    ),
    "max_tokens negative": ({"max_tokens": -5}, "max_tokens must be a positive integer (got -5)"),
    "max_completion_tokens 0": ({"max_completion_tokens": 0}, "max_completion_tokens must be"),
    "n text": ({"n": "two"}, "n must be an integer"),
    "model number": ({"model": 5}, "model must be a string"),
    "content number": ({"messages": [{"role": "user", "content": 123}]}, "content must be text"),
    "image part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0] is a 'image_url' part; the training proxy takes text parts only",
    ),
    "lone surrogate": (
        b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}',
        "messages[0].content is not valid Unicode",
    ),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    "tool_calls number": (
        {"messages": [*QUESTION, {"role": "assistant", "content": "", "tool_calls": 5}]},
        "messages[1].tool_calls must be a list",
    ),
    "tool call without function": (
        {"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"function": "f"}]}]},
        "messages[1].tool_calls[0].function must be an object",
    ),
    "tools text": ({"tools": "abc"}, "tools must be a list of function tools"),
    "tool without a name": (
        {"tools": [{"type": "function", "function": {"name": 5}}]},
        "tools[0].function.name must be a string",
    ),
    "stream_options text": (
        {"stream": True, "stream_options": "yes"},
        "stream_options must be an object",
    ),
    "logprobs text": ({"logprobs": "yes"}, "logprobs must be true or false"),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_a_bad_request_is_a_400_that_names_the_field_and_records_nothing(
    tokenizer: Any, name: str
) -> None:
    fields, message = BAD_BODIES[name]
    if isinstance(fields, bytes):  # JSON that json.dumps will not write (NaN, a lone surrogate)
        raw = fields
    else:
        raw = json.dumps({"messages": QUESTION, **fields}).encode()

    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            before = recorded(episode)
            answer = await client.post("/chat/completions", content=raw)
            assert error_of(answer)[:2] == (400, "invalid_request_error"), answer.text
            assert message in error_of(answer)[2]
            assert engine.prompts == [] and recorded(episode) == before
            assert not episode.ended.is_set()  # the agent may correct its call
            assert (await client.post("/chat/completions", json={"messages": QUESTION})).is_success

    asyncio.run(main())


def test_a_refused_call_leaves_the_history_of_the_next_call_intact(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer)

    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, renderer) as (_, episode, client):
            first = await client.post("/chat/completions", json={"messages": QUESTION})
            reply = first.json()["choices"][0]["message"]
            row = list(episode.rows[0].token_ids)
            image = [{"type": "image_url", "image_url": {"url": "x"}}]
            other = {"messages": [{"role": "user", "content": image}]}
            assert (await client.post("/chat/completions", json=other)).status_code == 400
            grown = [*QUESTION, reply, {"role": "user", "content": "and 3+3?"}]
            assert (await client.post("/chat/completions", json={"messages": grown})).is_success
            # the third call extends the first: generated after the whole history, one row
            assert len(episode.rows) == 1 and engine.prompts[-1][: len(row)] == row

    asyncio.run(main())


def test_a_template_that_refuses_the_messages_is_a_400_and_records_nothing(
    tokenizer: Any,
) -> None:
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% if messages[0]['role'] == 'assistant' %}"
        "{{ raise_exception('a conversation starts with a user or system message') }}"
        "{% endif %}" + tokenizer.chat_template
    )

    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, ChatRenderer(strict)) as (proxy, episode, client):
            body = {"messages": [{"role": "assistant", "content": "hi"}]}
            answer = await client.post("/chat/completions", json=body)
            status, _, message = error_of(answer)
            assert status == 400 and "the chat template cannot render these messages" in message
            assert "starts with a user or system message" in message
            assert engine.prompts == [] and episode.rows == []
            proxy.close(episode)
            t = episode.finish()
            assert t.failed and t.failure == "the agent made no model call"

    asyncio.run(main())


def test_an_episode_whose_calls_sampled_no_token_is_failed(tokenizer: Any) -> None:
    async def main() -> None:
        engine = Engine(tokenizer, text="", eos=False)  # zero tokens sampled
        async with serving(engine, ChatRenderer(tokenizer)) as (proxy, episode, client):
            assert (await client.post("/chat/completions", json={"messages": QUESTION})).is_success
            proxy.close(episode)
            t = episode.finish()
            assert t.failed and "no model call sampled a token" in (t.failure or "")
            assert t.token_ids == [] and t.samples == []

    asyncio.run(main())


# --------------------------------------------------------------------------- H2: late calls


def test_a_call_still_generating_when_the_episode_ends_is_aborted_and_changes_nothing(
    tokenizer: Any,
) -> None:
    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, ChatRenderer(tokenizer)) as (proxy, episode, client):
            first = await client.post("/chat/completions", json={"messages": QUESTION})
            reply = first.json()["choices"][0]["message"]
            grown = [*QUESTION, reply, {"role": "user", "content": "and 3+3?"}]
            engine.gate, engine.started = asyncio.Event(), asyncio.Event()
            late = asyncio.ensure_future(client.post("/chat/completions", json={"messages": grown}))
            await engine.started.wait()  # the second call is generating
            proxy.close(episode)  # the agent returned: what AgentRunner.run does
            handed = episode.finish()
            snapshot = (recorded(episode), list(handed.policy_versions), len(handed.messages))
            engine.gate.set()  # an engine that ignores the abort answers anyway
            answer = await late
            assert engine.aborted == ["g0e0a0/1"]
            assert error_of(answer)[0] == 410 and "has ended" in error_of(answer)[2]
            assert (recorded(episode), list(handed.policy_versions), len(handed.messages)) == (
                snapshot
            )
            assert not handed.failed and len(handed.token_ids) == len(episode.rows[0].token_ids)

    asyncio.run(main())


def test_a_step_still_running_when_the_episode_ends_changes_nothing(tokenizer: Any) -> None:
    async def main() -> None:
        async with serving(Engine(tokenizer), ChatRenderer(tokenizer)) as (proxy, episode, client):
            await client.post("/chat/completions", json={"messages": QUESTION})
            gate, stepping = asyncio.Event(), asyncio.Event()
            step = episode.session.step

            async def slow_step(action: Any) -> Any:
                stepping.set()
                await gate.wait()
                return await step(action)

            episode.session.step = slow_step  # type: ignore[method-assign]
            late = asyncio.ensure_future(client.post("/envhub/step", json={"action": "2+2=4"}))
            await stepping.wait()
            proxy.close(episode)
            handed = episode.finish()
            snapshot = (recorded(episode), list(handed.turn_rewards), len(handed.messages))
            gate.set()
            answer = await late
            assert error_of(answer)[0] == 410
            assert (recorded(episode), list(handed.turn_rewards), len(handed.messages)) == snapshot

    asyncio.run(main())


# --------------------------------------------------------------------------- M1, M2: the env


def test_a_tool_call_without_an_id_steps_the_env_once_and_is_recorded(tokenizer: Any) -> None:
    async def main() -> None:
        async with serving(Engine(tokenizer), ChatRenderer(tokenizer)) as (_, episode, client):
            tool = episode.tools[0]["function"] if episode.tools else {}
            argument = next(iter(tool["parameters"]["properties"]))
            steps: list[Any] = []
            step = episode.session.step

            async def counting(action: Any) -> Any:
                steps.append(action)
                return await step(action)

            episode.session.step = counting  # type: ignore[method-assign]
            await client.post("/chat/completions", json={"messages": QUESTION})
            call = {"function": {"name": tool["name"], "arguments": json.dumps({argument: "2+2"})}}
            action = {"role": "assistant", "content": "", "tool_calls": [call]}
            answer = await client.post("/envhub/step", json={"action": action})
            assert answer.status_code == 200, answer.text
            tool_messages = [m for m in answer.json()["messages"] if m["role"] == "tool"]
            assert len(steps) == 1 and len(episode.trajectory.turn_rewards) == 1
            assert tool_messages and all(m.get("tool_call_id") for m in tool_messages)

    asyncio.run(main())


def test_a_model_call_after_the_env_ended_the_episode_is_a_409(tokenizer: Any) -> None:
    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, ChatRenderer(tokenizer)) as (_, episode, client):
            first = await client.post("/chat/completions", json={"messages": QUESTION})
            reply = first.json()["choices"][0]["message"]
            step = await client.post("/envhub/step", json={"action": "<answer>13</answer>"})
            assert step.json()["terminated"] or step.json()["truncated"]
            before, calls = recorded(episode), len(engine.prompts)
            grown = [*QUESTION, reply, *step.json()["messages"]]
            answer = await client.post("/chat/completions", json={"messages": grown})
            status, _, message = error_of(answer)
            assert status == 409 and "the env has already ended this episode" in message
            assert recorded(episode) == before and len(engine.prompts) == calls

    asyncio.run(main())


# --------------------------------------------------------------------------- M5: templates

REWRITING = (  # Qwen3-style: earlier assistant turns lose their <think> block
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_rewrites_history_makes_each_call_a_sample_of_its_own(
    tokenizer: Any,
) -> None:
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = REWRITING
    renderer = ChatRenderer(rewriting, tool_parser="none")
    assert not renderer.append_only

    async def main() -> None:
        engine = Engine(rewriting, text="<think>a plan</think>ok")
        async with serving(engine, renderer) as (_, episode, client):
            first = await client.post("/chat/completions", json={"messages": QUESTION})
            grown = [*QUESTION, first.json()["choices"][0]["message"]]
            grown.append({"role": "user", "content": "again"})
            assert (await client.post("/chat/completions", json={"messages": grown})).is_success
            # the second call sees what the template shows (no earlier thinking), as vLLM would
            assert engine.prompts[-1] == renderer.prompt(grown)
            assert len(episode.rows) == 2

    asyncio.run(main())


# --------------------------------------------------------------------------- M3, M4, L1, L2


def test_a_body_over_the_limit_is_a_413_with_or_without_its_length(tokenizer: Any) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "12+34 " * 1000}]}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(big), 512):
            yield big[start : start + 512]

    async def main() -> None:
        limits = ServerLimits(max_body_bytes=2048)
        engine = Engine(tokenizer)
        async with serving(engine, ChatRenderer(tokenizer), limits=limits) as (_, episode, client):
            for body in (big, chunks()):
                answer = await client.post("/chat/completions", content=body)
                status, _, message = error_of(answer)
                assert status == 413 and "2048 bytes" in message
            assert engine.prompts == [] and episode.rows == []

    asyncio.run(main())


def test_the_run_configs_limits_bound_the_proxy_it_serves(tokenizer: Any) -> None:
    """``rollout.agent.limits`` in a run's config is what the run's proxy enforces."""
    cfg = load_config(
        None,
        [
            f"env.id={CALC}",
            "rollout.agent.callable=tests.trainer.rollout.proxy_agents:play",
            "rollout.agent.limits.max_body_bytes=2048",
        ],
    )
    engine = Engine(tokenizer)
    rollouts = Rollouts(
        cfg, [engine], ChatRenderer(tokenizer), LocalEnvSource(), max_context_tokens=4096
    )
    proxy = rollouts.proxy
    assert proxy is not None

    async def open_episode() -> ProxyEpisode:
        session = await LocalEnvSource().session(CALC)
        messages, info = await session.reset(1)
        return proxy.open("g0e0a0", Trajectory(CALC, 1), session, Sampling(32), messages, info)

    try:
        episode = rollouts.thread.run(open_episode())
        big = {"messages": [{"role": "user", "content": "12+34 " * 1000}]}
        answer = httpx.post(
            f"{proxy.base_url}/chat/completions",
            json=big,
            headers={"Authorization": f"Bearer {episode.api_key}"},
            timeout=HANG_GUARD_S,
        )
        status, _, message = error_of(answer)
        assert status == 413 and "2048 bytes" in message
        assert engine.prompts == [] and episode.rows == []
    finally:
        rollouts.close()


def test_text_too_long_for_the_context_is_refused_before_it_is_tokenised(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer)
    encoded: list[int] = []
    encode = renderer.encode
    renderer.encode = lambda text: encoded.append(len(text)) or encode(text)  # type: ignore

    async def main() -> None:
        engine = Engine(tokenizer)
        async with serving(engine, renderer, max_context_tokens=64) as (_, episode, client):
            body = {"messages": [{"role": "user", "content": "12+34 " * 50_000}]}
            status, _, message = error_of(await client.post("/chat/completions", json=body))
            assert status == 400 and "longer than the context" in message
            assert max(encoded, default=0) < 1000 and engine.prompts == []
            assert episode.trajectory.truncated and episode.rows == []  # as a full context ends it

    asyncio.run(main())


def stalled_request(port: int, api_key: str) -> socket.socket:
    """A connection that sends a request's headers and the start of its body, then nothing."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
        'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"messages"'.encode()
    )
    return conn


def read_all(conn: socket.socket) -> bytes:
    conn.settimeout(HANG_GUARD_S)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := conn.recv(65536):
            data += chunk
    return data


def test_a_body_that_never_ends_is_answered_408(tokenizer: Any) -> None:
    async def main() -> None:
        limits = ServerLimits(body_timeout_s=0.2)
        async with serving(Engine(tokenizer), ChatRenderer(tokenizer), limits=limits) as (
            proxy,
            episode,
            _,
        ):
            conn = stalled_request(proxy.port, episode.api_key)
            answer = await asyncio.to_thread(read_all, conn)
            conn.close()
            assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within" in answer
            assert episode.rows == []

    asyncio.run(main())


def test_closing_the_proxy_does_not_wait_for_a_stalled_request(tokenizer: Any) -> None:
    async def main() -> None:
        limits = ServerLimits(shutdown_timeout_s=0.1)
        proxy = AgentProxy(
            Engine(tokenizer),
            ChatRenderer(tokenizer),
            max_turns=8,
            max_context_tokens=4096,
            limits=limits,
        )
        await proxy.start()
        session = await LocalEnvSource().session(CALC)
        messages, info = await session.reset(1)
        episode = proxy.open("k", Trajectory(CALC, 1), session, Sampling(32), messages, info)
        reading = asyncio.Event()
        lookup = proxy.episode

        def looked_up(authorization: str | None) -> ProxyEpisode:
            reading.set()  # the key is checked just before the body is read
            return lookup(authorization)

        proxy.episode = looked_up  # type: ignore[method-assign]
        conn = stalled_request(proxy.port, episode.api_key)
        await reading.wait()
        await asyncio.wait_for(proxy.aclose(), HANG_GUARD_S)  # a hang fails here
        conn.close()
        await session.close()

    asyncio.run(main())


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_that_never_sends_its_headers_is_closed(tokenizer: Any, sent: bytes) -> None:
    async def main() -> None:
        limits = ServerLimits(header_timeout_s=0.2)
        async with serving(Engine(tokenizer), ChatRenderer(tokenizer), limits=limits) as (
            proxy,
            _,
            client,
        ):
            conn = socket.create_connection(("127.0.0.1", proxy.port))
            conn.sendall(sent)
            await asyncio.to_thread(read_all, conn)  # returns once the server closed it
            conn.close()
            assert (await client.get("/models")).is_success  # the server still serves

    asyncio.run(main())


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/chat/completions", 405), ("POST", "/completions", 404), ("GET", "/x", 404)],
)
def test_unknown_routes_and_methods_answer_in_openai_form(
    tokenizer: Any, method: str, path: str, status: int
) -> None:
    async def main() -> None:
        async with serving(Engine(tokenizer), ChatRenderer(tokenizer)) as (_, __, client):
            answer = await client.request(method, path)
            assert error_of(answer)[:2] == (status, "invalid_request_error")

    asyncio.run(main())


def test_rollouts_close_runs_every_step_when_one_fails() -> None:
    from trainer.rollout.rollouts import Rollouts
    from trainer.rollout.scheduler import LoopThread

    closed: list[str] = []

    def closer(name: str, fails: bool = False) -> Callable[[], Any]:
        async def close() -> None:
            closed.append(name)
            if fails:
                raise RuntimeError(f"{name} failed to close")

        return close

    class Part:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.close = self.aclose = closer(name, fails)

    rollouts = Rollouts.__new__(Rollouts)
    rollouts.thread = LoopThread()
    rollouts.scheduler, rollouts.workers = Part("scheduler"), None  # type: ignore[assignment]
    rollouts.proxy = Part("proxy", fails=True)  # type: ignore[assignment]
    rollouts.router, rollouts.envs = Part("router"), Part("envs")  # type: ignore[assignment]
    rollouts.eval_envs = Part("eval_envs")  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="proxy failed to close"):
        rollouts.close()
    assert closed == ["scheduler", "proxy", "router", "envs", "eval_envs"]
    assert rollouts.thread.loop.is_closed()
