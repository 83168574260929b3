"""``RewardRouter``: send each finished episode to the ``reward`` role, concurrently with rollout.

``EnvManager`` awaits ``router.score(trajectory)`` when an episode ends; the scoring runs on
the reward workers (their own threads or Ray actors) while other episodes keep generating,
so a slow verifier or judge never stalls the batch. The result is added to the episode's
return (``mode: add``, the default) or replaces it (``mode: replace``).

A scorer that raises, or a score that is not a finite number within float32's range (a NaN
would reach the advantages; ``1e39`` is ``inf`` in training's tensors), raises
``RewardError`` naming the ``env.rewards`` entries that scored the episode: the episode manager
fails that episode with it (``trainer.rollout.env_output.score_episode``), it is not trained.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from envhub.pool.host import FLOAT32_MAX
from trainer.errors import RewardError
from trainer.rewards.verifiers import EpisodeView
from trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from trainer.config import RoleConfig
    from trainer.controller.cluster import Backend

__all__ = ["RewardRouter"]


class RewardRouter:
    """Scores trajectories on a ``RewardCluster`` (``specs``: its ``env.rewards`` entries, to
    name the scorer of a bad score)."""

    def __init__(self, cluster: Any, *, specs: list[dict[str, Any]] | None = None) -> None:
        self.cluster = cluster
        self.specs = [dict(s) for s in specs or []]

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
            ),
            specs=specs,
        )

    async def score(self, trajectory: Trajectory) -> None:
        """Add (or set) the reward workers' score to the episode's return; ``RewardError``
        naming the scorers when they raise or score a value training cannot hold."""
        view = EpisodeView(
            trajectory.env_id, list(trajectory.messages), dict(trajectory.info), trajectory.success
        )
        try:
            result = await self.cluster.score_async(view)
        except Exception as error:
            scorers = self.scorers_of(trajectory.env_id)
            raise RewardError(f"{scorers} raised {type(error).__name__}: {error}") from error
        if not result["matched"]:
            return
        score = float(result["score"])
        if not (math.isfinite(score) and abs(score) <= FLOAT32_MAX):
            raise RewardError(
                f"{self.scorers_of(trajectory.env_id)} scored {score!r}; a score must be a "
                "finite number within float32's range (training's tensors)"
            )
        base = sum(trajectory.turn_rewards)
        trajectory.final_reward = score - base if result["replace"] else score

    def scorers_of(self, env_id: str) -> str:
        """The ``env.rewards`` entries that score ``env_id``'s episodes, for a message."""
        from trainer.workers.reward import domain_matches

        named = [
            f"env.rewards[{i}] ({spec.get('kind')}"
            + (f" {spec['function']}" if spec.get("function") else "")
            + ")"
            for i, spec in enumerate(self.specs)
            if domain_matches(str(spec.get("domain", "*")), env_id)
        ]
        return ", ".join(named) or "env.rewards"

    def shutdown(self) -> None:
        self.cluster.shutdown()
