"""A black-box agent (only the ``openai`` SDK) plays through the trainer's proxy.

What a user relies on: the proxy records the same token sequences the built-in env manager
builds for the same sampled tokens (so training an agent is training the policy), a call that
does not extend the last is a sample of its own, every way an agent can fail is a failed
episode with its reason, and bad calls get OpenAI-style errors that say what to fix.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from envhub.model_agent import NOT_RUN
from tests.trainer.conftest import LAKE, LAKE_KWARGS
from tests.trainer.rollout import proxy_agents
from tests.trainer.rollout.test_native_tools import CALC, ScriptedEngine, expert_turns
from tests.trainer.rollout.test_scheduler import (
    HANG_GUARD_S,
    PausingEngine,
    ScriptedEnv,
    make_engine,
    run,
)
from trainer.config_rollout import AgentConfig
from trainer.models import build_tokenizer, env_corpus
from trainer.rollout.agents import AgentRunner
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.groups import EpisodeSpec, plan_groups, play_episode, run_episodes
from trainer.rollout.proxy import AgentProxy
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig
from trainer.rollout.trajectory import ChatRenderer, Trajectory
from trainer.strategies.base import GenerationRequest, GenerationResult
from trainer.strategies.hf_engine import HFEngine

AGENTS = "tests.trainer.rollout.proxy_agents"
SAMPLING = Sampling(max_new_tokens=3)


class Recording:
    """The real engine, remembering what it sampled for each prompt."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.sampled: dict[tuple[int, ...], list[GenerationResult]] = collections.defaultdict(list)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.engine.generate(request)
        self.sampled[tuple(request.prompt_ids)].append(result)
        return result


class Replay:
    """Answers each prompt with what the recorded run sampled for it; a prompt it never saw
    (the proxy rendered something else) is a KeyError in the episode."""

    def __init__(self, sampled: dict[tuple[int, ...], list[GenerationResult]]) -> None:
        self.sampled = {prompt: list(results) for prompt, results in sampled.items()}
        self.version = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.sampled[tuple(request.prompt_ids)].pop(0)


@pytest.fixture
def hang() -> Iterator[None]:
    proxy_agents.HANG.clear()
    yield
    proxy_agents.HANG.set()  # the abandoned agent thread ends


def engine_for(policy: Any) -> HFEngine:
    model, tokenizer = policy
    return HFEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=0
    )


def with_agent(
    engine: Any,
    renderer: ChatRenderer,
    specs: list[EpisodeSpec],
    *,
    max_retries: int = 0,
    on_episode_end: Any = None,
    **agent: Any,
) -> list[Trajectory]:
    """Play ``specs`` with the agent through a proxy started for the call."""

    async def main() -> list[Trajectory]:
        proxy = AgentProxy(engine, renderer, max_turns=4, max_context_tokens=1024)
        await proxy.start()
        runner = AgentRunner(proxy, AgentConfig(**agent), on_episode_end=on_episode_end)
        source = LocalEnvSource(LAKE_KWARGS)
        try:
            return list(
                await asyncio.gather(
                    *(
                        play_episode(runner, source, spec, SAMPLING, max_retries=max_retries)
                        for spec in specs
                    )
                )
            )
        finally:
            await proxy.aclose()

    return asyncio.run(main())


def view(t: Trajectory) -> tuple[Any, ...]:
    return (
        t.token_ids,
        t.response_mask,
        t.logprobs,
        t.turn_ends,
        t.turn_rewards,
        t.prompt_length,
        [(m["role"], m.get("content") or "") for m in t.messages],
        t.success,
        t.terminated,
        t.truncated,
    )


def test_an_openai_sdk_agent_records_the_env_managers_token_sequences(policy) -> None:
    renderer = ChatRenderer(policy[1])
    recording = Recording(engine_for(policy))
    specs = plan_groups(0, num_groups=4, group_size=2, env_ids=[LAKE], seed=0)
    manager = EnvManager(recording, renderer, max_turns=4, max_context_tokens=1024)
    built_in, failed = asyncio.run(
        run_episodes(specs, manager, LocalEnvSource(LAKE_KWARGS), SAMPLING)
    )
    assert len(built_in) == 8 and not failed
    assert any(t.num_turns > 1 for t in built_in)  # multi-turn: the calls extend each other

    agent = with_agent(Replay(recording.sampled), renderer, specs, callable=f"{AGENTS}:play")

    assert [t.failure for t in agent] == [None] * 8
    assert sorted(map(view, agent)) == sorted(map(view, built_in))
    assert all(not t.samples and t.policy_versions == [0] * t.num_turns for t in agent)


