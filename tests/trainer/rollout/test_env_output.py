"""What an env and the reward function hand an episode (``trainer.rollout.env_output``): messages
that are not chat messages, a bad turn cap, a reward function that raises or scores NaN, a reply
longer than the context. Each fails (or ends) its episode, named, and never raises out of
``EnvManager.run``: an evaluation loses the episode instead of crashing the run, training
replays it and counts it. Text content parts (a chat API's form) are read as their text."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the train extra: pip install -e '.[train]'")

from tests.trainer.rollout.sim_workload import FAST, engines, manager, renderer, source
from trainer.rewards.router import RewardRouter
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.groups import EpisodeSpec, eval_failures, play_episode, run_episodes
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig

ENV = "acme/chat-v0"
GOOD = [{"role": "user", "content": "Say anything."}]


def run(coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


class ChatEnv:
    """A user env (not a ``TextEnv``: nothing checks its output on the way) whose reset or
    step (``where``) returns ``messages`` and ``info``; its episodes go on until ``turns``."""

    def __init__(
        self, messages: Any = GOOD, where: str = "reset", info: Any = None, turns: int = 2
    ) -> None:
        self.messages, self.where, self.info = messages, where, info
        self.turns, self.turn = turns, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        self.turn = 0
        if self.where == "reset":
            return self.messages, {} if self.info is None else self.info
        return GOOD, {}

    def step(self, action: Any) -> Any:
        self.turn += 1
        if self.where == "step":
            return self.messages, 0.0, self.turn >= self.turns, False, self.info or {}
        return [{"role": "user", "content": "ok"}], float(self.turn), self.turn >= 2, False, {}

    def close(self) -> None:
        pass


def envs(make: Any) -> LocalEnvSource:
    return LocalEnvSource(make=lambda env_id, **kwargs: make(env_id))


async def play(env: Any, **options: Any) -> Any:
    return await play_episode(
        manager(EngineRouter(engines(1, cost=FAST)), **options),
        envs(lambda env_id: env),
        EpisodeSpec(ENV, 0, 0),
        Sampling(8),
        max_retries=0,
    )


# ---------------------------------------------------------------------- messages
@pytest.mark.parametrize("sample_unit", ["episode", "turn"])
@pytest.mark.parametrize("where", ["reset", "step"])
@pytest.mark.parametrize(
    "messages, field",
    [
        ([{"role": "user", "content": 123}], "messages[0].content of type int"),
        ([{"content": "hi"}], "messages[0] with role=None"),
        ([{"role": 5, "content": "hi"}], "messages[0] with role=5"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ],
)
def test_messages_that_are_not_chat_messages_fail_the_episode_naming_the_field(
    messages: Any, field: str, where: str, sample_unit: str
) -> None:
    trajectory = run(play(ChatEnv(messages, where), sample_unit=sample_unit))
    assert trajectory.failed, "the episode must fail, not raise or train on it"
    assert f"env {ENV!r} {where} returned {field}" in trajectory.failure


@pytest.mark.parametrize("sample_unit", ["episode", "turn"])
def test_text_content_parts_are_read_as_their_text(sample_unit: str) -> None:
    """OpenAI's content parts, as a chat-API user writes them, at reset and at each step."""
    text_parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "anything."}]
    parts = [{"role": "user", "content": text_parts}]
    as_text = [{"role": "user", "content": "Say anything."}]

    class PartsEnv(ChatEnv):
        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            return parts, {}

        def step(self, action: Any) -> Any:
            self.turn += 1
            return parts, 1.0, self.turn >= 2, False, {}

    trajectory = run(play(PartsEnv(), sample_unit=sample_unit))
    assert not trajectory.failed, trajectory.failure
    assert [m["content"] for m in trajectory.messages if m["role"] == "user"] == [
        "Say anything."
    ] * 3
    first = trajectory.rows[0]
    assert first.token_ids[: len(renderer().prompt(as_text))] == renderer().prompt(as_text)


