"""Rollout scheduler vs synchronous batched rollout on a heavy-tailed agentic workload.

    python benchmarks/rollout_scheduler.py            # vLLM (CPU or GPU) when installed, else hf
    python benchmarks/rollout_scheduler.py --engine hf --steps 4

Workload: half the groups play ``bench/heavy-tail``, whose turns per episode and tokens per
turn are log-normal (drawn from the task seed: the few long episodes dominate a synchronous
step), the other half a real game (``games/frozen-lake-v0``, 4x4, up to 12 turns of one-word
moves, ``--game-tokens`` tokens at most). A tiny
random Llama (head size 32, so vLLM's CPU kernels take it) generates; a real PPO/GRPO update
of the same model (``HFTrainStrategy``) runs after every batch and its weights are loaded
into the engine, so async rollouts really overlap real training. The update runs in a
process of its own (as the ``actor_train`` workers do in a run; on GPUs it has its own
device), so it does not share the rollout process's GIL; every mode uses it alike. One short
warm-up (1 batch of 2 groups) runs before the first mode, so no mode pays for start-up.

Workload parameters (defaults; all flags): 8 groups x 4 episodes per batch, 6 batches per
mode; ``bench/heavy-tail``: turns ~ LogNormal(median 3, sigma 0.9) clipped to 1..24, tokens
per turn ~ LogNormal(median 12, sigma 0.9) clipped to 1..96 (all 4 episodes of a group share
the task seed, hence the plan); frozen lake 4x4: up to 12 turns of up to 8 tokens; the
scheduler's redundancy 1.5.

Every mode plays the same number of training batches on the same engine, from the same
initial weights:

``batch``        plan the step's groups, play them all, wait for the last, train, sync
``sync``         ``RolloutScheduler`` on-policy: redundancy ``--redundancy``, the first groups
                 to finish make the batch, the surplus is aborted
``async-k``      rollouts continue during training, ``max_staleness = k`` (k = 1, 2)

It prints trajectories/s, the engine's idle fraction (share of wall time with no request in
flight) and the speedup over ``batch`` for each, and ends with ``speedup_vs_sync: X x``
(the best async setting over synchronous batching).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import envhub

HEAVY = "bench/heavy-tail"
GAME = "games/frozen-lake-v0"
GAME_KWARGS = {"action_format": "raw", "size": 4, "max_turns": 12}


class HeavyTailEnv(envhub.TextEnv):
    """Accepts any text; the task seed fixes the episode's turn count and per-turn token budgets
    (log-normal, clipped), handed to the env manager as ``info["max_new_tokens"]``."""

    def __init__(
        self,
        *,
        turns_median: float,
        turns_sigma: float,
        tokens_median: float,
        tokens_sigma: float,
        max_turns: int,
        max_tokens: int,
    ) -> None:
        super().__init__(max_turns=max_turns)
        self.params = (turns_median, turns_sigma, tokens_median, tokens_sigma)
        self.max_tokens = max_tokens
        self.plan: list[int] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[override]
        rng = random.Random(seed)
        turns_median, turns_sigma, tokens_median, tokens_sigma = self.params
        turns = min(
            self.max_turns or 1,
            max(1, round(rng.lognormvariate(math.log(turns_median), turns_sigma))),
        )
        self.plan = [
            min(
                self.max_tokens,
                max(1, round(rng.lognormvariate(math.log(tokens_median), tokens_sigma))),
            )
            for _ in range(turns)
        ]
        return super().reset(seed=seed, options=options)

    def on_reset(self, options: dict[str, Any]):
        return "Answer each message with anything.", {"max_new_tokens": self.plan[0]}

    def on_step(self, action: str) -> envhub.Turn:
        done = self.turn >= len(self.plan)
        reward = float(len(action) % 3 == 0) if done else 0.0
        budget = {} if done else {"max_new_tokens": self.plan[self.turn]}
        return envhub.Turn(f"Turn {self.turn} done.", reward=reward, terminated=done, info=budget)


class GameWithAnswerBudget:
    """A real game env whose turns are one-word answers: caps each turn at ``tokens`` tokens
    (through ``info["max_new_tokens"]``, like ``HeavyTailEnv``)."""

    def __init__(self, env: Any, tokens: int) -> None:
        self.env, self.tokens = env, tokens

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        messages, info = self.env.reset(seed=seed, options=options)
        return messages, {**info, "max_new_tokens": self.tokens}

    def step(self, action: str) -> Any:
        messages, reward, terminated, truncated, info = self.env.step(action)
        return messages, reward, terminated, truncated, {**info, "max_new_tokens": self.tokens}

    def close(self) -> None:
        self.env.close()


def build_model(folder: Path) -> Path:
    from trainer.models import build_policy, env_corpus

    if (folder / "config.json").is_file():
        return folder
    corpus = env_corpus(GAME, GAME_KWARGS, episodes=100) + [
        "Answer each message with anything.",
        "Turn 3 done.",
    ]
    return build_policy(
        folder,
        corpus,
        tokenizer_kind="bpe",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=128,
        max_positions=2048,
        seed=0,
    )


def make_engine(kind: str, path: Path) -> Any:
    if kind == "vllm":
        from trainer.strategies.vllm_engine import VLLMEngine

        # a big step budget: vLLM's CPU sampler cannot split the prefill of a seeded request
        # over steps ("CPU Generator does not use offset"), which many long concurrent prompts
        # would cause
        return VLLMEngine(
            str(path),
            seed=0,
            max_model_len=2048,
            kv_cache_gib=1.0,
            max_num_batched_tokens=65536,
            max_num_seqs=512,
        )
    import torch

    from trainer.models import load_policy
    from trainer.strategies.hf_engine import HFEngine

    model, tokenizer = load_policy(path)
    return HFEngine(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=0,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )


class Trainer:
    """A real GRPO/PPO step on the policy (one epoch over the batch), then its weights."""

    def __init__(self, path: Path, pad_token_id: int) -> None:
        import torch

        from trainer.config import LossConfig
        from trainer.models import load_policy
        from trainer.strategies.hf import HFTrainStrategy
        from trainer.workers.actor import ppo_loss_fn

        model, _ = load_policy(path)
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.strategy = HFTrainStrategy(
            model,
            lr=1e-4,
            micro_batch_size=16,
            device="cuda" if torch.cuda.is_available() else "cpu",
        )
        self.loss = ppo_loss_fn(LossConfig(clip_low=0.2, clip_high=0.28, agg_mode="token-mean"))
        self.pad = pad_token_id

    def reset(self) -> None:
        """Back to the initial weights and a fresh optimiser (every mode starts alike)."""
        self.strategy.model.load_state_dict(self.initial)
        if self.strategy.optimizer is not None:
            self.strategy.optimizer.state.clear()

    def step(self, trajectories: list[Any]) -> None:
        from trainer.algos.advantages import compute_advantages
        from trainer.rollout.collate import collate

        batch = collate(trajectories, self.pad)
        batch["advantages"], _ = compute_advantages(
            "grpo",
            response_mask=batch["response_mask"],
            token_rewards=batch["token_rewards"],
            scores=batch["scores"],
            group_ids=batch["group_ids"],
        )
        self.strategy.train_step(
            {
                k: batch[k]
                for k in (
                    "input_ids",
                    "attention_mask",
                    "response_mask",
                    "old_logprobs",
                    "advantages",
                )
            },
            self.loss,
        )

    def weights(self) -> dict[str, Any]:
        return {
            name: tensor.detach().cpu().clone() for name, tensor in self.strategy.full_weights()
        }


_TRAINER: Trainer | None = None


def _trainer_call(method: str, *args: Any) -> Any:
    """Runs in the trainer process: ``method`` of its ``Trainer`` (built on the first call)."""
    global _TRAINER
    if method == "init":
        import torch

        torch.set_num_threads(1)
        _TRAINER = Trainer(*args)
        return None
    if _TRAINER is None:
        raise RuntimeError("the trainer process got a call before 'init'")
    return getattr(_TRAINER, method)(*args)


class TrainerProcess:
    """``Trainer`` in a process of its own, as the ``actor_train`` workers are in a run: the
    update computes on its own core (its own device on GPUs) instead of contending with the
    rollout process's GIL. Every mode uses it the same way."""

    def __init__(self, path: Path, pad_token_id: int) -> None:
        import concurrent.futures
        import multiprocessing

        self.pool = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")
        )
        self._run("init", path, pad_token_id)

    def _run(self, method: str, *args: Any) -> Any:
        return self.pool.submit(_trainer_call, method, *args).result()

    def reset(self) -> None:
        self._run("reset")

    def step(self, trajectories: list[Any]) -> None:
        self._run("step", trajectories)

    def weights(self) -> dict[str, Any]:
        return self._run("weights")

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def workload_env(env_id: str, args: argparse.Namespace) -> Any:
    """One env of the workload: ``HEAVY`` (heavy-tailed turns and lengths) or the game
    (``rollout_scale.py`` shares it)."""
    if env_id == HEAVY:
        return HeavyTailEnv(
            turns_median=args.turns_median,
            turns_sigma=args.sigma,
            tokens_median=args.tokens_median,
            tokens_sigma=args.sigma,
            max_turns=args.max_turns,
            max_tokens=args.max_tokens,
        )
    return GameWithAnswerBudget(envhub.make(env_id, **GAME_KWARGS), args.game_tokens)


