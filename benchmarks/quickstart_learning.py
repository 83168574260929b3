"""Eval success vs wall time of the README's main command, `envhub train examples/quickstart.yaml`.

Runs the real command in a subprocess (warm start included in the clock), then reads its
metrics.jsonl and prints eval success at every evaluation, the load average (the 2 vCPUs of
the reference machine are shared, so slow runs say why), and copies the run's reward curve
to benchmarks/quickstart_learning.png. Last line: ``quickstart_eval_success: X`` (the final
evaluation, greedy, fixed eval maps).

    python benchmarks/quickstart_learning.py [extra a.b=value overrides]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    out = ROOT / "runs" / "bench-quickstart"
    shutil.rmtree(out, ignore_errors=True)
    load_before = os.getloadavg()
    started = time.monotonic()
    command = [sys.executable, "-m", "envhub.cli", "train", str(ROOT / "examples" / "quickstart.yaml"),
               f"output_dir={out}", "logging.progress=false", *sys.argv[1:]]
    subprocess.run(command, cwd=ROOT, check=True)
    wall = time.monotonic() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["time_s"], r["eval/success"]) for r in rows if r.get("eval/success") is not None]
    print(f"\nload average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} (2 vCPUs)")
    print("step  time_s  eval/success")
    for step, seconds, success in evals:
        print(f"{step:4d}  {seconds:6.0f}  {success:.3f}")
    reached = next((seconds for _, seconds, success in evals if success >= 0.8), None)
    print(f"eval success before RL (step 0): {evals[0][2]:.3f}; first >= 0.8 at "
          f"{'never' if reached is None else f'{reached:.0f} s'}; process wall time {wall:.0f} s")
    shutil.copy(out / "reward_curve.png", ROOT / "benchmarks" / "quickstart_learning.png")
    print(f"quickstart_eval_success: {evals[-1][2]:.3f}")


if __name__ == "__main__":
    main()