@pytest.mark.parametrize("refused_first", [False, True], ids=["calls", "a refused call first"])
def test_native_tool_calls_reach_the_agent_and_train_the_env_managers_tokens(
    refused_first: bool,
) -> None:
    tokenizer = build_tokenizer(env_corpus(CALC, episodes=12), kind="bpe")  # ChatML with tools
    renderer = ChatRenderer(tokenizer)
    turns = expert_turns(seed=1)  # tool calls, then the answer
    if refused_first:  # an unknown tool: answered "Not run" before the env's feedback, both ways
        turns = ['<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', *turns]
    built_in = EnvManager(
        ScriptedEngine(tokenizer, turns),  # type: ignore[arg-type]
        renderer,
        max_turns=len(turns),
        max_context_tokens=4096,
    )
    expected = asyncio.run(
        run_episodes([EpisodeSpec(CALC, 1, 0)], built_in, LocalEnvSource(), Sampling(64))
    )[0][0]

    async def main() -> Trajectory:
        engine = ScriptedEngine(tokenizer, turns)
        proxy = AgentProxy(engine, renderer, max_turns=len(turns), max_context_tokens=4096)
        await proxy.start()
        runner = AgentRunner(proxy, AgentConfig(callable=f"{AGENTS}:play"))
        try:
            spec = EpisodeSpec(CALC, 1, 0)
            return await play_episode(runner, LocalEnvSource(), spec, Sampling(64), max_retries=0)
        finally:
            await proxy.aclose()

    agent = asyncio.run(main())
    assert agent.success and not agent.failed
    assert view(agent) == view(expected)
    calls = [m for m in agent.messages if m["role"] == "assistant" and m.get("tool_calls")]
    results = [m for m in agent.messages if m["role"] == "tool"]
    assert len(calls) == len(turns) - 1 == len(results)  # structured calls, linked answers
    assert [r["tool_call_id"] for r in results] == [c["tool_calls"][0]["id"] for c in calls]
    assert (results[0]["content"] == NOT_RUN) is refused_first


def test_calls_that_do_not_extend_each_other_are_samples_of_their_own(policy) -> None:
    renderer = ChatRenderer(policy[1])
    specs = plan_groups(0, num_groups=3, group_size=1, env_ids=[LAKE], seed=3)
    agent = with_agent(engine_for(policy), renderer, specs, callable=f"{AGENTS}:forgetful")
    multi = [t for t in agent if t.num_turns > 1]
    assert multi and all(not t.failed for t in agent)
    for t in multi:
        assert len(t.samples) == t.num_turns and not t.token_ids
        first = renderer.prompt(t.messages[:1]) if t.messages[0]["role"] != "system" else None
        for row in t.samples:
            assert row.prompt_length > 0 and row.response_mask[: row.prompt_length] == [0] * (
                row.prompt_length
            )
            assert sum(row.response_mask) > 0 and len(row.turn_rewards) == 1
        if first is not None:
            assert t.samples[0].token_ids[: len(first)] == first


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        ({"callable": f"{AGENTS}:raises"}, "agent raised ValueError: the agent's own bug"),
        ({"callable": f"{AGENTS}:returns_a_number"}, "the agent returned a int"),
        ({"callable": f"{AGENTS}:hangs", "timeout_s": 0.5}, "agent timeout"),
        (
            {"command": [sys.executable, "-m", AGENTS, "fail"]},
            "exited with status 3: cannot reach the model",
        ),
    ],
)
def test_a_failing_agent_is_a_failed_episode_with_its_reason(
    policy, hang, agent: dict[str, Any], reason: str
) -> None:
    specs = [EpisodeSpec(LAKE, 5, 0)]
    (t,) = with_agent(engine_for(policy), ChatRenderer(policy[1]), specs, **agent)
    assert t.failed and reason in (t.failure or ""), t.failure


def test_a_reward_function_that_raises_fails_the_agents_episode_naming_it(policy) -> None:
    """The run's reward function (``env.rewards``) raising on an agent's episode fails that
    episode with the reason, as for a policy-played one: it never escapes the runner."""

    async def scorer(trajectory: Trajectory) -> None:
        raise ValueError("could not parse the answer")

    specs = [EpisodeSpec(LAKE, 5, 0)]
    (t,) = with_agent(
        engine_for(policy),
        ChatRenderer(policy[1]),
        specs,
        on_episode_end=scorer,
        callable=f"{AGENTS}:play",
    )
    assert t.failed and "reward function raised ValueError" in (t.failure or ""), t.failure