def worker_setup(args: argparse.Namespace, tokenizer: Any, engine: Any) -> tuple[Any, Any]:
    """An env worker's ``EnvManager`` and envs for ``rollout_scale.py --env-workers`` (built in
    the worker process, so it lives in an importable module rather than a script's ``__main__``)."""
    from trainer.rollout.env_manager import EnvManager, LocalEnvSource
    from trainer.rollout.trajectory import ChatRenderer

    manager = EnvManager(
        engine,
        ChatRenderer(tokenizer),
        max_turns=args.max_turns,
        max_context_tokens=args.max_context,
        generate_timeout_s=None,  # the worker's clock is real; the driver's router is simulated
    )
    return manager, LocalEnvSource(make=lambda env_id, **_: workload_env(env_id, args))


def make_scheduler(
    mode: str,
    groups: int,
    args: argparse.Namespace,
    env_ids: list[str],
    manager: Any,
    router: Any,
    source: Any,
    sampling: Any,
) -> Any:
    """The real scheduler for ``mode`` (``sync``, or ``async-K``: staleness bound K; either
    with ``@R``: redundancy R instead of ``--redundancy``) with the benchmark's group size
    (``rollout_scale.py`` shares it)."""
    from trainer.rollout.scheduler import RolloutScheduler, SchedulerConfig

    name, _, redundancy = mode.partition("@")
    k = int(name.split("-")[1]) if name.startswith("async") else 0
    return RolloutScheduler(
        SchedulerConfig(
            groups,
            args.group_size,
            tuple(env_ids),
            mode="async" if k else "sync",
            redundancy=float(redundancy) if redundancy else args.redundancy,
            max_staleness=k,
        ),
        manager,
        router,
        source,
        sampling,
    )


