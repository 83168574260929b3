"""web/shop-v0: contract, oracle vs random, reward parts, both transports."""

from __future__ import annotations

import json

import pytest

import envhub
from envhub.evaluation import AGENTS, run_episode
from envs.datasets import TaskSetError
from envs.web.shop import shop_reward
from envs.web.shop_site import Catalogue


def test_shop_passes_the_checker():
    spec = envhub.spec("web/shop-v0")
    report = envhub.check_env(spec.make(), factory=spec.make, raise_on_failure=False)
    assert report.ok, [f"{r.name}: {r.message}" for r in report.failures]


def test_oracle_buys_the_right_product_and_random_does_not():
    env = envhub.make("web/shop-v0")
    expert = [run_episode(env, AGENTS["expert"], seed=s) for s in range(25)]
    random = [run_episode(env, AGENTS["random"], seed=s) for s in range(25)]
    assert all(e.success and e.episode_return == 1.0 for e in expert)
    assert sum(r.success for r in random) <= 1 and sum(r.episode_return for r in random) / 25 < 0.15


def test_reward_counts_attributes_options_price_and_type():
    product = Catalogue(0).products[0]
    goal = {
        "category": product.category,
        "attributes": list(product.attributes[:2]),
        "max_price": product.price + 1,
        "options": {k: v[0] for k, v in product.options.items()},
    }
    full = {k: v[0] for k, v in product.options.items()}
    assert shop_reward(product, full, goal)["reward"] == 1.0
    no_options = shop_reward(product, {}, goal)["reward"]
    assert no_options == pytest.approx((2 + 0 + 1) / (2 + len(full) + 1))
    wrong_type = shop_reward(product, full, {**goal, "category": "something else"})["reward"]
    assert wrong_type == pytest.approx(0.1)


def test_clicks_and_searches_are_validated_with_feedback():
    env = envhub.make("web/shop-v0")
    env.reset(seed=0)
    reply, reward, _, _, info = env.step("<answer>click[Buy Now]</answer>")
    assert (
        "There is no [Buy Now] on this page" in reply[0]["content"]
        and info["invalid_action"]
        and reward < 0
    )
    reply, *_ = env.step("<answer>purchase everything</answer>")
    assert "Use search[query] or click[label]" in reply[0]["content"]
    env.step("<answer>search[black running shoes]</answer>")
    reply, *_ = env.step("<answer>search[mug]</answer>")
    assert "no search box on this page" in reply[0]["content"]
    env.reset(seed=0)  # a lone surrogate (JSON can carry one) is an invalid action, not an error
    reply, reward, _, _, info = env.step("<answer>search[shoes \udcff]</answer>")
    assert info["invalid_action"] and "\\udcff" in reply[0]["content"] and reward < 0


def test_http_transport_serves_the_same_pages():
    def transcript(env):
        seen = [env.reset(seed=7)[0]]
        while not env.done:
            seen.append(env.step(env.expert_action())[:4])
        return json.dumps(seen)

    local, served = envhub.make("web/shop-v0"), envhub.make("web/shop-http-v0")
    try:
        assert transcript(local) == transcript(served)
        assert served._base_url.startswith("http://127.0.0.1:")
    finally:
        served.close()


def test_a_custom_instruction_without_a_goal_is_refused_not_replaced():
    """An instruction alone cannot be graded: refused with what a task needs, never swapped
    for a generated instruction about another product."""
    env = envhub.make("web/shop-v0")
    instruction = "i need a red coffee mug under 20 dollars"
    for task in ({"instruction": instruction}, {"instruction": instruction, "seed": 3}):
        with pytest.raises(TaskSetError) as error:
            env.reset(options={"task": task})
        assert "'goal'" in str(error.value) and "max_price" in str(error.value), error.value
    with pytest.raises(TaskSetError, match="'instruction'"):
        env.reset(options={"task": {"goal": {"category": "mug"}, "seed": 3}})


def test_a_custom_instruction_with_its_goal_is_shown_and_graded():
    env = envhub.make("web/shop-v0")
    product = Catalogue(0).products[0]
    goal = {
        "category": product.category,
        "attributes": [],
        "options": {},
        "max_price": product.price + 1,
        "target": product.id,
    }
    instruction = f"i need {product.title}"
    _, info = env.reset(options={"task": {"instruction": instruction, "goal": goal}})
    assert info["instruction"] == instruction
    while not env.done:
        *_, reward_info = env.step(env.expert_action())
    assert reward_info["success"]
    _, info = env.reset(options={"task": {"seed": 3}})  # a task drawn from its seed still plays
    assert info["instruction"].startswith("i need ")