def test_a_program_agent_and_a_final_answer_play_like_a_function_agent(policy) -> None:
    renderer = ChatRenderer(policy[1])
    specs = [EpisodeSpec(LAKE, 5, 0), EpisodeSpec(LAKE, 6, 1)]
    program = with_agent(
        engine_for(policy), renderer, specs, command=f"{sys.executable} -m {AGENTS}"
    )
    assert [t.failure for t in program] == [None, None]
    assert all(t.num_turns >= 1 and sum(t.response_mask) > 0 for t in program)
    (answered,) = with_agent(engine_for(policy), renderer, specs[:1], callable=f"{AGENTS}:answer")
    # the returned answer was the episode's one action: a turn, the env's reply, its reward
    assert not answered.failed and answered.num_turns == 1
    assert [m["role"] for m in answered.messages][-2:] == ["assistant", "user"]


def test_a_program_agent_started_as_python_runs_on_the_trainers_interpreter(
    policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``command: python my_agent.py`` from a shell where the venv is not activated ran the
    system Python, which cannot import the agent's SDK or envhub: every episode failed."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no venv on it, as `.venv/bin/envhub train`
    specs = [EpisodeSpec(LAKE, 5, 0)]
    renderer = ChatRenderer(policy[1])
    (t,) = with_agent(engine_for(policy), renderer, specs, command=f"python -m {AGENTS}")
    assert t.failure is None and t.num_turns >= 1


def test_the_proxy_refuses_bad_calls_with_errors_that_name_the_fix(policy) -> None:
    renderer = ChatRenderer(policy[1])

    async def main() -> dict[str, Any]:
        proxy = AgentProxy(engine_for(policy), renderer, max_turns=2, max_context_tokens=1024)
        await proxy.start()
        source = LocalEnvSource(LAKE_KWARGS)
        session = await source.session(LAKE)
        messages, info = await session.reset(5)
        episode = proxy.open("g0e0a0", Trajectory(LAKE, 5), session, SAMPLING, messages, info)
        seen: dict[str, Any] = {}

        def calls() -> None:  # the client side, as an agent would call (blocking SDK)
            client = openai.OpenAI(base_url=proxy.base_url, api_key=episode.api_key, max_retries=0)
            chat = client.chat.completions
            stranger = openai.OpenAI(base_url=proxy.base_url, api_key="nope", max_retries=0)
            for name, call in {
                "unknown_key": lambda: stranger.chat.completions.create(
                    model="policy", messages=messages
                ),
                "n": lambda: chat.create(model="policy", messages=messages, n=2),
                "model": lambda: chat.create(model="gpt-4o", messages=messages),
                "empty": lambda: chat.create(model="policy", messages=[]),
            }.items():
                try:
                    call()
                except openai.APIStatusError as error:
                    seen[name] = (error.status_code, error.message)
            headers = {"Authorization": f"Bearer {episode.api_key}"}
            bad = httpx.post(f"{proxy.base_url}/chat/completions", content=b"{", headers=headers)
            seen["json"] = (bad.status_code, bad.json()["error"]["message"])
            early = httpx.post(
                f"{proxy.base_url}/envhub/step", json={"action": "left"}, headers=headers
            )
            seen["early_step"] = (early.status_code, early.json()["error"]["message"])
            stream = chat.create(
                model="policy", messages=messages, stream=True, logprobs=True, temperature=0.3
            )
            chunks = list(stream)
            deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
            seen["streamed"] = "".join(deltas)
            seen["finish"] = chunks[-1].choices[0].finish_reason
            reply = chat.create(model="policy", messages=messages, logprobs=True)
            seen["logprobs"] = [lp.logprob for lp in reply.choices[0].logprobs.content]
            try:
                chat.create(model="policy", messages=messages)
            except openai.BadRequestError as error:
                seen["max_turns"] = error.message

        await asyncio.to_thread(calls)
        seen["rows"] = [
            [lp for lp, m in zip(row.logprobs, row.response_mask, strict=True) if m]
            for row in episode.rows
        ]
        proxy.close(episode)

        def late() -> None:
            client = openai.OpenAI(base_url=proxy.base_url, api_key=episode.api_key, max_retries=0)
            try:
                client.chat.completions.create(model="policy", messages=messages)
            except openai.APIStatusError as error:
                seen["ended"] = (error.status_code, error.message)

        await asyncio.to_thread(late)
        await session.close()
        await proxy.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen["unknown_key"][0] == 401 and "unknown api key" in seen["unknown_key"][1]
    assert seen["n"][0] == 400 and "n > 1 is not supported" in seen["n"][1]
    assert seen["model"][0] == 404 and "use 'policy'" in seen["model"][1]
    assert seen["empty"][0] == 400 and "non-empty list" in seen["empty"][1]
    assert seen["json"][0] == 400 and "not JSON" in seen["json"][1]
    assert seen["early_step"][0] == 409 and "call the model first" in seen["early_step"][1]
    assert seen["streamed"] and seen["finish"] in ("stop", "length")
    # two calls on the same messages: two samples, the second's log-probs as returned
    assert len(seen["rows"]) == 2
    assert seen["logprobs"] == pytest.approx(seen["rows"][1])
    assert "used its 2 model calls" in seen["max_turns"]
    assert seen["ended"][0] == 410 and "has ended" in seen["ended"][1]


# --------------------------------------------------------------------------- in the scheduler


class HoldingEngine(PausingEngine):
    """``PausingEngine`` that also says when it holds its 3rd token (no polling needed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holding = threading.Event()

    def _sample(self, logits, temperature, top_p):
        if self.sampled == 2:  # the next one is the 3rd: it waits for the abort
            self.holding.set()
        return super()._sample(logits, temperature, top_p)


def agent_scheduler(router: EngineRouter, renderer: ChatRenderer, env_factory, **config: Any):
    proxy = AgentProxy(router, renderer, max_turns=12, max_context_tokens=1024)
    runner = AgentRunner(proxy, AgentConfig(callable=f"{AGENTS}:play"))
    cfg = SchedulerConfig(**{"group_size": 2, "env_ids": ("test/scripted-v0",), **config})
    source = LocalEnvSource(make=lambda env_id, **kw: env_factory())
    return RolloutScheduler(cfg, runner, router, source, Sampling(40, temperature=0.0)), proxy


def test_a_weight_update_pauses_an_agents_call_which_resumes_under_new_weights(policy) -> None:
    model, tokenizer = policy
    engine = HoldingEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    router = EngineRouter([engine])
    one_turn = lambda: ScriptedEnv(turns=lambda seed: 1)
    scheduler, proxy = agent_scheduler(
        router, ChatRenderer(tokenizer), one_turn, num_groups=1, group_size=1, mode="async"
    )
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}

    async def go():
        await proxy.start()
        task = asyncio.ensure_future(scheduler.next_batch())
        await asyncio.to_thread(engine.holding.wait, HANG_GUARD_S)  # the agent's call decodes
        await scheduler.update_weights(weights)
        batch = await task
        await scheduler.close()
        await proxy.aclose()
        return batch

    batch = run(go())
    (t,) = batch.trajectories
    versions = [v for v in t.token_versions if v >= 0]
    assert not t.failed and t.num_turns == 1 and batch.metrics["rollout/preempted_turns"] == 1
    assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {1}  # kept, then new weights


def test_surplus_agent_episodes_are_aborted_and_their_keys_refused(policy) -> None:
    quick_then_long = lambda: ScriptedEnv(
        turns=lambda seed: 1 if seed < 3 else 10, budget=lambda seed: 2 if seed < 3 else 40
    )
    router = EngineRouter([make_engine(policy)])
    scheduler, proxy = agent_scheduler(
        router, ChatRenderer(policy[1]), quick_then_long, num_groups=3, redundancy=2.0
    )

    async def go():
        await proxy.start()
        batch = await scheduler.next_batch()
        draining = [task for group in scheduler._draining.values() for task in group.tasks]
        if draining:  # the surplus drains in the background (next_batch did not wait for it)
            await asyncio.wait(draining)
        state = (router.in_flight, len(scheduler._running), len(proxy._episodes))
        await proxy.aclose()
        return batch, state

    batch, state = run(go())
    assert {t.group_id for t in batch.trajectories} == {0, 1, 2}
    assert all(not t.failed for t in batch.trajectories)
    assert state == (0, 0, 0)  # once drained: nothing in flight, running, or open on the proxy
    assert batch.metrics["rollout/aborted_surplus_episodes"] == 6  # three surplus groups of two


def test_a_run_whose_agent_fails_every_episode_points_at_the_agent_not_the_env(policy) -> None:
    from trainer.errors import RolloutError
    from trainer.rollout.groups import run_episodes

    async def main() -> None:
        renderer = ChatRenderer(policy[1])
        proxy = AgentProxy(engine_for(policy), renderer, max_turns=4, max_context_tokens=1024)
        await proxy.start()
        runner = AgentRunner(proxy, AgentConfig(callable=f"{AGENTS}:raises"))
        try:
            await run_episodes([EpisodeSpec(LAKE, 5, 0)], runner, LocalEnvSource(), Sampling(8))
        finally:
            await proxy.aclose()

    with pytest.raises(RolloutError) as failed:
        asyncio.run(main())
    assert "fix rollout.agent's command or callable" in str(failed.value)
    assert "envhub check" not in str(failed.value)