async def run_mode(
    mode: str, args: argparse.Namespace, engine: Any, trainer: Any, renderer: Any
) -> dict[str, float]:
    from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
    from trainer.rollout.groups import plan_groups, run_episodes
    from trainer.rollout.router import EngineRouter

    trainer.reset()
    engine.update_weights(trainer.weights())
    router = EngineRouter([engine])
    manager = EnvManager(router, renderer, max_turns=args.max_turns, max_context_tokens=2000)

    source = LocalEnvSource(make=lambda env_id, **kwargs: workload_env(env_id, args))
    sampling = Sampling(args.max_tokens)
    env_ids = [HEAVY, GAME]
    router.reset_totals()
    started = time.perf_counter()
    trained = 0
    staleness: list[int] = []
    discarded = {
        "stale_dropped_groups": 0.0,
        "stale_aborted_groups": 0.0,
        "aborted_surplus_episodes": 0.0,
    }
    if mode == "batch":
        for step in range(args.steps):
            specs = plan_groups(
                step, num_groups=args.groups, group_size=args.group_size, env_ids=env_ids, seed=0
            )
            finished, _ = await run_episodes(specs, manager, source, sampling)
            await asyncio.to_thread(trainer.step, finished)
            router.update_weights(trainer.weights())
            trained += len(finished)
            staleness += [0] * len(finished)
    else:
        scheduler = make_scheduler(
            mode, args.groups, args, env_ids, manager, router, source, sampling
        )
        try:
            for _ in range(args.steps):
                batch = await scheduler.next_batch()
                # a trajectory without policy tokens has no staleness (it used to count as
                # version 0)
                staleness += [
                    batch.version - t.oldest_version
                    for t in batch.trajectories
                    if t.oldest_version is not None
                ]
                for name in (
                    "stale_dropped_groups",
                    "stale_aborted_groups",
                    "aborted_surplus_episodes",
                ):
                    discarded[name] += batch.metrics[f"rollout/{name}"]
                # rollouts go on meanwhile (async)
                await asyncio.to_thread(trainer.step, batch.trajectories)
                await scheduler.update_weights(trainer.weights())
                trained += len(batch.trajectories)
        finally:
            await scheduler.close()
    wall = time.perf_counter() - started
    stats = router.totals()
    return {
        "trajectories": trained,
        "wall_s": wall,
        "traj_per_s": trained / wall,
        "engine_idle": 1.0 - stats.busy_fraction,
        "max_staleness_seen": max(staleness, default=0),
        "tokens": stats.new_tokens,
        **discarded,
    }


