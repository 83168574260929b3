"""Run agents over environments and summarise how they do.

Used by ``envhub eval`` (the README's main job until the trainer lands) and by tests. An
*agent* is any callable ``(env, messages) -> str``; two come built in:

``random``
    ``env.action_space.sample()``: the env's own mix of well-formed and malformed actions.
``expert``
    ``env.expert_action()`` where the env provides one (games do), else random.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from envhub.core import Observation

__all__ = ["AGENTS", "Agent", "EpisodeStats", "EvalSummary", "evaluate", "run_episode"]

Agent = Callable[[Any, Observation], str]


def random_agent(env: Any, messages: Observation) -> str:
    return env.action_space.sample()


def expert_agent(env: Any, messages: Observation) -> str:
    action = getattr(env.unwrapped, "expert_action", lambda: None)()
    return action if action is not None else env.action_space.sample()


AGENTS: dict[str, Agent] = {"random": random_agent, "expert": expert_agent}


@dataclass(frozen=True)
class EpisodeStats:
    env_id: str
    seed: int
    episode_return: float
    turns: int
    success: bool
    invalid_actions: int
    truncated: bool
    seconds: float


@dataclass(frozen=True)
class EvalSummary:
    """Aggregate of several episodes of one agent on one env."""

    env_id: str
    agent: str
    episodes: int
    success_rate: float
    mean_return: float
    mean_turns: float
    invalid_rate: float
    """Invalid actions per turn taken."""
    steps_per_second: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_episode(env: Any, agent: Agent, *, seed: int, env_id: str = "") -> EpisodeStats:
    """Play one episode of ``agent`` on ``env`` from ``reset(seed=seed)``."""
    start = time.perf_counter()
    env.action_space.seed(seed)
    messages, info = env.reset(seed=seed)
    episode_return, turns, invalid, truncated = 0.0, 0, 0, False
    while True:
        messages, reward, terminated, truncated, info = env.step(agent(env, messages))
        episode_return += reward
        turns += 1
        invalid += bool(info.get("invalid_action", False))
        if terminated or truncated:
            break
    return EpisodeStats(
        env_id=env_id,
        seed=seed,
        episode_return=episode_return,
        turns=turns,
        success=bool(info.get("success", False)),
        invalid_actions=invalid,
        truncated=truncated,
        seconds=time.perf_counter() - start,
    )


def summarise(env_id: str, agent: str, episodes: list[EpisodeStats]) -> EvalSummary:
    n = max(len(episodes), 1)
    turns = sum(e.turns for e in episodes)
    seconds = sum(e.seconds for e in episodes)
    return EvalSummary(
        env_id=env_id,
        agent=agent,
        episodes=len(episodes),
        success_rate=sum(e.success for e in episodes) / n,
        mean_return=sum(e.episode_return for e in episodes) / n,
        mean_turns=turns / n,
        invalid_rate=sum(e.invalid_actions for e in episodes) / max(turns, 1),
        steps_per_second=turns / seconds if seconds > 0 else float("inf"),
    )


def evaluate(
    env_ids: Iterable[str],
    agents: Iterable[str] = ("random", "expert"),
    *,
    episodes: int = 10,
    seed: int = 0,
    on_episode: Callable[[EpisodeStats], None] | None = None,
) -> list[EvalSummary]:
    """Play ``episodes`` seeded episodes of each agent on each env; one summary per pair.

    Every agent sees the same seeds, so their numbers compare like for like.
    """
    from envhub.registry import make

    summaries = []
    for env_id in env_ids:
        for agent_name in agents:
            agent = AGENTS[agent_name]
            env = make(env_id)
            try:
                stats = []
                for i in range(episodes):
                    stats.append(run_episode(env, agent, seed=seed + i, env_id=env_id))
                    if on_episode is not None:
                        on_episode(stats[-1])
            finally:
                env.close()
            summaries.append(summarise(env_id, agent_name, stats))
    return summaries
