"""Median step latency and steps/s of each code, web and tool env (warm, one process).

Why: these envs do real work per step — a sandboxed Python run, a SQLite query, an MCP round
trip, a Chromium page action — so their step cost, not the hub's overhead, sizes a pool.
Each env is built and warmed (first reset and a step, which start sandboxes, browsers and
servers) before timing; then the oracle plays episodes and every ``step`` is timed (resets
are timed separately). Envs whose component is missing (Chromium) are skipped.

The code envs run twice, side by side: as they are by default (a warm local sandbox: the
test runner, or the checker, is forked by the sandbox's fork server) and on the path that
default replaced (``sandbox_options={"warm_exec": False}``: a new bubblewrap sandbox
process, and for HumanEval a new interpreter, per run).

    python benchmarks/env_step_cost.py [--steps 30] [--only code/]

Last line: ``code_humaneval_step_median: X ms`` (one sandboxed test run per step: the
costliest common step, the figure that sizes a code-RL pool).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import envhub

ONE_SHOT = {"sandbox_options": {"warm_exec": False}}
ENVS: dict[str, tuple[str, dict[str, Any]]] = {
    name: (name, {})
    for name in (
        "tools/calculator-v0",
        "tools/sql-v0",
        "tools/retrieval-v0",
        "tools/mcp-v0",
        "web/shop-v0",
        "web/shop-http-v0",
        "web/browser-v0",
        "code/humaneval-v0",
        "code/terminal-v0",
    )
}
ENVS["code/humaneval-v0 one-shot"] = ("code/humaneval-v0", ONE_SHOT)
ENVS["code/terminal-v0 one-shot"] = ("code/terminal-v0", ONE_SHOT)
"""Row label -> (env id, make kwargs); "one-shot" rows are the path the warm default replaced."""


def measure(label: str, steps: int) -> dict[str, float] | None:
    env_id, kwargs = ENVS[label]
    try:
        env = envhub.make(env_id, **kwargs)
        env.reset(seed=0)
        env.step(env.expert_action())
    # a missing component: no Chromium or sandbox (RuntimeErrors), no extra installed
    except (RuntimeError, ImportError, OSError) as exc:
        print(f"{label:28} skipped: {type(exc).__name__}: {str(exc)[:80]}")
        return None
    step_times, reset_times, seed = [], [], 1
    try:
        start = time.perf_counter()
        env.reset(seed=seed)
        reset_times.append(time.perf_counter() - start)
        while len(step_times) < steps:
            if env.done:
                seed += 1
                start = time.perf_counter()
                env.reset(seed=seed)
                reset_times.append(time.perf_counter() - start)
            action = env.expert_action()
            start = time.perf_counter()
            env.step(action)
            step_times.append(time.perf_counter() - start)
    finally:
        env.close()
    median = statistics.median(step_times)
    row = {
        "step_median_ms": median * 1e3,
        "step_p90_ms": statistics.quantiles(step_times, n=10)[-1] * 1e3,
        "steps_per_s": len(step_times) / sum(step_times),
        "reset_median_ms": statistics.median(reset_times) * 1e3,
    }
    print(
        f"{label:28} step median {row['step_median_ms']:8.1f} ms  p90 {row['step_p90_ms']:8.1f} "
        f"ms  {row['steps_per_s']:8.1f} steps/s  reset median {row['reset_median_ms']:8.1f} ms",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per env")
    parser.add_argument("--only", default="", help="measure only the rows starting with this")
    args = parser.parse_args()
    results = {label: measure(label, args.steps) for label in ENVS if label.startswith(args.only)}
    for name in ("code/humaneval-v0", "code/terminal-v0"):
        warm, cold = results.get(name), results.get(f"{name} one-shot")
        if warm and cold:
            speedup = cold["step_median_ms"] / warm["step_median_ms"]
            print(f"{name}: warm sandbox {speedup:.1f} x faster per step than one-shot")
    humaneval = results.get("code/humaneval-v0")
    print(
        f"code_humaneval_step_median: {humaneval['step_median_ms']:.0f} ms"
        if humaneval
        else "code_humaneval_step_median: nan ms"
    )


if __name__ == "__main__":
    main()
