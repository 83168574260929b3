"""The rollout scheduler at cluster scale: the real scheduler, router and env managers over
simulated H200 engines (SIMULATED GPU time; the driver's own CPU is real).

    python benchmarks/rollout_scale.py                  # 1k/8, 10k/64, 50k/64 engines (long)
    python benchmarks/rollout_scale.py --scales 1000:8:4
    python benchmarks/rollout_scale.py --scales 50000:64:2 --modes batch,async-2

What is real: ``RolloutScheduler``, ``EngineRouter``, ``EnvManager`` (chat template, token
ids, decoding, tool parsing, trajectories), ``plan_groups``/``run_episodes`` for ``batch``,
and the envs of ``benchmarks/rollout_scheduler.py``'s workload (``bench/heavy-tail`` and
``games/frozen-lake-v0``, stepped in this process), rendered by a real tokenizer
(``trainer.models.build_tokenizer``). What is simulated: every inference engine is a
``trainer.rollout.sim_engine.SimEngine`` (continuous batching, chunked prefill, prefix cache,
KV budget; step time from a roofline of the GPU), the training step and the weight sync are
simulated waits. Everything runs on ``trainer.rollout.sim_clock``'s loop: GPU and training
seconds are jumped over while the driver's own CPU time (the loop thread's: scheduler,
router, env managers, envs) is charged to the simulated timeline, so a driver too slow for its
engines shows as lower utilisation and as "driver busy" near 100%. CPU time rather than wall
time: other jobs on a shared machine stretch wall time (they still slow the CPU some).

Simulated cluster (defaults; flags change them):

- model: Qwen2.5-7B (bf16; 7.6B parameters, 15.2 GB of weights, 56 KiB KV per token)
- one engine per H200 (989 TFLOP/s dense bf16, 4.8 TB/s, 141 GB: NVIDIA's datasheet), step
  cost ``1 ms + max(bytes / (4.8 TB/s x 0.85), FLOPs / (989 T x 0.5))``: 0.85 is this
  project's measured H200 device memcpy (benchmarks/gpu/results/2026-11-29-h200-ipc.json),
  1 ms is a published vLLM single-request decode figure's remainder, 0.5 is an assumption
  (``trainer.rollout.sim_engine.StepCost`` says where each comes from); 4.7 ms per decode
  step up to ~120 sequences, 9.1 ms at 256; ``max_num_seqs`` 256, 8,192 batched tokens per
  step, KV cache 0.9 x 141 GB minus weights (1.9M tokens)
- training on as many H200s as there are engines (disaggregated), 8N FLOPs per trained
  token (policy forward + backward 6N, reference forward 2N) at ``--train-mfu`` 0.3 (an
  assumption; the only H200 training MFU measured here is 0.08-0.10 for the 0.5B shape, whose
  152k-entry head dominates it)
- weight sync: 15.2 GB at 36.4 GB/s (this project's measured H200 CUDA-IPC sync) = 0.42 s,
  engines do not step meanwhile

Workload (``benchmarks/rollout_scheduler.py``'s, scaled to GPU turn lengths): groups of 8,
half ``bench/heavy-tail`` (turns ~ LogNormal(median 3, sigma 0.9) clipped to 1..24, tokens
per turn ~ LogNormal(median ``--tokens-median`` 96, sigma 0.9) clipped to 1..1024), half
frozen lake 4x4 (up to 12 turns of up to ``--game-tokens`` 64 tokens: 8 times the CPU
benchmark's turn lengths, like the heavy-tail median 96 for 12). The simulated policy writes
``max_new_tokens`` copies of one token ending in EOS, so every turn uses its whole budget (and
a lake move is rarely valid: lake episodes mostly run to their 12 turns).

Modes, each for ``--steps`` training batches of ``episodes`` episodes, from the same state:
``batch`` (plan the step's groups, play all, train, sync), ``sync`` (scheduler on-policy,
redundancy ``--redundancy``), ``async-1``/``async-2`` (rollouts continue during training,
``max_staleness`` 1/2, same redundancy); ``MODE@R`` runs a mode at redundancy ``R`` instead
(``async-1@1.25``). Printed per scale and mode: trained trajectories per
simulated second and the speedup over ``batch`` (over the whole run, and after the first step:
the first batch of every mode is played with nothing to overlap, which a run of hundreds of
steps amortises), the speedup training alone would allow (the
mode's trained trajectories per simulated training second over ``batch``'s throughput: no
overlap of rollouts and training can beat it), the mean tokens of a trained trajectory (the
modes that keep playing take the episodes that finish first and drop those that grew too stale,
so their batches lean to shorter episodes than ``batch``'s, which trains every one: a
trajectory per second is then less training), engine utilisation (share of simulated time
the engines spend in steps) and mean decode batch, the share of the simulated time the driver
was busy, and the driver's real CPU per episode-turn (process CPU minus the simulated engines'
own work and the envs' own code, / generation requests; the chat template + tokenizer share
shown). An engine's steps and its intake of each request run off the simulated clock
(``VirtualClockLoop.uncharged``: a GPU worker's CPU is its own process's on a cluster), and
each engine keeps its own timeline: a driver callback that holds the loop delays the results
it sees and the requests it sends, not the steps already under way; what
the simulation still leaves on the driver: the loop waking once per engine step (printed: the
cost of firing an empty timer, measured at start, times the engine steps per turn), the timing
around each env and renderer call and the simulated clock's reads (a thread CPU clock is a
system call, a real loop's clock is not: printed, the reads per turn times their measured extra
cost; the two printed figures overlap, the timer's cost includes its clock reads).

``--env-workers N`` plays the episodes in N worker processes (``trainer.rollout.env_workers``,
``rollout.env_workers`` in a run) in lockstep with the simulated clock: each worker's CPU
(chat template, tokenizer, envs, its side of the messages) goes to its own simulated timeline,
as N processes on N cores would run, and the driver's CPU per turn is then what it costs to
route each turn and pass messages. Printed too: the workers' CPU per turn and how busy each was.
``--route-in-workers`` (with ``--env-workers``) has each worker route its own turns
(``trainer.rollout.worker_routing``, ``rollout.route_in_workers`` in a run): the driver keeps
the scheduler and sees episodes start and end. The simulated engines still live in the
driver's process (they share its clock), reached by ``RelayEngines`` over a socket of each
worker's own whose traffic, like the engines' steps, is kept off the driver's clock: on a
cluster it goes to the engines' processes. What that leaves on the driver's clock and a real
driver would not pay: the loop waking for engine steps and for the relay's messages, and a
callback per relayed result.
``--breakdown`` adds, per mode, where the driver's CPU went: the thread CPU of each event-loop
callback (a task's step is named by its coroutine), per turn, largest first. It times every
callback (two clock reads each), so that run's driver figures are ~10% high: compare
breakdowns with breakdowns. Profilers mislead here (cProfile's wall time inflates socket writes
that wake a worker, sampling overweights system calls).

Last line: ``scale_speedup_vs_batch: X x`` (best async setting with staleness <= 2 over
``batch``, at the largest scale run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import gc
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_scheduler import (
    GAME,
    GAME_KWARGS,
    HEAVY,
    make_scheduler,
    worker_setup,
    workload_env,
)

SYNC_GB_PER_S = 36.4
"""This project's measured H200 CUDA-IPC weight sync (benchmarks/gpu/results/...-ipc.json)."""


