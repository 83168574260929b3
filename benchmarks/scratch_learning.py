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

from quickstart_learning import learning_benchmark

if __name__ == "__main__":
    learning_benchmark(__doc__, "examples/scratch.yaml", "scratch")
