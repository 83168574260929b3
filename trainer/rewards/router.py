"""``RewardRouter``: send each finished episode to the ``reward`` role, concurrently with rollout.

``EnvManager`` awaits ``router.score(trajectory)`` when an episode ends; the scoring runs on
the reward workers (their own threads or Ray actors) while other episodes keep generating,
so a slow verifier or judge never stalls the batch. The result is added to the episode's
return (``mode: add``, the default) or replaces it (``mode: replace``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.rewards.verifiers import EpisodeView
from trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from trainer.config import RoleConfig
    from trainer.controller.cluster import Backend

__all__ = ["RewardRouter"]


class RewardRouter:
    """Scores trajectories on a ``RewardCluster``."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    @classmethod
    def from_config(
        cls, specs: list[dict[str, Any]], role: RoleConfig | None, *, backend: Backend = "local"
    ) -> RewardRouter:
        """A router over a new ``reward`` cluster scoring with ``specs`` (``env.rewards``);
        ``role`` is ``roles.reward`` (None: one device-less worker)."""
        from trainer.workers.reward import RewardCluster

        return cls(
            RewardCluster(
                "reward",
                role,
                backend=backend,
                world_size=max(1, role.num_workers if role is not None else 1),
                worker_kwargs={"specs": [dict(s) for s in specs]},
            )
        )

    async def score(self, trajectory: Trajectory) -> None:
        view = EpisodeView(
            trajectory.env_id, list(trajectory.messages), dict(trajectory.info), trajectory.success
        )
        result = await self.cluster.score_async(view)
        if result["matched"]:
            base = sum(trajectory.turn_rewards)
            trajectory.final_reward = (
                result["score"] - base if result["replace"] else result["score"]
            )

    def shutdown(self) -> None:
        self.cluster.shutdown()