class CPU:
    """Real CPU seconds spent in the envs' own code and in chat template + tokenizer calls."""

    envs = 0.0
    renderer = 0.0


def timed(fn: Any, bucket: str) -> Any:
    """``fn``, its thread CPU time added to ``CPU.<bucket>``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(CPU, bucket, getattr(CPU, bucket) + time.thread_time() - started)

    return call


class CallbackCPU:
    """``--breakdown``: thread CPU per event-loop callback while in ``with`` (asyncio's
    ``Handle._run`` timed, put back on exit)."""

    def __init__(self) -> None:
        self.cpu: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._run: Any = None

    @staticmethod
    def name(callback: Any) -> str:
        if isinstance(callback, functools.partial):
            return CallbackCPU.name(callback.func)
        owner = getattr(callback, "__self__", None)
        if isinstance(owner, asyncio.Task):  # a task's step: named by its coroutine
            coro = owner.get_coro()
            return "task " + getattr(coro, "__qualname__", type(coro).__name__)
        return getattr(callback, "__qualname__", type(callback).__name__)

    def __enter__(self) -> Self:
        from asyncio import events

        self._run = run = events.Handle._run
        cpu, calls, name = self.cpu, self.calls, self.name

        def timed_run(handle: Any) -> None:
            loop = handle._loop
            started, off = time.thread_time(), getattr(loop, "uncharged_s", 0.0)
            try:
                run(handle)
            finally:
                key = name(handle._callback)
                off = getattr(loop, "uncharged_s", 0.0) - off  # the simulated engines' own
                cpu[key] += time.thread_time() - started - off
                calls[key] += 1

        events.Handle._run = timed_run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from asyncio import events

        events.Handle._run = self._run  # type: ignore[method-assign]

    def report(self, turns: int, rows: int = 14) -> str:
        head = (
            "    driver CPU by callback (instrumented; without the simulated engines' own, "
            f"uncharged work), us/turn and calls/turn, of {turns} turns:"
        )
        lines = [head]
        for key, seconds in self.cpu.most_common(rows):
            lines.append(
                f"    {1e6 * seconds / max(turns, 1):8.2f} {self.calls[key] / max(turns, 1):6.2f}  "
                f"{key}"
            )
        return "\n".join(lines)


class TimedEnv:
    """An env whose reset/step/close CPU counts as the envs' (they would run in env workers)."""

    def __init__(self, env: Any) -> None:
        self.reset = timed(env.reset, "envs")
        self.step = timed(env.step, "envs")
        self.close = timed(env.close, "envs")


