"""Reward workers: verifiers, user functions and a judge, routed by env domain."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")

from trainer.errors import RewardError
from trainer.rewards.judge import LLMJudge, parse_grade
from trainer.rewards.router import RewardRouter
from trainer.rewards.verifiers import (
    EpisodeView,
    exact_match,
    final_answer,
    make_scorer,
    numeric_match,
)
from trainer.rollout.trajectory import Trajectory
from trainer.workers.reward import domain_matches


def constant_half(episode: EpisodeView) -> float:
    """A user reward function, importable as tests.trainer.rewards.test_rewards:constant_half."""
    return 0.5


def view(reply: str, **info) -> EpisodeView:
    return EpisodeView(
        "math/add-v0",
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": reply}],
        info,
    )


def test_an_answer_only_mused_while_thinking_scores_nothing() -> None:
    scorer = make_scorer({"kind": "numeric", "target": "answer"})
    assert scorer(view("<think>maybe <answer>42</answer>?</think>", answer=42)) == 0.0
    assert scorer(view("<think>maybe 41</think><answer>42</answer>", answer=42)) == 1.0


def test_verifiers() -> None:
    assert final_answer(view("I think <answer> Paris </answer>")) == "Paris"
    assert exact_match("paris ", "Paris") == 1.0 and exact_match("Lyon", "Paris") == 0.0
    assert numeric_match("so x = 1,000.0", 1000) == 1.0 and numeric_match("no number", 3) == 0.0
    assert numeric_match("3.0000001", 3, rel_tol=1e-3) == 1.0 and numeric_match("3.1", 3) == 0.0
    assert (
        make_scorer({"kind": "numeric", "target": "answer"})(view("<answer>4</answer>", answer=4))
        == 1.0
    )
    with pytest.raises(RewardError, match="reward target 'answer' is not in the env's reset info"):
        make_scorer({"kind": "exact"})(view("4"))
    with pytest.raises(RewardError, match="use 'exact', 'numeric', 'function' or 'judge'"):
        make_scorer({"kind": "regex"})
    with pytest.raises(RewardError, match="must look like 'package.module:function'"):
        make_scorer({"kind": "function", "function": "nocolon"})


def test_domain_routing() -> None:
    assert domain_matches("*", "games/sokoban-v0") and domain_matches("games", "games/sokoban-v0")
    assert domain_matches("games/soko*", "games/sokoban-v0") and not domain_matches(
        "code", "games/sokoban-v0"
    )


def test_router_scores_on_the_reward_cluster_while_the_loop_runs() -> None:
    specs = [
        {"kind": "numeric", "target": "answer", "domain": "math"},
        {
            "kind": "function",
            "function": "tests.trainer.rewards.test_rewards:constant_half",
            "domain": "math",
            "weight": 2.0,
        },
        {"kind": "exact", "target": "answer", "domain": "games"},
    ]
    router = RewardRouter.from_config(specs, None)
    try:
        right = Trajectory(
            "math/add-v0", 0, info={"answer": 4}, messages=view("<answer>4</answer>").messages
        )
        right.turn_rewards = [0.25]
        other = Trajectory("code/x-v0", 0, messages=view("4").messages)

        async def both() -> None:
            await asyncio.gather(router.score(right), router.score(other))

        asyncio.run(both())
        assert right.final_reward == 1.0 + 2 * 0.5 and right.episode_reward == 2.25
        assert other.final_reward == 0.0  # no route for the code domain: env reward only
    finally:
        router.shutdown()
    replace = RewardRouter.from_config(
        [
            {
                "kind": "function",
                "function": "tests.trainer.rewards.test_rewards:constant_half",
                "mode": "replace",
            }
        ],
        None,
    )
    try:
        t = Trajectory("math/add-v0", 0, messages=view("x").messages, turn_rewards=[1.0])
        asyncio.run(replace.score(t))
        assert t.episode_reward == 0.5
    finally:
        replace.shutdown()


class ReplyEngine:
    """A judge model that always replies ``text``; records the requests it was sent."""

    version = 0

    def __init__(self, tokenizer, text: str) -> None:
        self.ids, self.requests = tokenizer.encode(text, add_special_tokens=False), []

    async def generate(self, request):
        from trainer.strategies.base import GenerationResult

        self.requests.append(request)
        return GenerationResult(request.request_id, list(self.ids), [0.0] * len(self.ids), "stop")


def test_judge_grade_is_what_the_judge_model_replied(policy) -> None:
    assert parse_grade("Score: 0.8 overall") == 0.8 and parse_grade("YES, solved") == 1.0
    assert parse_grade("7/10") == 1.0 and parse_grade("no idea", default=0.25) == 0.0
    assert parse_grade("???", default=0.25) == 0.25
    _, tokenizer = policy
    for reply, expected in [("Score: 0.8 overall", 0.8), ("no", 0.0), ("yes", 1.0), ("hmm", 0.25)]:
        engine = ReplyEngine(tokenizer, reply)
        grade = asyncio.run(
            LLMJudge(engine, tokenizer, max_new_tokens=3, default=0.25).score(view("4"))
        )
        assert grade == expected, reply
        (request,) = engine.requests
        assert request.temperature == 0.0 and "assistant: 4" in tokenizer.decode(request.prompt_ids)
