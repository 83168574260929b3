"""Eval success vs wall time of the README's main command, `envhub train examples/quickstart.yaml`.

Runs the real command in a subprocess per seed (warm start included in the clock), then
reads each run's metrics.jsonl and prints eval success at every evaluation, the time each
phase took (so a run slowed by a shared machine can be told from a slow trainer), and the
load average; copies the first run's reward curve to benchmarks/quickstart_learning.png.
Last line: ``quickstart_eval_success: X`` (the final evaluation, greedy, fixed eval maps;
the mean over seeds when several are run).

    python benchmarks/quickstart_learning.py [--seeds 0 1 2] [--mode batch|sync|async]
        [a.b=value ...]

``--mode`` sets ``rollout.mode`` (``async``: rollouts continue while the trainer trains, within
``rollout.max_staleness``), so one command compares the rollout modes on the same seeds.

``run_learning`` is shared with ``scratch_learning.py`` (RL from random weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_learning(config: str, seed: int, overrides: list[str], out: Path) -> dict[str, Any]:
    """Run ``envhub train config seed=... output_dir=out``; print its evaluations; return a
    summary."""
    shutil.rmtree(out, ignore_errors=True)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    command = [
        sys.executable,
        "-m",
        "envhub.cli",
        "train",
        str(ROOT / config),
        f"seed={seed}",
        f"output_dir={out}",
        "logging.progress=false",
        *overrides,
    ]
    subprocess.run(command, cwd=ROOT, check=True)
    wall = time.monotonic() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [
        (r["step"], r["time_s"], r["eval/success"])
        for r in rows
        if r.get("eval/success") is not None
    ]
    phases = {
        k.removeprefix("timing/").removesuffix("_s"): sum(r.get(k, 0.0) for r in rows)
        for k in ("timing/rollout_s", "timing/train_s", "timing/eval_s")
    }
    print(
        f"\n== {config} seed={seed}: load average before {load_before:.1f}, after "
        f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)"
    )
    print("step  time_s  eval/success")
    for step, seconds, success in evals:
        print(f"{step:4d}  {seconds:6.0f}  {success:.3f}")
    reached = next((seconds for _, seconds, success in evals if success >= 0.8), None)
    steps = rows[-1]["step"]
    sampled = [r["train/success"] for r in rows if r.get("train/success") is not None]
    first, last = sampled[:10], sampled[-10:]
    print(
        f"sampled train success: first 10 steps {sum(first) / max(len(first), 1):.3f}, "
        f"last 10 steps {sum(last) / max(len(last), 1):.3f}"
    )
    print(
        f"eval success before RL (step 0): {evals[0][2]:.3f}; final: {evals[-1][2]:.3f}; first >= "
        f"0.8 at {'never' if reached is None else f'{reached:.0f} s'}; {steps} RL steps; warm "
        f"start + step-0 eval {rows[0]['time_s']:.0f} s; phases: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
        + f"; process wall time {wall:.0f} s"
    )
    return {
        "seed": seed,
        "start": evals[0][2],
        "final": evals[-1][2],
        "min_after_reaching": min(
            (s for _, t, s in evals if reached is not None and t >= reached), default=None
        ),
        "reached_s": reached,
        "wall_s": wall,
        "steps": steps,
        "out": out,
        "train_first10": sum(first) / max(len(first), 1),
        "train_last10": sum(last) / max(len(last), 1),
    }


def report(results: list[dict[str, Any]], name: str) -> None:
    """The per-seed table (sampled train success of the first and last 10 steps, greedy eval at
    step 0 and at the end, when 0.8 was first reached, wall time), then the last line
    ``{name}: X`` with the mean final evaluation."""
    print("\nseed  train first10  last10  step0  final  first>=0.8  wall")
    for r in results:
        reached = "never" if r["reached_s"] is None else f"{r['reached_s']:.0f} s"
        print(
            f"{r['seed']:4d}  {r['train_first10']:13.3f}  {r['train_last10']:6.3f}  "
            f"{r['start']:.3f}  {r['final']:.3f}  {reached:>10}  {r['wall_s']:.0f} s"
        )
    print(f"{name}: {sum(r['final'] for r in results) / len(results):.3f}")


def learning_benchmark(doc: str, config: str, name: str) -> None:
    """The command line of a learning benchmark: ``[--seeds S ...] [a.b=value ...]``; one run
    of ``config`` per seed, the first run's curve copied to ``benchmarks/{name}_learning.png``,
    then ``report`` (last line ``{name}_eval_success: X``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one run per seed (default: 0)"
    )
    args, overrides = parser.parse_known_args()
    results = [
        run_learning(config, seed, overrides, ROOT / "runs" / f"bench-{name}-{seed}")
        for seed in args.seeds
    ]
    shutil.copy(
        results[0]["out"] / "reward_curve.png", ROOT / "benchmarks" / f"{name}_learning.png"
    )
    report(results, f"{name}_eval_success")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one run per seed (default: 0)"
    )
    parser.add_argument(
        "--mode",
        choices=("batch", "sync", "async"),
        default=None,
        help="rollout.mode of every run (default: the config's, batch)",
    )
    argv = sys.argv[1:]
    # a.b=value, anywhere on the line
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in argv if a not in overrides])
    if args.mode is not None:
        overrides = [f"rollout.mode={args.mode}", *overrides]
    tag = f"{args.mode}-" if args.mode is not None else ""
    results = [
        run_learning(
            "examples/quickstart.yaml",
            seed,
            overrides,
            ROOT / "runs" / f"bench-quickstart-{tag}{seed}",
        )
        for seed in args.seeds
    ]
    shutil.copy(
        results[0]["out"] / "reward_curve.png", ROOT / "benchmarks" / "quickstart_learning.png"
    )
    print(f"\nrollout mode: {args.mode or 'config default'}")
    report(results, "quickstart_eval_success")


if __name__ == "__main__":
    main()