def build_renderer() -> Any:
    from trainer.models import build_tokenizer, env_corpus
    from trainer.rollout.trajectory import ChatRenderer

    corpus = env_corpus(GAME, GAME_KWARGS, episodes=100) + [
        "Answer each message with anything.",
        "Turn 3 done.",
    ]
    renderer = ChatRenderer(build_tokenizer(corpus, "bpe"))
    for name in ("prompt", "continuation", "decode", "parse"):
        setattr(renderer, name, timed(getattr(renderer, name), "renderer"))
    return renderer


class Cluster:
    """The simulated engines and trainer of one mode's run (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, engines: int, renderer: Any) -> None:
        from trainer.rollout.sim_engine import QWEN2_5_7B, SimEngine, StepCost

        self.cost = StepCost.for_model(QWEN2_5_7B, compute_efficiency=args.compute_efficiency)
        self.sync_s = self.cost.weight_bytes / (SYNC_GB_PER_S * 1e9)
        token = renderer.encode("down")[0]
        self.engines = [
            SimEngine(
                self.cost,
                max_num_seqs=args.max_num_seqs,
                max_batched_tokens=args.max_batched_tokens,
                sync_s=self.sync_s,
                token_id=token,
                eos_token_id=renderer.eos_token_id,
            )
            for _ in range(engines)
        ]
        self.train_flops_per_token = 4 * self.cost.flops_per_token  # 8N: 6N policy + 2N ref
        train_gpus = round(engines * args.train_gpus_per_engine)
        self.train_rate = train_gpus * self.cost.gpu.peak_flops * args.train_mfu
        self.train_s = 0.0
        self.train_tokens = 0

    def load_weights(self, weights: Any) -> None:
        """A weight sync into every engine (each stops stepping for ``sync_s``)."""
        for engine in self.engines:
            engine.update_weights(weights)

    async def train(self, trajectories: list[Any]) -> None:
        """A simulated training step on the batch's tokens."""
        tokens = sum(t.num_tokens for t in trajectories)
        seconds = tokens * self.train_flops_per_token / self.train_rate
        self.train_s += seconds
        self.train_tokens += tokens
        await asyncio.sleep(seconds)


