"""``ScheduledRollouts``: the training pipeline's rollout side when ``rollout.mode`` is
``sync`` or ``async`` (``batch`` keeps the plain ``run_episodes`` path).

It owns an event loop in a background thread (``LoopThread``), an ``EngineRouter`` over one
engine per ``actor_infer`` rank (least-loaded, sticky per episode, real aborts), an
``EnvManager`` on that router, and the ``RolloutScheduler``. The pipeline's thread stays
blocking and simple: ``next_batch()`` waits for a batch while, in ``async`` mode, the loop
thread keeps playing episodes during the train phase; ``update_weights(load)`` pauses the
router, preempts in-flight turns, runs the weight sync, and lets them resume.

Off-policy correction (``async``): the log-probs the engine sampled with are the *behaviour*
policy's (each token's version is recorded). By default (``rollout.is_truncation: null``) the
PPO ratio is taken against them: ``pi_train / pi_behaviour`` is itself the importance ratio
of the off-policy gap, and PPO's clip truncates it, so a token one or two versions stale
cannot move the policy further than the trust region around the policy that sampled it.
With ``rollout.is_truncation`` set, the decoupled form is used instead: the ratio is taken
against the policy at the start of this step (recomputed, the "proximal" policy) and every
token's loss is weighted by ``min(pi_prox / pi_behaviour, is_truncation)`` (column
``is_weights``). Measured on the quickstart (benchmarks/README.md, 2026-11-30): the default
learns like batch mode, the decoupled form stalls at train success ~0.25 on all 3 seeds tried
(with the importance weights forced to 1 it stalls too, so re-anchoring the clip at the
proximal policy is what loses the stabilising trust region at this learning rate). With
``temperature`` or ``top_p`` other than 1 the engine's log-probs are not the policy's, so the
pipeline recomputes them (as in ``batch`` mode) and no correction is added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainer.rollout.env_manager import EnvManager, EnvSource, Sampling
from trainer.rollout.groups import EpisodeSpec, run_episodes
from trainer.rollout.router import EngineRouter
from trainer.rollout.scheduler import LoopThread, RolloutScheduler, SchedulerConfig
from trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from trainer.config import TrainerConfig
    from trainer.controller.batch import Batch

__all__ = ["ScheduledRollouts"]


class ScheduledRollouts:
    """Scheduler, router and loop thread of one training run (see the module docstring)."""

    def __init__(self, cfg: TrainerConfig, engines: list[Any], manager: EnvManager, envs: EnvSource) -> None:
        self.cfg = cfg
        self.thread = LoopThread()
        self.router = EngineRouter(engines)
        self.manager = EnvManager(self.router, manager.renderer, max_turns=manager.max_turns,
                                  max_context_tokens=manager.max_context_tokens, on_episode_end=manager.on_episode_end,
                                  step_timeout_s=cfg.rollout.env_timeout_s)
        self.envs = envs
        rollout, env = cfg.rollout, cfg.env
        self.scheduler = RolloutScheduler(
            SchedulerConfig(num_groups=env.num_groups, group_size=env.group_size, env_ids=tuple(env.ids), seed=cfg.seed,
                            mode="async" if rollout.mode == "async" else "sync", redundancy=rollout.redundancy,
                            max_staleness=rollout.max_staleness, dynamic_sampling=rollout.dynamic_sampling),
            self.manager, self.router, envs, Sampling(rollout.max_new_tokens, rollout.temperature, rollout.top_p),
            first_group=env.num_groups)  # = plan_groups(step=1): sync mode plays batch mode's tasks, step by step
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def for_roles(cls, cfg: TrainerConfig, roles: Any, manager: EnvManager, envs: EnvSource) -> ScheduledRollouts:
        """One engine per ``actor_infer`` rank of a run's ``Roles``."""
        return cls(cfg, roles.infer.rank_engines(), manager, envs)

    # ------------------------------------------------------------------ the pipeline's calls
    def next_batch(self) -> tuple[list[Trajectory], list[Trajectory]]:
        """The next training batch ``(trajectories, failed)``; metrics in ``last_metrics``."""
        batch = self.thread.run(self.scheduler.next_batch())
        self.last_metrics = dict(batch.metrics)
        return batch.trajectories, batch.failed

    def play(self, specs: list[EpisodeSpec], sampling: Sampling) -> tuple[list[Trajectory], list[Trajectory]]:
        """Play fixed episodes (evaluation) on the same engines, next to running rollouts."""
        return self.thread.run(run_episodes(specs, self.manager, self.envs, sampling))

    def update_weights(self, load: Callable[[], Any]) -> None:
        """Run ``load`` (the weight sync) with the engines paused and idle; in-flight turns resume after."""
        paused = self.thread.run(self.scheduler.update_weights(load))
        self.last_metrics["rollout/weight_pause_s"] = round(paused, 4)

    def off_policy_correction(self, batch: Batch, actor: Any) -> None:
        """``async`` with ``rollout.is_truncation`` set: recompute ``old_logprobs`` with the current
        (proximal) policy and add truncated ``is_weights``; otherwise the behaviour log-probs stay the
        PPO anchor (see the module docstring)."""
        rollout = self.cfg.rollout
        if rollout.mode != "async" or rollout.is_truncation is None:
            return
        if rollout.temperature != 1.0 or rollout.top_p != 1.0:
            return  # the pipeline already recomputed old_logprobs; sampled log-probs are not the policy's
        import torch

        behaviour, mask = batch["old_logprobs"], batch["response_mask"]
        proximal = actor.compute_logprobs(batch)["logprobs"]
        ratio = torch.exp((proximal - behaviour) * mask)
        batch["old_logprobs"] = proximal
        batch["is_weights"] = ratio.clamp(max=rollout.is_truncation)
        tokens = mask.sum().clamp(min=1.0)
        self.last_metrics["rollout/is_weight_mean"] = float((ratio * mask).sum() / tokens)
        self.last_metrics["rollout/is_truncated_frac"] = float(((ratio > rollout.is_truncation) * mask).sum() / tokens)

    def state_dict(self) -> dict[str, int]:
        """The next task number (kept in the checkpoint so a resumed run plays new tasks).

        What a resume keeps: weights, optimiser, engine RNG and step (the pipeline) and this
        counter. ``sync``: no group is in play at a checkpoint, so a resumed run plays the
        same tasks as an uninterrupted one. ``async``: the groups in play at the checkpoint
        (already numbered, mostly the next batch) are lost, not replayed: the resumed run
        starts fresh groups from the counter under the restored weights, so its first
        batch is on-policy (staleness 0) where the uninterrupted run's was one version
        behind, and the runs are not bit-identical. No group is ever trained twice (numbers
        only grow) and nothing waits for the lost groups."""
        return {"rollout_next_group": self.scheduler.next_group}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the task counter of a checkpoint (groups already in play are dropped)."""
        if "rollout_next_group" in state:
            self.thread.run(self.scheduler.restart_from(int(state["rollout_next_group"])))

    def close(self) -> None:
        """Abort what still runs, close envs and engine front-ends, stop the loop thread."""
        try:
            self.thread.run(self.scheduler.close(), timeout=60)
            self.thread.run(self.router.close(), timeout=60)
            self.thread.run(self.envs.aclose(), timeout=60)
        finally:
            self.thread.close()
