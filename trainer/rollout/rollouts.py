"""``Rollouts``: every episode a training run plays, in every ``rollout.mode``, on one path.

The pipeline's phases call only this object: ``next_batch()`` (the training batch),
``play(specs)`` (the evaluation set), ``update_weights(load)``, ``off_policy_correction``,
``state_dict``/``load_state_dict`` and ``close``. Underneath, for every mode:

    LoopThread (event loop in a background thread)
      -> RolloutScheduler (groups, failures, filters, staleness; ``trainer.rollout.scheduler``)
      -> EnvManager (one episode: template, generate, step; ``trainer.rollout.env_manager``),
         or with ``rollout.agent`` the AgentRunner: the user's agent plays through the
         OpenAI-compatible proxy (``trainer.rollout.agents``, ``trainer.rollout.proxy``)
      -> EngineRouter over one RankEngine per ``actor_infer`` rank (``trainer.rollout.router``)

``batch`` and ``sync`` are the scheduler's on-policy mode: a step's ``num_groups`` groups
start together, the batch is taken when they have all finished, weights change only between
batches (``sync`` may add redundancy and dynamic sampling; ``batch`` forbids them). The tasks
are ``plan_groups``' step by step, because the scheduler numbers groups from step 1's first.
A group whose episode still fails after its replays is replaced by the next task. ``async``
keeps playing while the trainer trains (``rollout.max_staleness``).

The pipeline's thread stays blocking and simple: ``next_batch()`` waits for a batch while, in
``async`` mode, the loop thread keeps playing episodes during the train phase;
``update_weights(load)`` pauses the router, preempts in-flight turns, runs the weight sync,
and lets them resume.

Off-policy correction (``async``): the log-probs the engine sampled with are the *behaviour*
policy's (each token's version is recorded). By default (``rollout.is_truncation: null``) the
PPO ratio is taken against them: ``pi_train / pi_behaviour`` is itself the importance ratio
of the off-policy gap, and PPO's clip truncates it, so a token one or two versions stale
cannot move the policy further than the trust region around the policy that sampled it.
With ``rollout.is_truncation`` set, the decoupled form is used instead: the ratio is taken
against the policy at the start of this step (recomputed, the "proximal" policy) and every
token's loss is weighted by ``min(pi_prox / pi_behaviour, is_truncation)`` (column
``is_weights``); benchmarks/README.md records how the two compare on the quickstart.

Both hold at any ``rollout.temperature``: the trainer takes its log-probs under
``softmax(logits / temperature)`` (``trainer.strategies.base.ForwardOutput``), the distribution
the engines sample from and report log-probs of. ``top_p < 1`` is the exception: the loss uses
full-vocabulary log-probs at the temperature and does not model the nucleus (tokens outside it
are never sampled, so never credited: the usual approximation), and vLLM reports log-probs
renormalised over the nucleus, so the pipeline recomputes ``old_logprobs`` with the current actor
and no correction is added: a stale token's ratio starts at 1, and PPO's clip no longer bounds
the step away from the policy that sampled it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from trainer.rollout.agents import AgentRunner
from trainer.rollout.env_manager import EnvManager, EnvSource, Sampling
from trainer.rollout.env_workers import EnvWorkers, ManagerSetup
from trainer.rollout.groups import EpisodeSpec, run_episodes
from trainer.rollout.proxy import AgentProxy
from trainer.rollout.router import EngineRouter, RolloutEngine
from trainer.rollout.scheduler import LoopThread, RolloutScheduler, SchedulerConfig
from trainer.rollout.trajectory import ChatRenderer, Trajectory
from trainer.rollout.worker_routing import EngineSetup, WorkerRouters
from trainer.weights.versioned import PolicyVersion

if TYPE_CHECKING:
    from trainer.config import TrainerConfig
    from trainer.controller.batch import Batch

__all__ = ["Rollouts"]


class Rollouts:
    """Scheduler, router and loop thread of one training run (see the module docstring)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        engines: Sequence[RolloutEngine],
        renderer: ChatRenderer,
        envs: EnvSource,
        *,
        max_context_tokens: int,
        on_episode_end: Callable[[Trajectory], Any] | None = None,
        policy: PolicyVersion | None = None,
        eval_envs: EnvSource | None = None,
        env_factory: Callable[[], EnvSource] | None = None,
    ) -> None:
        """``policy``: the run's version (``WeightSync.policy``), read by the router, the engines
        and the scheduler's staleness bound; None: the router counts the updates through it.
        ``eval_envs``: where evaluation episodes play (held-out env settings); None: ``envs``.
        ``env_factory``: builds an env source like ``envs`` in each env worker process
        (``rollout.env_workers``; picklable, e.g. a ``functools.partial`` of the source class)."""
        self.cfg = cfg
        self.eval_envs = eval_envs if eval_envs is not None else envs
        self.thread = LoopThread()
        self.router = EngineRouter(
            engines, policy=policy, pause_timeout_s=cfg.rollout.pause_timeout_s
        )
        rollout = cfg.rollout
        self.proxy: AgentProxy | None = None
        self.manager: EnvManager
        if rollout.agent is not None:  # a black-box agent plays, through the proxy
            self.proxy = AgentProxy(
                self.router,
                renderer,
                max_turns=rollout.max_turns,
                max_context_tokens=max_context_tokens,
                step_timeout_s=rollout.env_timeout_s,
                model_name=rollout.agent.model_name,
                host=rollout.agent.host,
                port=rollout.agent.port,
                limits=rollout.agent.limits,
            )
            self.manager = AgentRunner(
                self.proxy,
                rollout.agent,
                on_episode_end=on_episode_end,
                step_timeout_s=rollout.env_timeout_s,
            )
            self.thread.run(self.proxy.start())
        else:
            self.manager = EnvManager(
                self.router,
                renderer,
                max_turns=rollout.max_turns,
                max_context_tokens=max_context_tokens,
                on_episode_end=on_episode_end,
                step_timeout_s=rollout.env_timeout_s,
                generate_timeout_s=rollout.generate_timeout_s,
                sample_unit=rollout.sample_unit,
                context=rollout.context,
                context_turns=rollout.context_turns,
            )
        self.envs = envs
        self.workers: EnvWorkers | None = None
        """``rollout.env_workers``: the processes that play training episodes."""
        self.routing: WorkerRouters | None = None
        """``rollout.route_in_workers``: the workers' routers, as the scheduler sees them."""
        if rollout.env_workers:
            if env_factory is None or not isinstance(self.manager, EnvManager):
                raise ValueError(
                    "rollout.env_workers needs the built-in env manager and an env_factory"
                )
            if rollout.route_in_workers:
                self.routing = WorkerRouters(
                    _worker_engines(engines),
                    len(engines),
                    policy=policy,
                    alongside=self.router,  # evaluation episodes pause with the workers'
                    pause_timeout_s=rollout.pause_timeout_s,
                )
            self.workers = EnvWorkers(
                self.routing or self.router,
                ManagerSetup(
                    renderer.tokenizer,
                    renderer.tool_parser_name,
                    renderer.max_tool_calls,
                    self.manager.options(),
                    env_factory,
                ),
                workers=rollout.env_workers,
                on_episode_end=on_episode_end,
            )
            self.thread.run(self.workers.start())
        self.scheduler = RolloutScheduler(
            SchedulerConfig.from_config(cfg),
            self.workers or self.manager,
            self.routing or self.router,
            envs,
            Sampling(rollout.max_new_tokens, rollout.temperature, rollout.top_p),
            first_group=cfg.env.num_groups,
        )  # = plan_groups(step=1): the scheduler plays step 1's tasks first
        self.last_metrics: dict[str, float] = {}

    @property
    def overlaps_training(self) -> bool:
        """Episodes keep playing while the trainer trains (``async``), so colocated roles
        cannot swap."""
        return self.scheduler.cfg.mode == "async"

    # ------------------------------------------------------------------ the pipeline's calls
    def next_batch(self) -> tuple[list[Trajectory], list[Trajectory]]:
        """The next training batch ``(trajectories, failed)``; metrics in ``last_metrics``."""
        batch = self.thread.run(self.scheduler.next_batch())
        self.last_metrics = dict(batch.metrics)
        return batch.trajectories, batch.failed

    def play(
        self, specs: list[EpisodeSpec], sampling: Sampling
    ) -> tuple[list[Trajectory], list[Trajectory]]:
        """Play fixed episodes (evaluation) on the same engines, next to running rollouts, on
        the evaluation envs."""
        return self.thread.run(run_episodes(specs, self.manager, self.eval_envs, sampling))

    def update_weights(self, load: Callable[[], Any]) -> None:
        """Run ``load`` (the weight sync) with the engines paused and idle; in-flight turns
        resume after it."""
        paused = self.thread.run(self.scheduler.update_weights(load))
        self.last_metrics["timing/weight_pause_s"] = round(paused, 4)

    def off_policy_correction(self, batch: Batch, actor: Any) -> None:
        """``async`` with ``rollout.is_truncation`` set: recompute ``old_logprobs`` with the
        current (proximal) policy and add truncated ``is_weights``; otherwise the behaviour
        log-probs stay the PPO anchor. Both at any temperature, with ``top_p`` 1 (see the module
        docstring)."""
        rollout = self.cfg.rollout
        if rollout.mode != "async" or rollout.is_truncation is None:
            return
        if rollout.top_p != 1.0:
            # the pipeline already recomputed old_logprobs: the sampled ones are not comparable
            return
        import torch

        behaviour, mask = batch["old_logprobs"], batch["response_mask"]
        proximal = actor.compute_logprobs(batch)["logprobs"]
        ratio = torch.exp((proximal - behaviour) * mask)
        batch["old_logprobs"] = proximal
        batch["is_weights"] = ratio.clamp(max=rollout.is_truncation)
        tokens = mask.sum().clamp(min=1.0)
        self.last_metrics["rollout/is_weight_mean"] = float((ratio * mask).sum() / tokens)
        self.last_metrics["rollout/is_truncated_frac"] = float(
            ((ratio > rollout.is_truncation) * mask).sum() / tokens
        )

    def state_dict(self) -> dict[str, int]:
        """The next task number (kept in the checkpoint so a resumed run plays new tasks).

        What a resume keeps: weights, optimiser, engine RNG and step (the pipeline) and this
        counter. ``batch``/``sync``: no group is in play at a checkpoint, so a resumed run plays
        the same tasks as an uninterrupted one. ``async``: the groups in play at the checkpoint
        (already numbered, mostly the next batch) are lost, not replayed: the resumed run
        starts fresh groups from the counter under the restored weights, so its first
        batch is on-policy (staleness 0) where the uninterrupted run's was one version
        behind, and the runs are not bit-identical. No group is ever trained twice (numbers
        only grow) and nothing waits for the lost groups."""
        return {"rollout_next_group": self.scheduler.next_group}

    def load_state_dict(self, state: dict[str, Any], *, step: int) -> None:
        """Continue the task counter of a checkpoint taken after ``step`` (groups already in play
        are dropped). A checkpoint without the counter (written by ``batch`` mode before it ran
        on the scheduler) continues where ``plan_groups`` would: step ``step + 1``'s first group,
        which also sets the envs' quotas of the next batch, as in the uninterrupted run."""
        window = (step + 1) * self.cfg.env.num_groups
        next_group = int(state.get("rollout_next_group", window))
        self.thread.run(self.scheduler.restart_from(next_group, window=window))

    def close(self) -> None:
        """Abort what still runs, close envs and engine front-ends, stop the loop thread. Each
        step runs (within 60 s) even when one before it failed or timed out; the first error
        is raised once all have run."""
        steps: list[Callable[[], Any]] = [self.scheduler.close]
        if self.workers is not None:
            steps.append(self.workers.close)
        if self.proxy is not None:
            steps.append(self.proxy.aclose)
        steps += [self.router.close, self.envs.aclose]
        if self.eval_envs is not self.envs:
            steps.append(self.eval_envs.aclose)
        errors: list[BaseException] = []
        try:
            for step in steps:
                try:
                    self.thread.run(step(), timeout=60)
                except TimeoutError:  # the step may still run: the loop's close cancels it
                    name = getattr(step, "__qualname__", repr(step))
                    errors.append(TimeoutError(f"{name} did not finish within 60 s"))
                except Exception as error:  # noqa: BLE001 - the next steps still run
                    errors.append(error)
        finally:
            self.thread.close()
        if errors:
            raise errors[0]


def _worker_engines(engines: Sequence[RolloutEngine]) -> EngineSetup:
    """The env workers' own engines over the same ``actor_infer`` ranks as ``engines`` (the
    driver's ``RankEngine`` s of a Ray ``InferCluster``)."""
    from trainer.workers.infer import RankEngine

    first = engines[0] if engines else None
    if not isinstance(first, RankEngine) or not all(isinstance(e, RankEngine) for e in engines):
        raise ValueError(
            "rollout.route_in_workers needs the run's actor_infer workers (one RankEngine per "
            "rank, on cluster.backend: ray)"
        )
    return first.cluster.worker_engines(max_batch_size=first.max_batch_size)
