"""The tool-use quickstart learns to use tools: eval success vs wall time of
`envhub train examples/tools-quickstart.yaml`.

Runs the real command in a subprocess per seed (warm start included in the clock), prints eval
success at every evaluation (greedy, 128 fixed held-out tasks) and the phase times, and copies the
first run's reward curve to benchmarks/tools_learning.png. Goal: <= 0.30 at step 0 (the sloppy
warm start guesses), >= 0.80 within 15 minutes on a 2-core machine, for every seed. Last line:
``tools_eval_success: X`` (the final evaluation; the mean over seeds when several are run).

    python benchmarks/tools_learning.py [--seeds 0 1 2] [extra a.b=value overrides]
"""

from __future__ import annotations

from quickstart_learning import learning_benchmark

if __name__ == "__main__":
    learning_benchmark(__doc__, "examples/tools-quickstart.yaml", "tools")
