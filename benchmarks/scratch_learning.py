"""RL alone from random weights: eval success vs wall time of `envhub train examples/scratch.yaml`.

No warm start: a freshly initialised tiny policy on the easiest Frozen Lake (random 2x2
maps, one-token answers). Runs the real command in a subprocess per seed, prints eval
success at every evaluation and the phase times, and copies the first run's reward curve
to benchmarks/scratch_learning.png. Last line: ``scratch_eval_success: X``, the final greedy
evaluation (the mean over seeds when several are run); the sampled training success of the
first and last 10 steps is printed above it. Greedy success lags the sampled one: until the
policy tells the maps (and its position) apart, its most likely move is the same every turn.

    python benchmarks/scratch_learning.py [--seeds 0 1 2] [extra a.b=value overrides]
"""

from __future__ import annotations

import argparse
import shutil

from quickstart_learning import ROOT, run_learning


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one run per seed (default: 0)"
    )
    args, overrides = parser.parse_known_args()
    results = [
        run_learning(
            "examples/scratch.yaml", seed, overrides, ROOT / "runs" / f"bench-scratch-{seed}"
        )
        for seed in args.seeds
    ]
    shutil.copy(
        results[0]["out"] / "reward_curve.png", ROOT / "benchmarks" / "scratch_learning.png"
    )
    print("\nseed  train first10  train last10  eval step0  eval final  wall")
    for r in results:
        print(
            f"{r['seed']:4d}  {r['train_first10']:13.3f}  {r['train_last10']:12.3f}  "
            f"{r['start']:10.3f}  {r['final']:10.3f}  {r['wall_s']:.0f} s"
        )
    print(f"scratch_eval_success: {sum(r['final'] for r in results) / len(results):.3f}")


if __name__ == "__main__":
    main()
