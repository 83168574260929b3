"""``AgenticPipeline``: the single controller's training loop, SFT warm start to final eval.

``fit()`` is the table of contents; every phase is a short method below it. Step 0 is the
warm-started policy before any RL update (evaluated, and checkpointed so ``--resume``
always has something to continue from); RL steps are numbered 1..``train.steps``.

Determinism: every episode's seed derives from ``(seed, step)``, the sampling RNG of each
inference rank, the actor's model/optimiser/RNG and the driver's RNG are checkpointed, so a
run resumed after ``kill -9`` produces the same next-step metrics as one never interrupted.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config import TrainerConfig, scheduled_lr
from trainer.controller.batch import Batch
from trainer.devices import PHASE_ROLES
from trainer.errors import NonFiniteLossError, WorkerCallError
from trainer.local_copies import check_local_copies
from trainer.metrics import MetricsLog, SignalWatch, plot_curves, run_summary
from trainer.roles import prepare_policy, start_roles
from trainer.rollout.collate import collate, episode_advantages
from trainer.rollout.env_manager import (
    HeldOutEnvSource,
    LocalEnvSource,
    PoolEnvSource,
    Sampling,
    check_held_out_builds,
)
from trainer.rollout.groups import EpisodeSpec, eval_failures, plan_eval
from trainer.rollout.rollouts import Rollouts
from trainer.rollout.trajectory import ChatRenderer, Trajectory
from trainer.strategies.vllm_platform import configured_max_model_len

if TYPE_CHECKING:
    from trainer.sft import SFTProgress
    from trainer.weights.sync import SyncReport

__all__ = ["AgenticPipeline"]

_log = logging.getLogger(__name__)
_STOPS = (
    ("rollouts", "close"),
    ("log", "close"),
    ("store", "close"),
    ("rewards", "shutdown"),
    ("roles", "shutdown"),
)
"""What ``AgenticPipeline.close`` stops, in order: ``(attribute, its stop method)``. The rollouts'
close aborts what still runs, closes envs and cancels tasks: its failures are only logged."""


def _quiet_libraries() -> None:
    """No per-load progress bars or advisory warnings of transformers in the run's output
    (in-process workers load models; Ray's get ``resources.QUIET_WORKERS``), nor vLLM's notice
    that Triton has no CPU backend (its tool parsers import it): that module alone, below ERROR."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


class AgenticPipeline:
    """One training run of ``config`` (see the module docstring)."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        resume: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_sft_step: SFTProgress | None = None,
    ) -> None:
        from trainer.checkpoint import CheckpointManager
        from trainer.folder_lock import FolderLock
        from trainer.resume import RUN_LOCK, refuse_unresumable, start_run

        self.cfg, self.resume, self.on_step = config, resume, on_step or (lambda metrics: None)
        self.on_sft_step = on_sft_step
        """Told ``(steps done, steps in all, NLL)`` after each warm-start batch (the CLI's bar)."""
        self.out = Path(config.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.run_lock = FolderLock(self.out, name=RUN_LOCK, setting="output_dir")
        """Held until ``close``: a second run on this folder is refused, naming this one's pid."""
        try:
            self.checkpoints = CheckpointManager(
                config.checkpoint_dir,
                keep=config.checkpoint.keep,
                run_id=start_run(self.out, config.checkpoint_dir, resume=resume),
            )
            if resume:  # refused before anything is built, as by ``envhub train --resume``
                refuse_unresumable(self.checkpoints.load(), config.model_dump(mode="json"))
        except BaseException:
            self.run_lock.release()
            raise
        _quiet_libraries()
        self.start_time, self.time_offset, self.step = time.monotonic(), 0.0, 0
        self.signal = SignalWatch(self.out, config.rollout.max_new_tokens)
        try:
            self._build(config)
        except BaseException as error:  # a notebook retries in this process: free what was built
            self.close(error=error)
            raise

    def _build(self, config: TrainerConfig) -> None:
        """Start the workers, then what drives them (weight sync, envs, rewards, sinks)."""
        check_local_copies(config, warm_start=not self.resume)  # with a hub: the hub's envs
        self.model_path = prepare_policy(config)
        self.renderer = self._renderer()
        self.file_demos = [] if self.resume else self._file_demos()  # refused before workers
        self.roles = start_roles(config, self.model_path)
        self.colocation: Any = None
        """``trainer.devices.Colocation`` switching colocated roles around phases (built on
        first use)."""
        from trainer.weights.sync import WeightSync

        lora = config.model.lora
        self.weight_sync = WeightSync.from_config(
            self.roles, config.weight_sync, adapters=lora is not None and lora.sync == "adapter"
        )
        self.envs = self._env_source()
        self.rewards = self._reward_router()
        from envhub.runs import TrajectoryWriter

        stored = config.logging.trajectories
        self.store = TrajectoryWriter(
            self.out,
            every=stored.every,
            sample=stored.sample,
            keep_last=stored.keep_last,
            seed=config.seed,
        )
        """The trajectory store (``envhub.runs``): written off this thread."""
        self.log = MetricsLog(
            self.out,
            tensorboard=config.logging.tensorboard,
            wandb=config.logging.wandb,
            wandb_project=config.logging.wandb_project,
            config=config.model_dump(mode="json"),
            run_id=self.checkpoints.run_id,
        )
        policy = self.weight_sync.policy  # the run's one policy version (its writer: the sync)
        self.rollouts = Rollouts(
            config,
            self.roles.infer.rank_engines(policy=policy, max_batches=config.rollout.rank_batches()),
            self.renderer,
            self.envs,
            max_context_tokens=self._context_limit(),
            on_episode_end=self.rewards.score if self.rewards else None,
            policy=policy,
            eval_envs=self._eval_env_source(),
            env_factory=self._env_factory(),
        )

    # ================================================================== the loop
    def fit(self) -> list[dict[str, Any]]:
        """Warm start, then rollout -> reference -> values -> advantages -> train -> sync -> log."""
        try:
            if self.resume:
                self.restore()
            else:
                self.end_step(self.step_zero(), checkpoint=True)
            for step in range(self.step + 1, self.cfg.train.steps + 1):
                timing: dict[str, float] = {}
                with self.phase("rollout", timing):
                    episodes, _ = self.rollouts.next_batch()  # (failures: rollout/*)
                batch = self.to_batch(episodes)
                with self.phase("reference", timing):
                    self.reference_logprobs(batch)
                with self.phase("values", timing):
                    self.values(batch)
                with self.phase("advantages", timing):
                    self.compute_advantages(batch)
                if self.store.due(step):
                    with self.phase("store", timing):
                        self.store_episodes("train", step, episodes, batch)
                with self.phase("train", timing):
                    losses = self.train_step(batch, step)
                with self.phase("sync", timing):
                    moved = self.sync_weights()
                self.step = step
                metrics = {
                    "step": step,
                    **run_summary(episodes, "train", self.cfg),
                    **losses,
                    **timing,
                    **moved,
                    **self.rollouts.last_metrics,
                }
                if self.eval_due(step):
                    with self.phase("eval", metrics):
                        metrics.update(self.evaluate())
                self.end_step(metrics, checkpoint=self.checkpoint_due(step))
            rows = self.finish()
        except BaseException as error:
            self.close(error=error)
            raise
        self.close()
        return rows

    # ================================================================== phases
    def step_zero(self) -> dict[str, Any]:
        """Step 0's row: the warm start and the evaluation of the policy it left, each timed."""
        row: dict[str, Any] = {"step": 0}
        with self.phase("sft", row):
            row.update(self.warm_start())
        with self.phase("eval", row, swap=False):  # as the warm start's weight sync left them
            row.update(self.evaluate())
        return row

    def to_batch(self, episodes: list[Trajectory]) -> Batch:
        algo = self.cfg.algorithm
        step_gamma = algo.gamma if algo.advantage_estimator == "gigpo" else None
        return Batch(
            collate(
                episodes,
                self.renderer.tokenizer.pad_token_id,
                step_gamma,
                mask_truncated=algo.mask_truncated,
            ),
            meta={"episodes": len(episodes)},
        )

    def reference_logprobs(self, batch: Batch) -> None:
        """Log-probs of the frozen reference (only when a KL term is on). With ``top_p < 1`` the
        actor recomputes the old log-probs: the loss uses full-vocabulary log-probs at
        ``rollout.temperature``, while vLLM's sampled ones are renormalised over the nucleus."""
        reference = self.roles.reference_logprobs(batch)
        if reference is not None:
            batch["ref_logprobs"] = reference
        if self.cfg.rollout.top_p != 1.0:
            batch["old_logprobs"] = self.roles.actor.compute_logprobs(batch)["logprobs"]
        self.rollouts.off_policy_correction(batch, self.roles.actor)  # async: IS weights

    def values(self, batch: Batch) -> None:
        """Critic values of every policy token (GAE only)."""
        if self.roles.critic is not None:
            batch["values"] = self.roles.critic.compute_values(batch)["values"]

    def compute_advantages(self, batch: Batch) -> None:
        from trainer.algos.advantages import batch_advantages

        advantages, returns = batch_advantages(batch, self.cfg.algorithm)
        batch["advantages"] = advantages
        if returns is not None:
            batch["returns"] = returns

    def train_step(self, batch: Batch, step: int) -> dict[str, float]:
        """Update the critic (GAE) and the policy; a NaN loss stops the run, nothing is applied;
        a batch with no token to train (every episode masked) steps nothing."""
        metrics: dict[str, float] = {}
        train = self.cfg.train
        if train.lr_schedule != "constant" or train.warmup_steps:  # (from the step: resume agrees)
            metrics["actor/lr"] = train.lr_at(step, self.cfg.policy_lr)
            self.roles.actor.set_lr(metrics["actor/lr"])
        if not bool(batch["response_mask"].any()):  # all masked (algorithm.mask_truncated)
            return {**metrics, "actor/optimizer_steps": 0.0}  # (zero gradients still move AdamW)
        try:
            if self.roles.critic is not None:
                metrics.update(self.roles.critic.train_step(batch))
            metrics.update(self.roles.actor.train_step(self._balanced(batch), train.ppo_epochs))
        except (NonFiniteLossError, WorkerCallError) as error:
            cause = error if isinstance(error, NonFiniteLossError) else error.__cause__
            if not isinstance(cause, NonFiniteLossError):
                raise
            latest = self.checkpoints.latest()
            raise NonFiniteLossError(
                f"step {step}: {cause}. Stopped; the last good checkpoint is {latest} "
                "(continue from it with --resume after changing the config)"
            ) from error
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """Copy the trained weights into the inference engines (bucketed full HF tensors, or
        LoRA adapters; version-checked) while the engines are paused; in-flight turns (async)
        resume under the new weights. Returns what moved (``sync/tensors``, ``sync/megabytes``)."""
        reports: list[SyncReport] = []
        self.rollouts.update_weights(lambda: reports.append(self.weight_sync.sync()))
        return reports[0].metrics() if reports else {}

    def eval_plan(self) -> list[EpisodeSpec]:
        """The fixed evaluation set (``eval.episodes`` shared out, per-env counts of a mix)."""
        env = self.cfg.env
        return plan_eval(self.cfg.eval.episodes, env_ids=env.ids, counts=env.eval_counts())

    def describe_eval(self) -> str:
        """What every evaluation plays, in one line (``envhub train`` prints it)."""
        from trainer.rollout.groups import describe_eval

        return describe_eval(self.eval_plan(), self.cfg.env.eval_kwargs())

    def evaluate(self) -> dict[str, float]:
        """The fixed evaluation set at ``eval.temperature`` (greedy by default)."""
        specs = self.eval_plan()
        sampling = Sampling(
            self.cfg.rollout.max_new_tokens, self.cfg.eval.temperature, self.cfg.rollout.top_p
        )
        episodes, failed = self.rollouts.play(specs, sampling)
        self.store_episodes("eval", self.step, episodes)
        return {**run_summary(episodes, "eval", self.cfg), **eval_failures(specs, episodes, failed)}

    def store_episodes(
        self, kind: str, step: int, episodes: list[Trajectory], batch: Batch | None = None
    ) -> None:
        """Queue ``episodes`` for the trajectory store (with their advantages when trained)."""
        advantages: list[Any] = [None] * len(episodes)
        if batch is not None:
            advantages = episode_advantages(episodes, batch["advantages"])
        now = self.elapsed
        self.store.write(
            kind, step, [t.as_record(a, now) for t, a in zip(episodes, advantages, strict=True)]
        )

    def warm_start(self) -> dict[str, float]:
        """Behaviour cloning on expert or file demonstrations (``sft.epochs`` passes)."""
        sft = self.cfg.sft
        if sft.epochs == 0:
            return {}
        from trainer import sft as demos

        if sft.source == "file":
            data = self.file_demos or self._file_demos()
        else:
            data = demos.configured_expert_demos(self.cfg, self.renderer)
            demos.write_jsonl(data, self.out / "sft_demos.jsonl")
        lr, pad = sft.lr or self.cfg.policy_lr, self.renderer.tokenizer.pad_token_id

        def train(chunk: list[Trajectory], step: int, total: int) -> dict[str, float]:
            rate = scheduled_lr(
                step,
                total,
                lr,
                sft.lr_schedule,
                min_ratio=sft.min_lr_ratio,
                warmup=sft.warmup_steps,
            )
            return self.roles.actor.sft_step(Batch(collate(chunk, pad)), rate)

        stats = demos.clone(
            data,
            train,
            epochs=sft.epochs,
            batch_size=sft.batch_size,
            seed=self.cfg.seed,
            on_step=self.on_sft_step,
        )
        self.roles.actor.set_lr(self.cfg.policy_lr)
        self.roles.adopt_warm_start(reset_optimizer=sft.reset_optimizer)  # the KL anchor
        self.sync_weights()
        return {
            **stats,
            "sft/demos": float(len(data)),
            "sft/demo_success": sum(t.success for t in data) / len(data),
        }

    # ================================================================== bookkeeping
    def eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    @property
    def elapsed(self) -> float:
        return self.time_offset + time.monotonic() - self.start_time

    def end_step(self, metrics: dict[str, Any], *, checkpoint: bool) -> None:
        """Save the step's checkpoint if due (timed: ``timing/checkpoint_s``), then log its row,
        which the checkpoint holds too: a run killed between the two gets it back (``restore``)."""
        if checkpoint:
            with self.phase("checkpoint", metrics):
                self.save_checkpoint(row=metrics)
        self.log_step(metrics)

    def log_step(self, metrics: dict[str, Any]) -> None:
        metrics = {"step": metrics["step"], "time_s": round(self.elapsed, 3), **metrics}
        self.log.write(metrics)
        self.on_step(metrics)
        warning = self.signal.observe(metrics)
        if warning:
            _log.warning(warning)

    @contextlib.contextmanager
    def phase(self, name: str, timing: dict[str, Any], *, swap: bool = True) -> Iterator[None]:
        """Time a phase; around colocated roles (``swap``), offload the others and reload the
        ones used."""
        self._swap_in(PHASE_ROLES.get(name, ()) if swap else ())
        started = time.monotonic()
        yield
        timing[f"timing/{name}_s"] = round(time.monotonic() - started, 4)

    def save_checkpoint(self, row: dict[str, Any] | None = None) -> Path:
        self.store.flush()  # a resume from it plays no step it covers: their episodes first
        states: dict[str, Any] = {
            "actor": self.roles.actor.state_dict(),
            "engine": {"ranks": self.roles.infer.get_state(), "version": self.weight_sync.version},
        }
        if self.roles.critic is not None:
            states["critic"] = self.roles.critic.state_dict()
        if self.roles.reference is not None and self.cfg.sft.epochs > 0:
            states["reference"] = self.roles.reference.get_weights()
        return self.checkpoints.save(
            self.step,
            states=states,
            seeds={"seed": self.cfg.seed, "next_step": self.step + 1},
            extra={"time_s": self.elapsed, "row": json.dumps(row), **self.rollouts.state_dict()},
            config=self.cfg.model_dump(mode="json"),
        )

    def restore(self) -> None:
        """Continue from the latest checkpoint: weights, optimiser, sampling RNGs, step, clock.
        Settings a saved state cannot be loaded with are refused first (``trainer.resume``)."""
        from trainer.checkpoint import restore_rng
        from trainer.resume import refuse_unresumable, write_run_id

        checkpoint = self.checkpoints.load()
        if self.checkpoints.run_id is None and checkpoint.run_id is not None:
            self.checkpoints.run_id = checkpoint.run_id  # a run.json-less folder adopts its run
            write_run_id(self.out, checkpoint.run_id)
        engine = checkpoint.load_state("engine")
        refuse_unresumable(
            checkpoint,
            self.cfg.model_dump(mode="json"),
            engine_ranks=(len(engine["ranks"]), self.roles.infer.world_size),
        )
        # first: the sync below starts async rollouts from this counter
        self.rollouts.load_state_dict(checkpoint.extra, step=checkpoint.step)
        self.roles.actor.load_state_dict(checkpoint.load_state("actor"))
        if self.roles.critic is not None:
            self.roles.critic.load_state_dict(checkpoint.load_state("critic"))
        if self.roles.reference is not None and "reference" in checkpoint.state_names:
            self.roles.reference.load_weights(checkpoint.load_state("reference"))
        # the re-sync below is the next version
        self.weight_sync.policy.restore(int(engine.get("version", 0)))
        self.roles.infer.set_state(engine["ranks"])  # sampling RNGs, before async rollouts start
        self.sync_weights()
        restore_rng(checkpoint.rng)
        self.step, self.time_offset = checkpoint.step, float(checkpoint.extra.get("time_s", 0.0))
        kept = self.log.truncate_after(self.step)
        row = json.loads(checkpoint.extra.get("row", "null"))  # (end_step)
        if row and all(line.get("step") != self.step for line in kept):  # killed before logging it
            self.log.write({"step": self.step, "time_s": self.time_offset, **row})
        self.store.truncate_after(self.step)

    def finish(self) -> list[dict[str, Any]]:
        """The reward curve PNG and the final policy folder; returns every metrics row."""
        rows = self.log.read()
        plot_curves(
            rows,
            self.out / "reward_curve.png",
            title=f"envhub train: {', '.join(self.cfg.env.ids)}",
        )
        self.roles.actor.save_pretrained(str(self.out / "final_policy"))
        if self.cfg.model.chat_template:  # the template it was trained with, for who serves it
            self.renderer.tokenizer.save_pretrained(self.out / "final_policy")
        return rows

    def close(self, *, error: BaseException | None = None) -> None:
        """Stop everything the run started, each part even when another fails to stop; then
        release its folders to the next run. After a build that failed part-way, what was not
        built yet is skipped. ``error``: the one stopping the run, which a failing stop must not
        replace (it is logged then); otherwise the first failure is raised once all stopped."""
        built = vars(self)
        stops = [
            (name, getattr(built[name], method))
            for name, method in _STOPS
            if built.get(name) is not None
        ]
        first: Exception | None = None
        try:
            for name, stop in stops:
                try:
                    stop()
                except Exception as failure:  # noqa: BLE001 - the next parts still stop
                    if error is None and first is None and name != "rollouts":
                        first = failure  # (raised below)
                    else:
                        _log.error("closing the run's %s failed", name, exc_info=failure)
        finally:
            self.checkpoints.close()
            self.run_lock.release()
        if first is not None:
            raise first

    # ================================================================== helpers
    def _balanced(self, batch: Batch) -> Batch:
        """With ``train.micro_batch_tokens``, the batch reordered so that each data-parallel
        trainer rank gets about the same number of tokens (a train step's metrics do not depend
        on the order); as it is otherwise."""
        ranks = self.roles.actor.world_size
        if self.cfg.train.micro_batch_tokens is None or ranks == 1:
            return batch
        return batch.balanced(ranks, batch["attention_mask"].sum(-1).tolist())

    def _swap_in(self, roles: tuple[str, ...]) -> None:
        """Make ``roles`` resident; colocated roles offload what their ``offload_params`` /
        ``offload_optimizer`` flags say (``trainer.devices.Colocation``; the vLLM engine sleeps,
        dropping its KV cache). Moves are real on GPUs and tracked no-ops on CPU."""
        plan = self.cfg.device_plan
        if (
            not roles
            or not any(g.colocated for g in plan.groups)
            or self.rollouts.overlaps_training
        ):
            # rollouts that run during training (async) keep colocated roles resident together
            return
        if self.colocation is None:
            from trainer.devices import Colocation

            clusters = {
                "actor_train": self.roles.actor,
                "actor_infer": self.roles.infer,
                "reference": self.roles.reference,
                "critic": self.roles.critic,
            }
            self.colocation = Colocation(plan, {r: c for r, c in clusters.items() if c is not None})
        self.colocation.activate(*[r for r in roles if r in self.colocation.members])

    def _renderer(self) -> ChatRenderer:
        from trainer.models import load_tokenizer

        tokenizer = load_tokenizer(self.model_path, chat_template=self.cfg.model.chat_template)
        rollout = self.cfg.rollout
        return ChatRenderer(tokenizer, rollout.tool_parser, rollout.max_tool_calls)

    def _file_demos(self) -> list[Trajectory]:
        """``sft.path``'s demonstrations when the warm start reads a file (else none), each
        within the model's context and the devices' memory: read before any worker starts, so
        a bad line or a demonstration too long to train costs no setup."""
        sft = self.cfg.sft
        if sft.epochs == 0 or sft.source != "file":
            return []
        from trainer.sft import load_demo_file

        return load_demo_file(self.cfg, self.renderer, max_tokens=self._context_limit())

    def _context_limit(self) -> int:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path)
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        positions = int(limit) if limit else 2048
        return min(positions, configured_max_model_len(self.cfg) or positions)

    def _env_source(self, mix: dict[str, dict[str, Any]] | None = None) -> Any:
        """Where episodes' envs come from; ``mix``: per-env kwargs (default: the entries')."""
        return self._env_factory(mix)()

    def _env_factory(self, mix: dict[str, dict[str, Any]] | None = None) -> Callable[[], Any]:
        """A picklable callable that builds the run's env source (``_env_source``): what each
        env worker process (``rollout.env_workers``) builds its own from."""
        env = self.cfg.env
        if env.hub is not None:  # (env kwargs with a remote hub are refused by config.problems())
            return functools.partial(LocalEnvSource, hub=env.hub, token=env.token)
        timeout = self.cfg.rollout.env_timeout_s
        if mix is None:
            mix = {entry.id: entry.kwargs for entry in env.entries if entry.kwargs}
        if env.pool_workers > 0:
            return functools.partial(
                PoolEnvSource,
                env.kwargs,
                num_workers=env.pool_workers,
                step_timeout_s=timeout or 30.0,
                kwargs_by_env=mix,
            )
        # threads: a blocking step can then time out
        return functools.partial(
            LocalEnvSource, env.kwargs, threaded=timeout is not None, kwargs_by_env=mix
        )

    def _eval_env_source(self) -> Any:
        """The evaluation's envs when some env has held-out settings (``eval: {kwargs}``)."""
        held_out = self.cfg.env.eval_kwargs()
        if not held_out or self.cfg.env.hub is not None:
            return None
        shared = self.cfg.env.kwargs
        check_held_out_builds({e: {**shared, **kw} for e, kw in held_out.items()}, self.cfg.env.ids)
        return HeldOutEnvSource(self.envs, self._env_source(held_out), set(held_out))

    def _reward_router(self) -> Any:
        if not self.cfg.env.rewards:
            return None
        from trainer.rewards.router import RewardRouter

        return RewardRouter.from_config(
            self.cfg.env.rewards, self.cfg.roles.reward, backend=self.cfg.cluster.backend
        )