async def run_mode(
    mode: str, args: argparse.Namespace, episodes: int, engines: int, renderer: Any
) -> dict[str, float]:
    from trainer.rollout import sim_clock
    from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
    from trainer.rollout.env_workers import EnvWorkers
    from trainer.rollout.groups import plan_groups, run_episodes
    from trainer.rollout.router import EngineRouter
    from trainer.rollout.worker_routing import RelayEngines, RelayHost, WorkerRouters

    loop = asyncio.get_running_loop()
    if not isinstance(loop, sim_clock.VirtualClockLoop):
        raise TypeError("run_mode runs on trainer.rollout.sim_clock.run's loop")
    cluster = Cluster(args, engines, renderer)
    router: Any = EngineRouter(cluster.engines, clock=loop.time)
    if args.route_in_workers:  # each env worker routes its turns; the engines stay here
        router = WorkerRouters(
            RelayEngines(engines),
            engines,
            update=cluster.load_weights,
            relay=RelayHost(cluster.engines, off_clock=loop.uncharged),
            clock=loop.time,
        )
    manager: Any
    if args.env_workers:
        manager = EnvWorkers(
            router,
            functools.partial(worker_setup, args, renderer.tokenizer),
            workers=args.env_workers,
            lockstep=True,
        )
        await manager.start()
    else:
        manager = EnvManager(
            router,
            renderer,
            max_turns=args.max_turns,
            max_context_tokens=args.max_context,
            generate_timeout_s=args.generate_timeout,
        )

    def make(env_id: str, **kwargs: Any) -> Any:
        return TimedEnv(timed(workload_env, "envs")(env_id, args))

    source = LocalEnvSource(make=make)
    sampling = Sampling(args.max_tokens)
    env_ids = [HEAVY, GAME]
    groups = episodes // args.group_size
    trained, staleness = 0, 0
    first: tuple[float, int] | None = None  # (clock, trained) once the first step is done
    CPU.envs = CPU.renderer = 0.0
    lanes0 = getattr(manager, "lane_busy_s", 0.0)
    charged0, uncharged0, reads0 = loop.charged_s, loop.uncharged_s, loop.clock_reads
    breakdown = CallbackCPU() if args.breakdown else None
    with breakdown or contextlib.nullcontext():
        cpu0, real0, sim0 = time.process_time(), time.perf_counter(), loop.time()
        if mode == "batch":
            for step in range(args.steps):
                specs = plan_groups(
                    step, num_groups=groups, group_size=args.group_size, env_ids=env_ids, seed=0
                )
                finished, _ = await run_episodes(specs, manager, source, sampling)
                await cluster.train(finished)
                router.update_weights({})
                trained += len(finished)
                first = first or (loop.time(), trained)
        else:
            scheduler = make_scheduler(
                mode, groups, args, env_ids, manager, router, source, sampling
            )
            try:
                for _ in range(args.steps):
                    batch = await scheduler.next_batch()
                    staleness = max(  # the scheduler's own count of trajectories per lag
                        [staleness]
                        + [
                            int(name.rpartition("_")[2])
                            for name, count in batch.metrics.items()
                            if name.startswith("rollout/staleness_") and count
                        ]
                    )
                    await cluster.train(batch.trajectories)  # rollouts go on meanwhile (async)
                    await scheduler.update_weights({})
                    trained += len(batch.trajectories)
                    first = first or (loop.time(), trained)
            finally:
                await scheduler.close()
        sim_s = loop.time() - sim0
        charged = loop.charged_s - charged0
        reads = loop.clock_reads - reads0
        real_s, cpu_s = time.perf_counter() - real0, time.process_time() - cpu0
    stats = [e.stats for e in cluster.engines]
    workers_cpu = getattr(manager, "lane_busy_s", 0.0) - lanes0
    if args.env_workers:
        await manager.close()
    for engine in cluster.engines:
        await engine.close()
    engine_cpu = loop.uncharged_s - uncharged0  # the simulated engines' own CPU
    turns = router.totals().requests
    driver_cpu = cpu_s - engine_cpu - CPU.envs
    steps = sum(s.steps for s in stats)
    if breakdown is not None:
        print(breakdown.report(turns), flush=True)
    return {
        "trajectories": trained,
        "sim_s": sim_s,
        "traj_per_s": trained / sim_s,
        "steady_traj_per_s": (trained - first[1]) / max(loop.time() - first[0], 1e-9)
        if first and trained > first[1]
        else trained / sim_s,
        "utilisation": sum(s.busy_s for s in stats) / (engines * sim_s),
        "decode_batch": sum(s.decode_seq_steps for s in stats) / max(steps, 1),
        "tokens_per_s": sum(s.new_tokens for s in stats) / sim_s,
        "train_s": cluster.train_s,
        "train_bound": trained / max(cluster.train_s, 1e-9),
        "tokens_per_traj": cluster.train_tokens / max(trained, 1),
        "staleness": staleness,
        "turns": turns,
        "real_s": real_s,
        "driver_busy": charged / sim_s,
        "driver_us_per_turn": 1e6 * driver_cpu / max(turns, 1),
        "template_us_per_turn": 1e6 * CPU.renderer / max(turns, 1),
        "env_us_per_turn": 1e6 * CPU.envs / max(turns, 1),
        "engine_us_per_turn": 1e6 * engine_cpu / max(turns, 1),
        "engine_steps_per_turn": steps / max(turns, 1),
        "clock_reads_per_turn": reads / max(turns, 1),
        "workers_us_per_turn": 1e6 * workers_cpu / max(turns, 1),
        "workers_busy": workers_cpu / (max(args.env_workers, 1) * sim_s),
    }