def _merge(total: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
    """Totals of a mode over rounds (rates from the summed counts; idle weighted by wall time)."""
    if total is None:
        return new
    merged = {
        k: total[k] + new[k]
        for k in new
        if k not in ("traj_per_s", "engine_idle", "max_staleness_seen")
    }
    merged["traj_per_s"] = merged["trajectories"] / merged["wall_s"]
    merged["engine_idle"] = (
        total["engine_idle"] * total["wall_s"] + new["engine_idle"] * new["wall_s"]
    ) / merged["wall_s"]
    merged["max_staleness_seen"] = max(total["max_staleness_seen"], new["max_staleness_seen"])
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    parser.add_argument("--steps", type=int, default=6, help="training batches per mode")
    parser.add_argument("--groups", type=int, default=8, help="groups per batch")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--redundancy", type=float, default=1.5)
    parser.add_argument("--turns-median", type=float, default=3.0)
    parser.add_argument("--tokens-median", type=float, default=12.0)
    parser.add_argument(
        "--sigma", type=float, default=0.9, help="log-normal sigma of turns and of tokens"
    )
    parser.add_argument(
        "--game-tokens", type=int, default=8, help="token cap per game turn (a one-word move)"
    )
    parser.add_argument("--max-turns", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--modes", default="batch,sync,async-1,async-2")
    parser.add_argument(
        "--model-dir", default=None, help="where the tiny model is built (default: a temp folder)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="play the modes this many times, every other round in reverse order (ABBA: a load "
        "that drifts during the run biases no mode); figures are totals over the rounds",
    )
    args = parser.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from trainer.rollout.trajectory import ChatRenderer

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    kind = args.engine
    if kind == "auto":
        try:
            import vllm  # noqa: F401

            kind = "vllm"
        except ImportError:
            kind = "hf"
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(args.model_dir or tmp) / "policy")
        tokenizer = AutoTokenizer.from_pretrained(path)
        renderer = ChatRenderer(tokenizer)
        engine = make_engine(kind, path)
        trainer = TrainerProcess(path, tokenizer.pad_token_id)
        print(
            f"engine={kind} steps={args.steps} batch={args.groups}x{args.group_size} "
            f"redundancy={args.redundancy} turns~LogN(median {args.turns_median}, s={args.sigma}) "
            f"tokens/turn~LogN(median {args.tokens_median}, s={args.sigma}) + {GAME}",
            flush=True,
        )
        results: dict[str, dict[str, float]] = {}
        try:
            # warm-up (first engine steps, first backward, allocator): not charged to the first mode
            asyncio.run(
                run_mode(
                    "batch",
                    argparse.Namespace(**{**vars(args), "steps": 1, "groups": 2}),
                    engine,
                    trainer,
                    renderer,
                )
            )
            modes = args.modes.split(",")
            for round_ in range(args.rounds):
                played: dict[str, dict[str, float]] = {}
                for mode in modes if round_ % 2 == 0 else modes[::-1]:
                    r = played[mode] = asyncio.run(run_mode(mode, args, engine, trainer, renderer))
                    results[mode] = _merge(results.get(mode), r)
                    base = (played.get("batch") or results.get("batch") or r)["traj_per_s"]
                    print(
                        f"{mode:>8}: {r['trajectories']:4d} traj in {r['wall_s']:7.2f} s = "
                        f"{r['traj_per_s']:6.2f} traj/s, {r['tokens'] / r['wall_s']:6.0f} tok/s, "
                        f"engine idle {100 * r['engine_idle']:5.1f}%, oldest trained token "
                        f"{r['max_staleness_seen']} versions behind, discarded: "
                        f"{r['aborted_surplus_episodes']:.0f} surplus episodes, "
                        f"{r['stale_aborted_groups']:.0f}+{r['stale_dropped_groups']:.0f} stale "
                        f"groups; speedup {r['traj_per_s'] / base:5.2f} x (round {round_ + 1}, "
                        f"load average {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
            if args.rounds > 1:
                for mode, r in results.items():
                    speedup = r["traj_per_s"] / results.get("batch", r)["traj_per_s"]
                    print(
                        f"{mode:>8}: all rounds {r['traj_per_s']:6.2f} traj/s, engine idle "
                        f"{100 * r['engine_idle']:5.1f}%, speedup {speedup:5.2f} x"
                    )
        finally:
            trainer.close()
            shutdown = getattr(engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
    asyncs = [m for m in results if m.startswith("async")]
    best = max(asyncs or list(results), key=lambda m: results[m]["traj_per_s"])
    base = results["batch"]["traj_per_s"] if "batch" in results else results[best]["traj_per_s"]
    print(f"speedup_vs_sync: {results[best]['traj_per_s'] / base:.2f} x")


if __name__ == "__main__":
    main()
