"""Single-process env step rate of every game family, next to Gymnasium's own FrozenLake.

Why: the hub's pools and server add latency on top of the env itself; this is the floor
they start from, and it shows what the text contract (messages, parsing, transcripts)
costs against Gymnasium's numeric FrozenLake-v1 doing the same walk.

    python benchmarks/env_step_rate.py [--seconds 2]

Last line: ``frozen_lake_text_vs_gymnasium: X x`` (our text FrozenLake's steps/s divided by
Gymnasium FrozenLake-v1's, same map size, random actions, one process).
"""

from __future__ import annotations

import argparse
import time

import gymnasium
import numpy as np

import envhub


def rate(step_fn, reset_fn, seconds: float) -> float:
    """Steps per second of a closed loop that resets whenever an episode ends."""
    reset_fn()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            if step_fn():
                reset_fn()
        steps += 100
    return steps / (time.perf_counter() - start)


def text_env_rate(env_id: str, seconds: float) -> float:
    env = envhub.make(env_id)
    rng = np.random.default_rng(0)
    actions = [env.action_space.sampler(rng) for _ in range(1000)]
    i = 0

    def step() -> bool:
        nonlocal i
        i += 1
        _, _, terminated, truncated, _ = env.step(actions[i % len(actions)])
        return terminated or truncated

    return rate(step, lambda: env.reset(seed=i), seconds)


def gymnasium_frozen_lake_rate(seconds: float) -> float:
    env = gymnasium.make("FrozenLake-v1", is_slippery=False, max_episode_steps=20)
    env.action_space.seed(0)

    def step() -> bool:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        return terminated or truncated

    return rate(step, lambda: env.reset(seed=0), seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per env")
    args = parser.parse_args()
    print(f"{'env':32} {'steps/s':>10}")
    results = {}
    for spec in envhub.list_envs("games", variants=False):
        results[spec.id] = text_env_rate(spec.id, args.seconds)
        print(f"{spec.id:32} {results[spec.id]:>10,.0f}")
    gym_rate = gymnasium_frozen_lake_rate(args.seconds)
    print(f"{'gymnasium FrozenLake-v1 (numeric)':32} {gym_rate:>10,.0f}")
    print(f"frozen_lake_text_vs_gymnasium: {results['games/frozen-lake-v0'] / gym_rate:.2f} x")


if __name__ == "__main__":
    main()