def wakeup_cost_s(timers: int = 20_000) -> float:
    """CPU seconds the simulated clock charges for the loop to fire one empty timer: what each
    simulated engine step still costs the driver's timeline (its own work is off the clock)."""
    from trainer.rollout import sim_clock

    async def chain() -> float:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def tick(left: int) -> None:
            if left:
                loop.call_at(loop.time() + 0.001, tick, left - 1)
            else:
                done.set_result(None)

        start = loop.time()
        tick(timers)
        await done
        return (loop.time() - start - 0.001 * timers) / timers

    return sim_clock.run(chain())


def clock_read_cost_s(reads: int = 200_000) -> float:
    """CPU seconds one read of the simulated clock costs beyond a real loop's clock read (a
    thread CPU clock is a system call, ``time.monotonic`` is not): the simulation's own cost
    per ``VirtualClockLoop.clock_reads``."""
    import threading

    cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
    started = time.thread_time()
    for _ in range(reads):
        time.clock_gettime(cpu_clock)
    middle = time.thread_time()
    for _ in range(reads):
        time.monotonic()
    return max(0.0, (middle - started) - (time.thread_time() - middle)) / reads


def peak_gib() -> float:
    """Peak RSS of this process (the driver), GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scales",
        default="1000:8:4,10000:64:3,50000:64:2",
        help="comma-separated EPISODES:ENGINES[:STEPS] (episodes per training batch, training "
        "batches per mode; default --steps)",
    )
    parser.add_argument("--steps", type=int, default=3, help="training batches per mode")
    parser.add_argument(
        "--env-workers",
        type=int,
        default=0,
        help="play episodes in this many env worker processes (trainer.rollout.env_workers); "
        "0: in the driver",
    )
    parser.add_argument(
        "--route-in-workers",
        action="store_true",
        help="each env worker routes its own turns to the engines "
        "(trainer.rollout.worker_routing; needs --env-workers)",
    )
    parser.add_argument("--modes", default="batch,sync,async-1,async-2")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="print the driver's CPU per event-loop callback for each mode (instrumented: ~10%% "
        "higher driver figures)",
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--redundancy", type=float, default=1.5)
    parser.add_argument("--turns-median", type=float, default=3.0)
    parser.add_argument("--tokens-median", type=float, default=96.0)
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--game-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--compute-efficiency", type=float, default=0.5)
    parser.add_argument("--train-mfu", type=float, default=0.3)
    parser.add_argument(
        "--train-gpus-per-engine", type=float, default=1.0, help="training H200s per engine"
    )
    parser.add_argument(
        "--generate-timeout",
        type=float,
        default=600.0,
        help="rollout.generate_timeout_s, simulated seconds",
    )
    args = parser.parse_args()
    if args.route_in_workers and not args.env_workers:
        parser.error("--route-in-workers needs --env-workers N (the workers route)")

    from envhub.gc_tuning import relax_gc
    from trainer.rollout import sim_clock

    relax_gc()  # as the trainer's driver does (trainer.rollout.rollouts)
    renderer = build_renderer()
    wakeup_s, read_s = wakeup_cost_s(), clock_read_cost_s()
    print(
        "SIMULATED cluster (GPU, training and sync times simulated; driver CPU real): "
        f"Qwen2.5-7B on H200s, groups of {args.group_size}, "
        f"redundancy {args.redundancy}, heavy-tail turns ~LogN({args.turns_median}, "
        f"{args.sigma}) x tokens ~LogN({args.tokens_median}, {args.sigma}) + {GAME}",
        flush=True,
    )
    best, default_steps = 0.0, args.steps
    for scale in args.scales.split(","):
        episodes, engines, *steps = (int(x) for x in scale.split(":"))
        args.steps = steps[0] if steps else default_steps
        results: dict[str, dict[str, float]] = {}
        for mode in args.modes.split(","):
            gc.collect()
            r = results[mode] = sim_clock.run(run_mode(mode, args, episodes, engines, renderer))
            base = results.get("batch", r)["traj_per_s"]
            wake_us = 1e6 * wakeup_s * r["engine_steps_per_turn"]
            reads_us = 1e6 * read_s * r["clock_reads_per_turn"]
            steady_base = results.get("batch", r)["steady_traj_per_s"]
            print(
                f"{episodes:>6} episodes / {engines:>2} engines {mode:>12}: "
                f"{r['traj_per_s']:8.1f} traj/s (simulated), speedup {r['traj_per_s'] / base:5.2f} "
                f"x (after the first step: {r['steady_traj_per_s']:.1f} traj/s, "
                f"{r['steady_traj_per_s'] / steady_base:.2f} x), engine utilisation "
                f"{100 * r['utilisation']:5.1f}%, decode batch "
                f"{r['decode_batch']:5.1f}, {r['tokens_per_s'] / engines:6.0f} tok/s per engine, "
                f"staleness <= {r['staleness']:.0f}, {r['tokens_per_traj']:.0f} tokens per trained "
                f"trajectory; {r['sim_s']:7.1f} s simulated "
                f"({r['train_s']:.1f} s training: training alone bounds this mode at "
                f"{r['train_bound'] / base:.2f} x) in {r['real_s']:6.1f} s real; the driver busy "
                f"{100 * r['driver_busy']:4.1f}% of the simulated time, its CPU "
                f"{r['driver_us_per_turn']:5.1f} us/turn ({r['template_us_per_turn']:.1f} of it "
                f"chat template + tokenizer, ~{wake_us:.1f} the loop waking for "
                f"{r['engine_steps_per_turn']:.1f} simulated engine steps, ~{reads_us:.1f} the "
                f"simulated clock's own {r['clock_reads_per_turn']:.1f} reads) over "
                f"{r['turns']:.0f} turns, not counted: envs "
                f"{r['env_us_per_turn']:.1f}, simulated engines {r['engine_us_per_turn']:.1f}"
                + (
                    f"; {args.env_workers} env workers: {r['workers_us_per_turn']:.1f} us/turn "
                    f"of their own CPU, each busy {100 * r['workers_busy']:.1f}%"
                    if args.env_workers
                    else ""
                )
                + f"; peak RSS {peak_gib():.1f} GiB; load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        asyncs = [m for m in results if m.startswith("async") and int(m.split("@")[0][6:]) <= 2]
        if "batch" in results and asyncs:
            best = max(results[m]["traj_per_s"] for m in asyncs) / results["batch"]["traj_per_s"]
    print(f"scale_speedup_vs_batch: {best:.2f} x")


if __name__ == "__main__":
    main()