@pytest.mark.parametrize("cap", ["unlimited", 0, -5, 2.5, float("nan")])
def test_a_turn_cap_that_is_not_a_positive_integer_fails_the_episode(cap: Any) -> None:
    trajectory = run(play(ChatEnv(info={"max_new_tokens": cap})))
    assert trajectory.failed and "info['max_new_tokens']=" in trajectory.failure
    assert repr(cap)[:10] in trajectory.failure


def test_a_chat_template_that_refuses_the_envs_tools_fails_the_episode() -> None:
    class Refusing:
        """The renderer, but its template refuses every prompt (as one refusing odd tools)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(renderer(), name)

        def prompt(self, *args: Any, **kwargs: Any) -> Any:
            raise TypeError("can only concatenate str (not 'dict') to str")

    for sample_unit in ("episode", "turn"):
        env_manager = EnvManager(
            EngineRouter(engines(1, cost=FAST)),
            Refusing(),  # type: ignore[arg-type]
            max_turns=4,
            max_context_tokens=4096,
            sample_unit=sample_unit,  # type: ignore[arg-type]
        )
        spec = EpisodeSpec(ENV, 0, 0)
        trajectory = run(
            play_episode(env_manager, envs(lambda _: ChatEnv()), spec, Sampling(8), max_retries=0)
        )
        assert trajectory.failed and f"chat template on env {ENV!r}" in trajectory.failure


# ---------------------------------------------------------------------- the context
def long_manager(max_context_tokens: int = 256) -> EnvManager:
    return EnvManager(
        EngineRouter(engines(1, cost=FAST)),
        renderer(),
        max_turns=10,
        max_context_tokens=max_context_tokens,
        sample_unit="episode",
    )


def test_an_env_reply_longer_than_the_context_ends_the_episode_without_it() -> None:
    """A web or code env that prints a huge page once: no trained row may be longer than the
    context (GPT-2's absolute positions end there; other models would train on waste)."""
    flood = [{"role": "user", "content": "a b c d " * 500}]
    env_manager = long_manager()
    trajectory = run(
        play_episode(
            env_manager,
            envs(lambda _: ChatEnv(flood, "step", turns=5)),
            EpisodeSpec(ENV, 0, 0),
            Sampling(16),
            max_retries=0,
        )
    )
    assert not trajectory.failed and trajectory.truncated
    assert trajectory.num_policy_tokens > 0
    assert len(trajectory.token_ids) <= env_manager.max_context_tokens


def test_a_first_observation_longer_than_the_context_fails_the_episode_naming_it() -> None:
    flood = [{"role": "user", "content": "a b c d " * 500}]
    trajectory = run(
        play_episode(
            long_manager(),
            envs(lambda _: ChatEnv(flood, "reset")),
            EpisodeSpec(ENV, 0, 0),
            Sampling(16),
            max_retries=0,
        )
    )
    assert trajectory.failed and "max_context_tokens=256" in trajectory.failure
    assert len(trajectory.token_ids) <= 256


# ---------------------------------------------------------------------- the reward function
async def parse_fails_on_seed_1(trajectory: Any) -> None:
    if trajectory.seed == 1:
        raise ValueError("could not parse the answer")


async def scores_nan(trajectory: Any) -> None:
    trajectory.final_reward = float("nan")


def reward_manager(router: EngineRouter, hook: Any) -> EnvManager:
    return EnvManager(router, renderer(), max_turns=4, max_context_tokens=4096, on_episode_end=hook)


def test_an_evaluation_loses_an_episode_whose_reward_function_raised() -> None:
    """``pipeline.evaluate`` runs first thing in a run: a scorer raising on one odd episode
    must cost that episode (counted in eval/failed_episodes), not the run."""
    specs = [EpisodeSpec("t/p-v0", seed, seed) for seed in range(4)]

    async def main() -> Any:
        router = EngineRouter(engines(1, cost=FAST))
        return await run_episodes(
            specs, reward_manager(router, parse_fails_on_seed_1), source(), Sampling(8)
        )

    finished, failed = run(main())
    assert sorted(t.seed for t in finished) == [0, 2, 3]
    assert failed and all(
        t.failure == "reward function raised ValueError: could not parse the answer" for t in failed
    )
    assert eval_failures(specs, finished, failed)["eval/failed_episodes"] == 1.0


def test_an_env_with_malformed_messages_in_an_evaluation_is_lost_not_fatal() -> None:
    specs = [EpisodeSpec("good", 1, 0), EpisodeSpec("bad", 2, 1)]
    bad = [{"role": "user", "content": 123}]

    async def main() -> Any:
        router = EngineRouter(engines(1, cost=FAST))
        make = lambda env_id: ChatEnv(bad if env_id == "bad" else GOOD)
        return await run_episodes(specs, manager(router), envs(make), Sampling(8))

    finished, failed = run(main())
    assert [t.env_id for t in finished] == ["good"]
    assert failed and all("env 'bad' reset returned messages[0]" in t.failure for t in failed)


def test_training_replays_and_counts_episodes_whose_reward_function_failed() -> None:
    async def main(hook: Any) -> Any:
        router = EngineRouter(engines(1, cost=FAST))
        cfg = SchedulerConfig(2, 2, ("t/p-v0",))
        scheduler = RolloutScheduler(
            cfg, reward_manager(router, hook), router, source(), Sampling(8)
        )
        try:
            return await scheduler.next_batch()
        finally:
            await scheduler.close()

    batch = run(main(parse_fails_on_seed_1))
    assert batch.failed and batch.metrics["rollout/failed_attempts"] == len(batch.failed)
    assert all(t.failure.startswith("reward function raised ValueError") for t in batch.failed)
    assert all(t.seed != 1 for t in batch.trajectories)  # its group was replaced


def test_a_nan_score_fails_the_episode_and_a_run_of_them_names_the_reward_function() -> None:
    from trainer.errors import RolloutError

    async def main() -> Any:
        router = EngineRouter(engines(1, cost=FAST))
        cfg = SchedulerConfig(2, 2, ("t/p-v0",), max_failed_groups=3)
        scheduler = RolloutScheduler(
            cfg, reward_manager(router, scores_nan), router, source(), Sampling(8)
        )
        try:
            return await scheduler.next_batch()
        finally:
            await scheduler.close()

    with pytest.raises(RolloutError) as error:
        run(main())
    message = str(error.value)
    assert "reward function made the episode's return nan" in message
    assert "fix the scorer of env.rewards" in message and "envhub check" not in message


class ScoringCluster:
    """A ``RewardCluster`` stand-in whose workers answer ``score`` with ``answer``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    async def score_async(self, view: Any) -> dict[str, Any]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return {"score": self.answer, "replace": False, "matched": 1}


@pytest.mark.parametrize("answer", [math.nan, math.inf, 1e39, ValueError("no answer tag")])
def test_a_reward_worker_score_that_is_not_finite_fails_the_episode_naming_the_scorer(
    answer: Any,
) -> None:
    specs = [{"kind": "function", "function": "acme.scoring:grade", "domain": "t"}]
    rewards = RewardRouter(ScoringCluster(answer), specs=specs)

    async def main() -> Any:
        router = EngineRouter(engines(1, cost=FAST))
        spec = EpisodeSpec("t/p-v0", 0, 0)
        hooked = reward_manager(router, rewards.score)
        return await play_episode(hooked, source(), spec, Sampling(8), max_retries=0)

    trajectory = run(main())
    assert trajectory.failed and trajectory.failure.startswith("reward function")
    assert "env.rewards[0] (function acme.scoring:grade)" in trajectory.failure


def test_evaluation_episodes_are_forgotten_by_the_router_at_their_end() -> None:
    """The router's sticky table must not gain an entry per evaluation episode for the run."""

    async def main() -> int:
        router = EngineRouter(engines(1, cost=FAST))
        specs = [EpisodeSpec("t/p-v0", seed, seed) for seed in range(6)]
        await run_episodes(specs, manager(router), source(), Sampling(8))
        return len(router._sticky)

    assert run(main()) == 0
